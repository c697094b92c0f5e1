"""Benchmarks: figures and ratios against mlx-lm measured in the same run (docs/benchmarks.md)."""

# meshnode first, so that mlx-lm in a benchmark's own process computes on the BLAS its nodes use
# (meshnode.blas: OpenBLAS where the system has it, unless MESHNODE_BLAS says otherwise).
from meshnode import blas as _blas

_blas.use_fast_blas()  # (already done by meshnode's import; says why it is here)
