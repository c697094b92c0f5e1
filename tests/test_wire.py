"""Tensors on the wire: exact round trips, and every malformed tensor refused before use."""

import mlx.core as mx
import pytest
from hypothesis import given, settings, strategies as st

from meshnode.data.wire import WireError, from_tensor, to_tensor
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


@pytest.mark.parametrize("mutate,expect", [
    (lambda t: setattr(t, "dtype", "float64"), None),
    (lambda t: setattr(t, "dtype", "pickle"), None),
    (lambda t: t.ClearField("shape"), None),
    (lambda t: t.shape.append(0), None),
    (lambda t: setattr(t, "data", t.data[:-1]), None),
    (lambda t: setattr(t, "data", t.data + b"x"), None),
    (lambda t: None, (1, 3, 4)),
    (lambda t: None, (1, None)),
])
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
    except Exception:
        return  # not even a protobuf: refused by the gRPC layer
    try:
        arr = from_tensor(t)
    except WireError:
        return
    assert arr.size * arr.itemsize == len(t.data)


def test_generated_code_is_up_to_date():
    assert is_up_to_date() == [], "run: python -m meshnode.proto.generate"
