"""Tensors on the wire: exact round trips, and every malformed tensor refused before use."""

import mlx.core as mx
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnode.model.wire import (
    RAW_REPLY,
    RAW_REQUEST,
    Placeholder,
    RawReply,
    RawRequest,
    WireError,
    check_tokens,
    from_tensor,
    is_raw,
    raw_reply_into,
    raw_request_into,
    to_array,
    to_tensor,
)
from meshnode.proto import mesh_pb2
from meshnode.proto.generate import is_up_to_date


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_round_trip_is_exact(dtype):
    a = (mx.random.normal((1, 7, 33)) * 100).astype(dtype)
    b = from_tensor(to_tensor(a), expect=(1, None, 33))
    assert b.dtype == dtype and b.shape == a.shape
    assert mx.array_equal(a, b).item()


def test_tokens_round_trip():
    t = mx.array([[1, 2, 70000]], dtype=mx.int32)
    assert from_tensor(to_tensor(t)).tolist() == [[1, 2, 70000]]


def good():
    return to_tensor(mx.ones((1, 2, 4), dtype=mx.float32))


@pytest.mark.parametrize(
    "mutate,expect",
    [
        (lambda t: setattr(t, "dtype", "float64"), None),
        (lambda t: setattr(t, "dtype", "pickle"), None),
        (lambda t: t.ClearField("shape"), None),
        (lambda t: t.shape.append(0), None),
        (lambda t: setattr(t, "data", t.data[:-1]), None),
        (lambda t: setattr(t, "data", t.data + b"x"), None),
        (lambda t: None, (1, 3, 4)),
        (lambda t: None, (1, None)),
    ],
)
def test_malformed_refused(mutate, expect):
    t = good()
    mutate(t)
    with pytest.raises(WireError):
        from_tensor(t, dtypes=("float32",), expect=expect or (1, None, 4))


def test_dtype_allowlist_and_size_limit():
    with pytest.raises(WireError):
        from_tensor(good(), dtypes=("bfloat16",))
    with pytest.raises(WireError):
        from_tensor(good(), max_bytes=16)
    huge = mesh_pb2.Tensor(dtype="float32", shape=[1, 2**20, 2**20], data=b"")
    with pytest.raises(WireError):
        from_tensor(huge)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_crash(raw):
    try:
        t = mesh_pb2.Tensor.FromString(raw)
    except DecodeError:
        return  # not even a protobuf: refused by the gRPC layer
    try:
        arr = from_tensor(t)
    except WireError:
        return
    assert arr.size * arr.itemsize == len(t.data)


def test_generated_code_is_up_to_date():
    assert is_up_to_date() == [], "run: python -m meshnode.proto.generate"


# --------------------------------------------------------------------------- raw replies (data port)


def _raw(array: mx.array, seconds: float = 0.25, offset: int = 0, buf: bytearray | None = None) -> memoryview:
    buf = bytearray() if buf is None else buf
    n = raw_reply_into(buf, offset, array, seconds)
    return memoryview(buf)[offset : offset + n]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_raw_reply_round_trip_is_exact(dtype):
    a = (mx.random.normal((1, 5, 33)) * 100).astype(dtype)
    frame = _raw(a, offset=4)
    assert is_raw(frame)
    reply = RawReply(frame)
    assert reply.stage_seconds == 0.25 and (reply.positions, reply.width) == (5, 33)
    name = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}[dtype]
    assert reply.dtype == name
    b = to_array(reply.host(5, 33), name)
    assert b.dtype == dtype and mx.array_equal(a, b).item()


def test_raw_reply_reuses_its_buffer_and_fills_a_placeholder():
    buf = bytearray()
    _raw(mx.ones((1, 3, 8)), buf=buf)
    size = len(buf)
    frame = _raw(mx.full((1, 1, 8), 2.0), buf=buf)
    assert len(buf) == size  # a smaller reply is written into the same buffer
    ph = Placeholder("float32", (1, 1, 8))
    out = ph.array * 3
    ph.fill(RawReply(frame).host(1, 8), "float32")
    assert out.tolist() == [[[6.0] * 8]]


def test_a_protobuf_reply_is_never_taken_for_a_raw_one():
    for msg in (
        mesh_pb2.ForwardReply(output=good(), stage_seconds=0.1),
        mesh_pb2.ForwardReply(code=5, error="x"),
        mesh_pb2.ForwardReply(stage_seconds=1.0),
    ):
        assert not is_raw(memoryview(msg.SerializeToString()))


@pytest.mark.parametrize(
    "mutate,expect",
    [
        (lambda b: b[: RAW_REPLY.size - 1], (2, 4)),  # shorter than its header
        (lambda b: b[:1] + b"\x09" + b[2:], (2, 4)),  # unknown dtype code
        (lambda b: b[:-1], (2, 4)),  # a byte short
        (lambda b: b + b"x", (2, 4)),  # a byte over
        (lambda b: b[:1] + b"\x04" + b[2:], (2, 4)),  # int32: not an activation
        (lambda b: b, (1, 4)),  # not the positions expected
        (lambda b: b, (2, 8)),  # not the width expected
    ],
)
def test_malformed_raw_reply_refused(mutate, expect):
    frame = memoryview(bytearray(mutate(bytes(_raw(mx.ones((1, 2, 4)))))))
    with pytest.raises(WireError):
        RawReply(frame).host(*expect)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(1, 4), st.integers(1, 8))
def test_random_raw_replies_never_crash(raw, positions, width):
    frame = memoryview(b"\x00" + raw)
    try:
        host = RawReply(frame).host(positions, width)
    except WireError:
        return
    assert host.shape == (1, positions, width)


# --------------------------------------------------------------------------- raw decode steps (data port)


def _request(x: mx.array, next_single: bool = True, rewind: int = 0, offset: int = 4) -> memoryview:
    buf = bytearray()
    n = raw_request_into(buf, offset, x, next_single, rewind)
    return memoryview(buf)[offset : offset + n]


@pytest.mark.parametrize(
    "x,dtype,width",
    [
        (mx.array([[7]], dtype=mx.uint32), "int32", 0),  # the sampled token, as generate_step gives it
        (mx.array([[3, 4, 5]], dtype=mx.int32), "int32", 0),
        (mx.random.normal((1, 1, 16)), "float32", 16),
        ((mx.random.normal((1, 2, 8)) * 50).astype(mx.bfloat16), "bfloat16", 8),
    ],
)
def test_raw_request_round_trip_is_exact(x, dtype, width):
    frame = _request(x, next_single=True, rewind=3)
    assert is_raw(frame)
    req = RawRequest(frame)
    assert (req.next_single, req.rewind, req.positions, req.width, req.work, req.keep) == (
        True,
        3,
        x.shape[1],
        width,
        0,
        "",
    )
    host = req.input.host((dtype,), width)
    want = x.astype(mx.int32) if width == 0 else x
    assert mx.array_equal(to_array(host, dtype), want).item()
    assert not RawRequest(_request(x, next_single=False)).next_single


def test_raw_decode_steps_are_checked_as_messages_are():
    ok = RawRequest(_request(mx.array([[511]], dtype=mx.uint32)))
    assert check_tokens(ok, 512, 8).tolist() == [[511]]
    for bad in ([[512]], [[-1]]):
        with pytest.raises(WireError, match="vocabulary"):
            check_tokens(RawRequest(_request(mx.array(bad, dtype=mx.int32))), 512, 8)
    with pytest.raises(WireError, match="limit"):
        check_tokens(RawRequest(_request(mx.zeros((1, 9), dtype=mx.int32))), 512, 8)
    with pytest.raises(WireError, match="expected"):  # an activation where token ids belong
        check_tokens(RawRequest(_request(mx.zeros((1, 1, 4)))), 512, 8)


@pytest.mark.parametrize(
    "mutate,expect",
    [
        (lambda b: b[: RAW_REQUEST.size - 1], (("float32",), 4)),  # shorter than its header
        (lambda b: b[:1] + b"\x09" + b[2:], (("float32",), 4)),  # unknown dtype code
        (lambda b: b[:-1], (("float32",), 4)),  # a byte short
        (lambda b: b + b"x", (("float32",), 4)),  # a byte over
        (lambda b: b, (("float16", "bfloat16"), 4)),  # not a dtype expected
        (lambda b: b, (("float32",), 8)),  # not the width expected
        (lambda b: b[:12] + b"\x00\x00\x00\x00" + b[16:], (("float32",), 4)),  # no positions
    ],
)
def test_malformed_raw_request_refused(mutate, expect):
    frame = memoryview(bytearray(mutate(bytes(_request(mx.ones((1, 2, 4)))))))
    with pytest.raises(WireError):
        RawRequest(frame).host(*expect)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.sampled_from(["float32", "float16", "bfloat16", "int32"]), st.integers(0, 8))
def test_random_raw_requests_never_crash(raw, dtype, width):
    try:
        host = RawRequest(memoryview(b"\x00" + raw)).host((dtype,), width)
    except WireError:
        return
    assert host.shape[0] == 1 and (host.ndim == 2 if width == 0 else host.shape[2] == width)
