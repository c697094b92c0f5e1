"""A model whose tensors mix dtypes (a GGUF's float16 weights and float32 norms) splits as it runs
whole: activations cross stages in the dtype the layers produce, and a refusal between stages
ends the generation at once (a fault), not as a lost stage."""

from __future__ import annotations

import grpc
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model

from meshnode.model.build import build_model
from meshnode.model.shard import Shard
from meshnode.model.wire import RawReply, WireError, check_activation, raw_reply_into, to_array, to_tensor
from meshnode.transport.refusals import StageFault, refusal_kind
from meshnode.weights.profile import activation_dtype, profile_model

PROMPT = [[3, 17, 42, 99, 7, 250, 31, 64]]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A float16 llama whose norms are float32, as GGUF files store them."""
    path = build_model(tmp_path_factory.mktemp("mixed") / "llama", "llama", num_layers=4, dtype="float16")
    weights = mx.load(str(path / "model.safetensors"))
    weights = {k: v.astype(mx.float32) if k.endswith("norm.weight") else v for k, v in weights.items()}
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path


def test_the_profile_says_the_dtype_the_layers_produce(mixed):
    assert activation_dtype(mixed) == "float32"
    assert profile_model(mixed).dtype == "float32"
    model, _ = load_model(mixed)
    assert model.model.layers[0](model.model.embed_tokens(mx.array(PROMPT)), None, None).dtype == mx.float32


def test_a_mixed_dtype_model_splits_bit_identically_over_the_wire(mixed):
    full, _ = load_model(mixed)
    want = full(mx.array(PROMPT))
    first, last = Shard(mixed, 0, 2), Shard(mixed, 2, 4)
    hidden = first.forward(mx.array(PROMPT, dtype=mx.int32), first.make_cache())
    mx.eval(hidden)
    sent = to_tensor(hidden)  # the gRPC path
    got = last.forward(to_array(check_activation(sent, last.hidden_size, 64), sent.dtype), last.make_cache())
    assert mx.array_equal(got, want).item()
    buf = bytearray()  # the data port's raw reply
    n = raw_reply_into(buf, 0, hidden, 0.0)
    reply = RawReply(memoryview(buf)[:n])
    assert reply.dtype == "float32"
    got = last.forward(to_array(reply.host(len(PROMPT[0]), last.hidden_size), reply.dtype), last.make_cache())
    assert mx.array_equal(got, want).item()


def test_a_step_built_ahead_takes_the_dtype_the_stage_before_sent(mixed):
    last = Shard(mixed, 2, 4)
    cache = last.make_cache()
    mx.eval(last.forward(mx.zeros((1, 3, last.hidden_size), dtype=mx.float32), cache))
    placeholder, _ = last.build_ahead(cache)
    assert placeholder.dtype_name == "float32"
    with pytest.raises(WireError, match="float16 where the step built ahead takes float32"):
        placeholder.fill(np.zeros((1, 1, last.hidden_size), dtype=np.float16), "float16")


def test_an_input_a_stage_refuses_is_a_fault_not_a_lost_stage():
    assert issubclass(refusal_kind(grpc.StatusCode.INVALID_ARGUMENT, "float64 not allowed"), StageFault)
    with pytest.raises(WireError):
        check_activation(to_tensor(mx.zeros((1, 2, 8), dtype=mx.int32)), 8, 64)
