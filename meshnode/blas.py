"""OpenBLAS under MLX's CPU matrix multiplies on Linux (``MESHNODE_BLAS``).

MLX's Linux CPU wheel (``mlx[cpu]`` 0.32) links the netlib *reference* BLAS: plain loops, about
4.5 GFLOP/s for a float32 matmul on one core here, whatever its shape, so a prompt's positions
cost nearly what as many decode steps do and a batch of requests runs no faster than one after
the other. The same ``cblas_sgemm`` from OpenBLAS runs 7x faster for 4 rows and 25x for 64
(measured here: a 113-token prompt of the bench llama prefilled in 0.37 s instead of 5.15 s,
decode 23.1 tok/s instead of 18.2, four requests batched 3.9x the tokens/s of one instead of
1.1x). Loaded into the process before MLX with ``RTLD_GLOBAL``, its symbols come first in the
global lookup, so MLX's library binds to them instead of its own copy's.

``MESHNODE_BLAS``: ``auto`` (the default: OpenBLAS where the system has it, e.g. Debian's
``libopenblas0``), ``reference`` (MLX's own), or the path of a BLAS library exporting the CBLAS
interface. OpenBLAS computes on one thread per process unless ``OPENBLAS_NUM_THREADS`` says more.
Read once, when :mod:`meshnode` is first imported, which must come before ``mlx``'s
import in the process (a node, its workers and probes all start from :mod:`meshnode`). Children
inherit the variable, so a node's workers compute with the same library. macOS has Apple's
Accelerate under MLX already, and there this does nothing.

Exactness: the reference BLAS computes each output as one loop, so a row's result does not
depend on how many rows are multiplied with it, and a split, batched or speculating mesh gives
mlx-lm's greedy tokens bit for bit. OpenBLAS's kernels block by shape, so rounding differs with
the number of positions in a step, as on a GPU (README, "Greedy identity on the GPU"): the tests
that compare with mlx-lm run on the reference BLAS (``tests/conftest.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable, Mapping

ENV = "MESHNODE_BLAS"
THREADS_ENV = "OPENBLAS_NUM_THREADS"
# Debian/Ubuntu's libopenblas0-pthread and Fedora's openblas put one of these on the loader's path.
NAMES = ("libopenblas.so.0", "libopenblas.so", "libopenblasp.so.0", "libopenblas64_.so.0")

_loaded: str | None = None  # the library loaded by use_fast_blas, if any
problem: str | None = None  # why MESHNODE_BLAS could not be followed (logged by the node at start)


class BlasError(ValueError):
    """``MESHNODE_BLAS`` names something that cannot be used."""


def choose(setting: str, platform: str, find: Callable[[], str | None]) -> str | None:
    """The library to load for ``setting`` on ``platform`` (``sys.platform``), or None for MLX's own.
    ``find()``: OpenBLAS's name or path on this system, or None. Pure but for ``find``."""
    setting = (setting or "auto").strip()
    if platform != "linux" or setting.lower() == "reference":
        return None
    if setting.lower() == "auto":
        return find()
    if os.sep not in setting:
        raise BlasError(f"{ENV}={setting!r}: use auto, reference, or the path of a BLAS library")
    return setting


def _open(name: str, mode: int) -> ctypes.CDLL:
    """``name`` loaded (or found loaded). OpenBLAS reads its thread count once, when it first loads,
    so it is set here, before: one thread, unless set. MLX computes on one thread too, a process
    that pins itself to a core later (a benchmark's mlx-lm) would leave OpenBLAS's other threads
    unpinned, and nodes sharing a machine (tests, a ring probe) must not fight for its cores with
    spinning BLAS threads. Children inherit it."""
    os.environ.setdefault(THREADS_ENV, "1")
    return ctypes.CDLL(name, mode=mode)


def find_openblas() -> str | None:
    """OpenBLAS as the dynamic loader would find it, or None."""
    for name in NAMES:
        try:
            _open(name, ctypes.RTLD_LOCAL)
            return name
        except OSError:
            continue
    return ctypes.util.find_library("openblas")


def use_fast_blas(env: Mapping[str, str] = os.environ) -> str | None:
    """Load the BLAS ``env[ENV]`` asks for (see the module's text) into the process, before MLX;
    the library loaded, or None. Once per process; after MLX's import it changes nothing."""
    global _loaded
    if _loaded is not None or "mlx.core" in sys.modules:
        return _loaded
    setting = env.get(ENV, "auto")
    lib = choose(setting, sys.platform, find_openblas)
    if lib is None:
        return None
    try:
        _open(lib, ctypes.RTLD_GLOBAL)
    except OSError as exc:
        if setting.strip().lower() in ("", "auto"):
            return None
        raise BlasError(f"{ENV}={lib!r} could not be loaded: {exc}") from exc
    _loaded = lib
    return lib


def loaded() -> str | None:
    """The library :func:`use_fast_blas` loaded for MLX's CPU matmuls, or None (MLX's own)."""
    return _loaded


def in_use() -> str:
    """What computes MLX's CPU matmuls in this process, in words (status pages, benchmark headers)."""
    if sys.platform == "darwin":
        return "Accelerate (MLX's own)"
    if _loaded is None:
        return "MLX's own BLAS"
    return f"OpenBLAS ({_loaded})" if "openblas" in _loaded.lower() else _loaded
