"""mx.array <-> protobuf Tensor: dtype, shape and the raw buffer; never pickle. A peer's tensor is
checked before an array is built: dtype allowed, shape as expected (``None``: any), bytes exactly
shape × itemsize.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from meshnode.errors import MeshnodeError
from meshnode.proto import mesh_pb2

# Wire name -> (mlx dtype, numpy view dtype: its itemsize is the wire's); bfloat16 travels as uint16.
_DTYPES: dict[str, tuple[mx.Dtype, np.dtype]] = {
    "float32": (mx.float32, np.dtype("<f4")),
    "float16": (mx.float16, np.dtype("<f2")),
    "bfloat16": (mx.bfloat16, np.dtype("<u2")),
    "int32": (mx.int32, np.dtype("<i4")),
}
_NAMES = {mx_dtype: name for name, (mx_dtype, _) in _DTYPES.items()}
# A stage's activations: whatever dtype its layers produce.
ACTIVATIONS = ("float32", "float16", "bfloat16")

MAX_TENSOR_BYTES = 256 * 2**20  # no single activation is anywhere near this
# Every frame: this little-endian uint32 length, then the payload.
LENGTH = struct.Struct("<I")


def dtype_name(dtype: mx.Dtype) -> str:
    """The wire name of an MLX dtype that can be sent."""
    name = _NAMES.get(dtype)
    if name is None:
        raise WireError(f"dtype {dtype} cannot be sent")
    return name


class WireError(MeshnodeError, ValueError):
    """A tensor from a peer that does not match what was expected."""


def to_tensor(array: mx.array) -> mesh_pb2.Tensor:
    name = _NAMES.get(array.dtype)
    if name is None:
        raise WireError(f"dtype {array.dtype} cannot be sent")
    _, np_dtype = _DTYPES[name]
    if name == "bfloat16":
        array = array.view(mx.uint16)
    data = np.asarray(array, dtype=np_dtype).tobytes()
    return mesh_pb2.Tensor(dtype=name, shape=list(array.shape), data=data)


def host_array(
    tensor: mesh_pb2.Tensor,
    *,
    dtypes: Sequence[str] = tuple(_DTYPES),
    expect: Sequence[int | None] | None = None,
    max_bytes: int = MAX_TENSOR_BYTES,
) -> np.ndarray:
    """Validates a received tensor; a read-only numpy view of its bytes (bfloat16 as uint16)."""
    if tensor.dtype not in _DTYPES or tensor.dtype not in dtypes:
        raise WireError(f"dtype {tensor.dtype!r} not allowed (allowed: {', '.join(dtypes)})")
    _, np_dtype = _DTYPES[tensor.dtype]
    shape = tuple(int(d) for d in tensor.shape)
    if not shape or len(shape) > 4 or any(d <= 0 for d in shape):
        raise WireError(f"bad shape {shape}")
    if expect is not None:
        if len(expect) != len(shape) or any(e is not None and e != d for e, d in zip(expect, shape)):
            raise WireError(f"shape {shape} does not match expected {tuple(expect)}")
    nbytes = np_dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    if nbytes > max_bytes:
        raise WireError(f"tensor of {nbytes} bytes exceeds the limit of {max_bytes}")
    if len(tensor.data) != nbytes:
        raise WireError(f"{len(tensor.data)} bytes for shape {shape} {tensor.dtype} (expected {nbytes})")
    return np.frombuffer(tensor.data, dtype=np_dtype).reshape(shape)


# A raw activation reply, so the per-token hop builds no protobuf: this header, then the bytes.
# 0 (no protobuf message starts with it), dtype code, flags, spare, stage seconds, positions, width.
RAW_REPLY = struct.Struct("<BBBxdII")
TAKES_RAW = 1  # the stage reads raw decode steps (RAW_REQUEST) on this stream
_RAW_CODES = {name: i for i, name in enumerate(_DTYPES, start=1)}
_RAW_NAMES = {i: name for name, i in _RAW_CODES.items()}


def raw_reply_into(buf: bytearray, offset: int, array: mx.array, seconds: float, flags: int = 0) -> int:
    """Writes a raw reply for an evaluated (1, positions, width) array into ``buf`` at ``offset``;
    its length. ``buf`` grows if short and is reused: a large allocation per step is slow."""
    name = dtype_name(array.dtype)
    if array.ndim != 3 or array.shape[0] != 1:
        raise WireError(f"a raw reply carries (1, positions, width), not {tuple(array.shape)}")
    host = np.asarray(array.view(mx.uint16) if name == "bfloat16" else array)
    n = RAW_REPLY.size + host.nbytes
    _fit(buf, offset + n)
    RAW_REPLY.pack_into(buf, offset, 0, _RAW_CODES[name], flags, seconds, host.shape[1], host.shape[2])
    np.copyto(np.frombuffer(buf, dtype=host.dtype, count=host.size, offset=offset + RAW_REPLY.size), host.reshape(-1))
    return n


def _fit(buf: bytearray, size: int) -> None:
    """Grows ``buf`` to ``size`` bytes if shorter."""
    if len(buf) < size:
        buf.extend(bytes(size - len(buf)))


# A raw decode step for stages that set TAKES_RAW: this header, then the input's bytes. 0, dtype code,
# flags (RAW_NEXT_SINGLE), spare, positions to drop first (rewind), positions, width (0: token ids).
RAW_REQUEST = struct.Struct("<BBBxIII")
RAW_NEXT_SINGLE = 1


def raw_request_into(buf: bytearray, offset: int, x: mx.array, next_single: bool, rewind: int) -> int:
    """Writes a raw decode step for evaluated ``x`` ((1, n) ids or (1, n, width)) into ``buf``; its length."""
    name = dtype_name(x.dtype) if x.dtype != mx.uint32 else "int32"
    if name not in _RAW_CODES or x.ndim not in (2, 3) or x.shape[0] != 1:
        raise WireError(f"a raw request carries (1, positions[, width]), not {x.dtype} {tuple(x.shape)}")
    width = x.shape[2] if x.ndim == 3 else 0
    head = offset + RAW_REQUEST.size
    scalar = x.ndim == 2 and x.size == 1  # a token id: one scalar, not an array, after a step
    host = (
        None
        if scalar
        else np.asarray(x.view(mx.uint16) if name == "bfloat16" else x.astype(mx.int32) if width == 0 else x)
    )
    n = RAW_REQUEST.size + (4 if host is None else host.nbytes)
    _fit(buf, offset + n)
    if host is None:
        struct.pack_into("<i", buf, head, x.item())
    else:
        np.copyto(np.frombuffer(buf, dtype=host.dtype, count=host.size, offset=head), host.reshape(-1))
    RAW_REQUEST.pack_into(
        buf, offset, 0, _RAW_CODES[name], RAW_NEXT_SINGLE if next_single else 0, rewind, x.shape[1], width
    )
    return n


class RawRequest:
    """A raw decode step off the wire, header checked; the stage reads it as a ForwardRequest."""

    __slots__ = ("dtype", "next_single", "rewind", "positions", "width", "data")
    work = 0
    keep = ""
    request_id = ""

    def __init__(self, frame: memoryview | bytearray):
        if len(frame) < RAW_REQUEST.size:
            raise WireError(f"raw request of {len(frame)} bytes is shorter than its header")
        _, code, flags, self.rewind, self.positions, self.width = RAW_REQUEST.unpack_from(frame)
        self.next_single = bool(flags & RAW_NEXT_SINGLE)
        dtype = _RAW_NAMES.get(code)
        if dtype is None:
            raise WireError(f"raw request with unknown dtype code {code}")
        self.dtype: str = dtype
        if self.positions <= 0:
            raise WireError(f"raw request of {self.positions} positions")
        self.data = frame[RAW_REQUEST.size :]

    @property
    def input(self) -> RawRequest:  # where a ForwardRequest has its Tensor
        return self

    def host(self, dtypes: Sequence[str], width: int) -> np.ndarray:
        """A numpy view of the input, checked: ``dtypes`` (1, positions, ``width``); ``width`` 0: token ids."""
        if self.dtype not in dtypes or self.width != width:
            raise WireError(
                f"{self.dtype} of width {self.width} where {'/'.join(dtypes)} of width {width} was expected"
            )
        dtype_name = self.dtype
        _, np_dtype = _DTYPES[dtype_name]
        shape = (1, self.positions, width) if width else (1, self.positions)
        if len(self.data) != np_dtype.itemsize * self.positions * max(width, 1):
            raise WireError(f"{len(self.data)} bytes for {shape} {dtype_name}")
        return np.frombuffer(self.data, dtype=np_dtype).reshape(shape)


class RawReply:
    """A raw reply off the wire: its header checked against the frame, its bytes not yet."""

    __slots__ = ("dtype", "flags", "stage_seconds", "positions", "width", "data", "buffer")

    def __init__(self, frame: memoryview, buffer: bytearray | None = None):
        self.buffer = buffer  # what ``frame`` lies in: the receiver may reuse it once the bytes are used
        if len(frame) < RAW_REPLY.size:
            raise WireError(f"raw reply of {len(frame)} bytes is shorter than its header")
        _, code, self.flags, self.stage_seconds, self.positions, self.width = RAW_REPLY.unpack_from(frame)
        dtype = _RAW_NAMES.get(code)
        if dtype is None:
            raise WireError(f"raw reply with unknown dtype code {code}")
        self.dtype: str = dtype
        self.data = frame[RAW_REPLY.size :]

    def host(self, positions: int, width: int) -> np.ndarray:
        """A numpy view of the bytes, checked: an ACTIVATIONS dtype, (1, ``positions``, ``width``)."""
        if self.dtype not in ACTIVATIONS or self.positions != positions or self.width != width:
            raise WireError(
                f"{self.dtype} (1, {self.positions}, {self.width}) where an activation "
                f"(1, {positions}, {width}) was expected"
            )
        dtype_name = self.dtype
        _, np_dtype = _DTYPES[dtype_name]
        if len(self.data) != np_dtype.itemsize * positions * width:
            raise WireError(f"{len(self.data)} bytes for (1, {positions}, {width}) {dtype_name}")
        return np.frombuffer(self.data, dtype=np_dtype).reshape(1, positions, width)


def is_raw(frame: memoryview | bytearray) -> bool:
    return len(frame) > 0 and frame[0] == 0


def to_array(host: np.ndarray, dtype_name: str) -> mx.array:
    array = mx.array(host)
    return array.view(mx.bfloat16) if dtype_name == "bfloat16" else array


def from_tensor(
    tensor: mesh_pb2.Tensor,
    *,
    dtypes: Sequence[str] = tuple(_DTYPES),
    expect: Sequence[int | None] | None = None,
    max_bytes: int = MAX_TENSOR_BYTES,
) -> mx.array:
    """Validates a received tensor and builds an mx.array from it."""
    return to_array(host_array(tensor, dtypes=dtypes, expect=expect, max_bytes=max_bytes), tensor.dtype)


class Placeholder:
    """An input written after the graph using it was built (a stage builds its next step ahead); its
    base array is held so MLX never donates the buffer to another op."""

    def __init__(self, dtype_name: str, shape: tuple[int, ...]):
        _, np_dtype = _DTYPES[dtype_name]
        self.dtype_name, self.shape = dtype_name, tuple(shape)
        self._base = mx.array(np.zeros(shape, dtype=np_dtype))  # owns its buffer
        self._host = np.asarray(self._base)  # a writable view of that buffer
        self.array = self._base.view(mx.bfloat16) if dtype_name == "bfloat16" else self._base

    def fill(self, host: np.ndarray, dtype_name: str | None = None) -> None:
        if dtype_name is not None and dtype_name != self.dtype_name:
            raise WireError(f"{dtype_name} where the step built ahead takes {self.dtype_name}")
        if host.shape != self.shape:
            raise WireError(f"shape {host.shape} does not match the step built ahead {self.shape}")
        self._host[...] = host

    def fill_from(self, array: mx.array) -> None:
        """Fills from an evaluated array of the same dtype."""
        self.fill(np.asarray(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array), dtype_name(array.dtype))


def placeholders_work() -> bool:
    """Whether writing through numpy reaches an evaluated MLX array (checked once per process)."""
    global _PLACEHOLDERS_WORK
    if _PLACEHOLDERS_WORK is None:
        try:
            ph = Placeholder("float32", (1, 2))
            out = ph.array * 2
            ph.fill(np.array([[1.0, 2.0]], dtype=np.float32))
            _PLACEHOLDERS_WORK = out.tolist() == [[2.0, 4.0]]
        except Exception:  # noqa: BLE001 - any failure: build steps when their input is here
            _PLACEHOLDERS_WORK = False
    return _PLACEHOLDERS_WORK


_PLACEHOLDERS_WORK: bool | None = None


def check_tokens(
    tensor: mesh_pb2.Tensor | RawRequest, vocab_size: int, max_chunk: int, expect: Sequence[int | None] = (1, None)
) -> np.ndarray:
    """A message's token ids, checked: int32, at most ``max_chunk`` positions, inside the vocabulary."""
    if isinstance(tensor, RawRequest):
        ids = tensor.host(("int32",), 0)
        if ids.size == 1:  # a decode step: cheaper than numpy's reductions
            token = int(ids[0, 0])
            if not 0 <= token < vocab_size:
                raise WireError(f"token id outside the vocabulary [0, {vocab_size})")
            return ids
    else:
        ids = host_array(tensor, dtypes=("int32",), expect=expect)
    if ids.shape[1] > max_chunk:
        raise WireError(f"{ids.shape[1]} tokens in one message (limit {max_chunk})")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise WireError(f"token id outside the vocabulary [0, {vocab_size})")
    return ids


def check_activation(tensor: mesh_pb2.Tensor | RawRequest, width: int, max_chunk: int) -> np.ndarray:
    """A message's activation, checked: an ACTIVATIONS dtype, (1, positions, ``width``), ≤ ``max_chunk``."""
    if isinstance(tensor, RawRequest):
        host = tensor.host(ACTIVATIONS, width)
    else:
        host = host_array(tensor, dtypes=ACTIVATIONS, expect=(1, None, width))
    if host.shape[1] > max_chunk:
        raise WireError(f"{host.shape[1]} positions in one message (limit {max_chunk})")
    return host
