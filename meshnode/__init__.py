"""meshnode: run one large language model across the machines of a home lab."""

from meshnode import blas as _blas

__version__ = "0.1.0"

# Before anything imports MLX.
try:
    _blas.use_fast_blas()
except _blas.BlasError as _exc:
    _blas.problem = str(_exc)
