"""OpenBLAS under MLX's CPU matmuls on Linux, where MLX's reference BLAS gains nothing from several
rows. ``MESHNODE_BLAS`` (``auto``, ``reference`` or a CBLAS library's path) is read on the first
import of :mod:`meshnode`; the library is loaded with ``RTLD_GLOBAL`` before MLX, so MLX binds to it.
OpenBLAS rounding varies with the rows per step: bit-exact tests against mlx-lm use the reference.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable, Mapping

from meshnode.errors import MeshnodeError

ENV = "MESHNODE_BLAS"
THREADS_ENV = "OPENBLAS_NUM_THREADS"
# What Debian's, Ubuntu's and Fedora's OpenBLAS packages put on the loader's path.
NAMES = ("libopenblas.so.0", "libopenblas.so", "libopenblasp.so.0", "libopenblas64_.so.0")

_loaded: str | None = None
problem: str | None = None  # why MESHNODE_BLAS could not be followed (logged at start)


class BlasError(MeshnodeError, ValueError):
    """``MESHNODE_BLAS`` names something that cannot be used."""


def choose(setting: str, platform: str, find: Callable[[], str | None]) -> str | None:
    """The library to load for ``setting`` on ``platform``, or None for MLX's own. Pure but for ``find``."""
    setting = (setting or "auto").strip()
    if platform != "linux" or setting.lower() == "reference":
        return None
    if setting.lower() == "auto":
        return find()
    if os.sep not in setting:
        raise BlasError(f"{ENV}={setting!r}: use auto, reference, or the path of a BLAS library")
    return setting


def _open(name: str, mode: int) -> ctypes.CDLL:
    """Loads ``name``; OpenBLAS reads its thread count then: one unless set, so nodes sharing a
    machine do not fight with spinning threads."""
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
    """Loads the BLAS ``env[ENV]`` asks for, before MLX, once per process; the library, or None."""
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
    """The library :func:`use_fast_blas` loaded, or None (MLX's own)."""
    return _loaded


def in_use() -> str:
    """What computes MLX's CPU matmuls in this process, in words."""
    if sys.platform == "darwin":
        return "Accelerate (MLX's own)"
    if _loaded is None:
        return "MLX's own BLAS"
    return f"OpenBLAS ({_loaded})" if "openblas" in _loaded.lower() else _loaded
