"""mx.array <-> protobuf Tensor: dtype, shape and the raw buffer; never pickle.

Everything a peer sends is checked before an array is built from it: the dtype must be on
the allowlist, the shape must match what the receiver expects (``expect`` pins dimensions,
``None`` leaves one free), and the byte length must be exactly shape × itemsize.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from meshnode.proto import mesh_pb2

# Wire name -> (mlx dtype, numpy view dtype used to move the bytes, itemsize).
# bfloat16 has no numpy dtype: its bytes travel as uint16 and are reinterpreted by MLX.
_DTYPES: dict[str, tuple[mx.Dtype, np.dtype, int]] = {
    "float32": (mx.float32, np.dtype("<f4"), 4),
    "float16": (mx.float16, np.dtype("<f2"), 2),
    "bfloat16": (mx.bfloat16, np.dtype("<u2"), 2),
    "int32": (mx.int32, np.dtype("<i4"), 4),
}
_NAMES = {mx_dtype: name for name, (mx_dtype, _, _) in _DTYPES.items()}

MAX_TENSOR_BYTES = 256 * 2**20  # no single activation is anywhere near this


class WireError(ValueError):
    """A tensor from a peer that does not match what was expected."""


def to_tensor(array: mx.array) -> mesh_pb2.Tensor:
    name = _NAMES.get(array.dtype)
    if name is None:
        raise WireError(f"dtype {array.dtype} cannot be sent")
    _, np_dtype, _ = _DTYPES[name]
    if name == "bfloat16":
        array = array.view(mx.uint16)
    data = np.asarray(array, dtype=np_dtype).tobytes()
    return mesh_pb2.Tensor(dtype=name, shape=list(array.shape), data=data)


def from_tensor(
    tensor: mesh_pb2.Tensor,
    *,
    dtypes: Sequence[str] = tuple(_DTYPES),
    expect: Sequence[int | None] | None = None,
    max_bytes: int = MAX_TENSOR_BYTES,
) -> mx.array:
    """Validate a received tensor and build an mx.array from it."""
    if tensor.dtype not in _DTYPES or tensor.dtype not in dtypes:
        raise WireError(f"dtype {tensor.dtype!r} not allowed (allowed: {', '.join(dtypes)})")
    mx_dtype, np_dtype, itemsize = _DTYPES[tensor.dtype]
    shape = tuple(int(d) for d in tensor.shape)
    if not shape or len(shape) > 4 or any(d <= 0 for d in shape):
        raise WireError(f"bad shape {shape}")
    if expect is not None:
        if len(expect) != len(shape) or any(e is not None and e != d for e, d in zip(expect, shape)):
            raise WireError(f"shape {shape} does not match expected {tuple(expect)}")
    nbytes = itemsize * int(np.prod(shape, dtype=np.int64))
    if nbytes > max_bytes:
        raise WireError(f"tensor of {nbytes} bytes exceeds the limit of {max_bytes}")
    if len(tensor.data) != nbytes:
        raise WireError(f"{len(tensor.data)} bytes for shape {shape} {tensor.dtype} (expected {nbytes})")
    host = np.frombuffer(tensor.data, dtype=np_dtype).reshape(shape)
    array = mx.array(host)
    if tensor.dtype == "bfloat16":
        array = array.view(mx.bfloat16)
    return array
