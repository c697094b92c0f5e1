"""MTP heads (meshnode.model.mtp): random-weight heads saved in each layout (Qwen3.5 ``mtp.*``,
DeepSeek-V3 extra layers, GGUF ``blk.N.nextn.*`` in the model's file or a sibling), loaded back and
computing the same logits; drafting and cutting back the head's cache agree with a fresh run."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import llama

from meshnode.model.mtp import MTPHead, hidden_states, shared_from
from meshnode.model.mtp_load import NoMTPHead, load_mtp, mtp_sibling, save_qwen
from meshnode.weights.mtp_layout import mtp_footprint
from tests.ggufwrite import _metadata, add_nextn

CFG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 256,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


def _backbone() -> llama.Model:
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(CFG))
    mx.eval(model.parameters())
    return model


def _head(model: llama.Model, **own: bool) -> MTPHead:
    """A head with random weights everywhere, norms included (ones would hide a swapped norm)."""
    head = MTPHead(model.args, shared_from(model), **own)
    head.update(tree_map(lambda a: mx.random.normal(a.shape) * 0.2 + (1.0 if a.ndim == 1 else 0.0), head.parameters()))
    mx.eval(head.parameters())
    return head


def _inputs() -> tuple[mx.array, mx.array]:
    mx.random.seed(1)
    return mx.random.normal((1, 5, CFG["hidden_size"])), mx.random.randint(0, CFG["vocab_size"], (1, 5))


def _same_logits(a: MTPHead, b: MTPHead, atol: float = 1e-5) -> None:
    hidden, tokens = _inputs()
    np.testing.assert_allclose(np.array(a(hidden, tokens)[1]), np.array(b(hidden, tokens)[1]), atol=atol)


def test_hidden_states_are_the_backbones_before_its_final_norm():
    model = _backbone()
    tokens = mx.array([[1, 2, 3, 4]])
    h, logits = hidden_states(model, tokens)
    np.testing.assert_allclose(np.array(logits), np.array(model(tokens)), atol=1e-5)
    np.testing.assert_allclose(np.array(model.model.norm(h)), np.array(model.model(tokens)), atol=1e-5)


def test_qwen_layout_file_and_folder(tmp_path: Path):
    model = _backbone()
    head = _head(model)
    save_qwen(head, tmp_path / "mtp.safetensors")
    _same_logits(load_mtp(tmp_path / "mtp.safetensors", model), head)
    # in the model's own folder, beside the backbone's tensors, as Qwen3.5 ships it
    folder = tmp_path / "model"
    folder.mkdir()
    both = dict(tree_flatten(model.parameters())) | mx.load(str(tmp_path / "mtp.safetensors"))
    mx.save_safetensors(str(folder / "model.safetensors"), both)
    (folder / "config.json").write_text(json.dumps(CFG))
    _same_logits(load_mtp(folder, model), head)


def test_qwen_checkpoints_zero_centered_norms_are_shifted_back(tmp_path: Path):
    model = _backbone()
    head = _head(model)
    save_qwen(head, tmp_path / "plain.safetensors")
    plain = mx.load(str(tmp_path / "plain.safetensors"))
    stored = {k: v - 1.0 if "norm" in k else v for k, v in plain.items()}
    mx.save_safetensors(str(tmp_path / "model.safetensors"), stored)
    (tmp_path / "plain.safetensors").unlink()
    (tmp_path / "config.json").write_text(json.dumps(CFG | {"model_type": "qwen3_next"}))
    _same_logits(load_mtp(tmp_path, model), head)


@pytest.mark.parametrize("base,nested", [("model.layers", False), ("model.language_model.layers", True)])
def test_deepseek_layout_with_its_own_embedding_and_head(tmp_path: Path, base: str, nested: bool):
    model = _backbone()
    head = _head(model, own_embed=True, own_head=True)
    n = CFG["num_hidden_layers"]
    ours = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "norm": "shared_head.norm"}
    ours |= {"head": "shared_head.head", "embed": "embed_tokens"}
    weights = dict(tree_flatten(model.parameters()))
    for name, a in tree_flatten(head.parameters()):
        module, _, rest = name.partition(".")
        weights[f"{base}.{n}." + (rest if module == "block" else f"{ours[module]}.{rest}")] = a
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    config = CFG | {"num_nextn_predict_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": config} if nested else config))
    loaded = load_mtp(tmp_path, None, args=model.args)
    assert "embed" in loaded and "head" in loaded and loaded.shared is None
    _same_logits(loaded, head)
    with pytest.raises(NoMTPHead):
        load_mtp(tmp_path, model, layer=1)


def _write_gguf(head: MTPHead, out: Path, *, blocks: int, qtype=gguf.GGMLQuantizationType.F32, nextn: bool = True):
    """``head`` as llama.cpp writes an MTP layer: block ``blocks - 1``'s tensors and its ``nextn.*``."""
    w = gguf.GGUFWriter(str(out), "llama")
    _metadata(w, CFG | {"num_hidden_layers": blocks}, "llama")
    w.add_nextn_predict_layers(1)
    if nextn:
        add_nextn(w, head, blocks - 1, CFG, qtype)
    else:
        w.add_tensor("token_embd.weight", np.zeros((CFG["vocab_size"], CFG["hidden_size"]), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_nextn_in_the_models_file_and_in_a_sibling(tmp_path: Path):
    model = _backbone()
    head = _head(model)
    blocks = CFG["num_hidden_layers"] + 1  # llama.cpp counts the MTP layer as a block
    _write_gguf(head, tmp_path / "tiny.gguf", blocks=blocks)
    _same_logits(load_mtp(tmp_path / "tiny.gguf", model), head)
    beside = tmp_path / "beside"
    beside.mkdir()
    _write_gguf(head, beside / "tiny-Q8_0.gguf", blocks=CFG["num_hidden_layers"], nextn=False)
    _write_gguf(head, beside / "tiny-mtp.gguf", blocks=blocks)
    assert mtp_sibling(beside / "tiny-Q8_0.gguf") == beside / "tiny-mtp.gguf"
    _same_logits(load_mtp(beside / "tiny-Q8_0.gguf", model), head)
    (beside / "tiny-mtp.gguf").unlink()
    with pytest.raises(NoMTPHead):
        load_mtp(beside / "tiny-Q8_0.gguf", model)


def test_gguf_quantized_head_keeps_its_bits(tmp_path: Path, caplog):
    model = _backbone()
    head = _head(model)
    _write_gguf(head, tmp_path / "q8.gguf", blocks=3, qtype=gguf.GGMLQuantizationType.Q8_0)
    with caplog.at_level(logging.WARNING):
        loaded = load_mtp(tmp_path / "q8.gguf", model)
    assert loaded.quantized_bits() == 8 and "drafts badly" not in caplog.text
    _same_logits(loaded, head, atol=0.1)
    _write_gguf(head, tmp_path / "q4.gguf", blocks=3, qtype=gguf.GGMLQuantizationType.Q4_0)
    with caplog.at_level(logging.WARNING):
        assert load_mtp(tmp_path / "q4.gguf", model).quantized_bits() == 4
    assert "a 4-bit head drafts badly" in caplog.text


@pytest.mark.parametrize("bits", [4, 3])
def test_4bit_or_lower_safetensors_head_loads_as_stored_and_warns_once(tmp_path: Path, caplog, bits: int):
    model = _backbone()
    head = _head(model)
    nn.quantize(head, group_size=32, bits=bits)
    save_qwen(head, tmp_path / "mtp.safetensors")
    with caplog.at_level(logging.WARNING):
        loaded = load_mtp(tmp_path / "mtp.safetensors", model)
    warned = [r for r in caplog.records if "a 4-bit head drafts badly" in r.getMessage()]
    assert loaded.quantized_bits() == bits and len(warned) == 1 and f"to {bits} bits" in warned[0].getMessage()
    _same_logits(loaded, head, atol=0)


def _primed(model: llama.Model, head: MTPHead, prompt: list[int]) -> tuple[mx.array, int]:
    """The head fed the prompt's true positions but the last; (last hidden state, newest token)."""
    h, logits = hidden_states(model, mx.array([prompt]))
    nxt = int(mx.argmax(logits[0, -1]))
    head.reset()
    head.extend(h[:, :-1], mx.array(prompt[1:]))
    return h[:, -1:], nxt


def test_cached_steps_match_one_pass_without_cache():
    model = _backbone()
    head = _head(model)
    hidden, tokens = _inputs()
    whole = head(hidden, tokens)[1]
    head.reset()
    steps = [head.extend(hidden[:, i : i + 1], tokens[0, i : i + 1])[1] for i in range(tokens.shape[1])]
    np.testing.assert_allclose(np.array(mx.stack(steps, axis=1)), np.array(whole), atol=1e-5)


@pytest.mark.parametrize("k,r", [(4, 1), (4, 3), (3, 2)])
def test_drafting_k_then_trimming_r_equals_drafting_k_minus_r(k: int, r: int):
    model = _backbone()
    head = _head(model)
    prompt = [5, 17, 3, 99, 42, 7]
    h, nxt = _primed(model, head, prompt)
    start = head.offset
    long = head.draft(h, nxt, k)
    assert head.offset == start + k and head.chained == k - 1
    assert head.trim(r) == r
    keys_long = [np.array(a[..., : head.offset, :]) for a in head.cache.state[:2]]

    h, nxt = _primed(model, head, prompt)
    short = head.draft(h, nxt, k - r)
    assert short.tokens == long.tokens[: k - r]
    np.testing.assert_allclose(short.probs, long.probs[: k - r], rtol=1e-5)
    assert head.offset == start + k - r
    for a, b in zip(keys_long, head.cache.state[:2]):
        np.testing.assert_allclose(a, np.array(b[..., : head.offset, :]), atol=1e-6)
    assert all(0 < p <= 1 for p in long.probs)


def test_settle_keeps_the_true_positions_and_the_next_draft_matches_a_fresh_run():
    model = _backbone()
    head = _head(model)
    prompt = [5, 17, 3, 99, 42, 7]
    h, nxt = _primed(model, head, prompt)
    head.draft(h, nxt, 4)
    assert head.settle() == 3 and head.offset == len(prompt)
    # the backbone verified two more positions: they come in with the next draft
    longer = [*prompt, nxt, 11]
    hs, logits = hidden_states(model, mx.array([longer]))
    after = int(mx.argmax(logits[0, -1]))
    again = head.draft(hs[:, len(prompt) :], [*longer[len(prompt) + 1 :], after], 3)
    fresh = _head(model)
    fresh.update(head.parameters())
    fresh.extend(hs[:, :-1], mx.array(longer[1:]))
    assert fresh.draft(hs[:, -1:], after, 3).tokens == again.tokens


def test_sampled_drafts_and_logits_processors():
    model = _backbone()
    head = _head(model)
    h, nxt = _primed(model, head, [1, 2, 3])
    banned = head.draft(h, nxt, 1).tokens[0]
    head.settle()
    head.trim(1)

    def ban(_tokens: mx.array, logits: mx.array) -> mx.array:
        return logits.at[:, banned].add(-1e9)

    d = head.draft(h, nxt, 3, logits_processors=[ban], keep_dists=True)
    assert banned not in d.tokens and len(d.dists) == 3
    assert abs(float(d.dists[0].sum()) - 1) < 1e-4
    head.settle()
    head.trim(1)
    mx.random.seed(3)
    s = head.draft(h, nxt, 3, temperature=1.0)
    assert len(s.tokens) == 3 and all(0 < p <= 1 for p in s.probs)


def test_footprint_counts_what_the_head_cannot_share():
    model = _backbone()
    head = _head(model)
    embed = CFG["vocab_size"] * CFG["hidden_size"] * 4
    own = head.own_bytes()
    assert mtp_footprint(own, embedding_bytes=embed, shares_embedding=True, shares_lm_head=True).total == sum(
        own.values()
    )
    apart = mtp_footprint(own, embedding_bytes=embed, lm_head_bytes=embed, shares_embedding=False, shares_lm_head=False)
    assert apart.total == sum(own.values()) + 2 * embed
    carried = _head(model, own_embed=True).own_bytes()
    assert (
        mtp_footprint(carried, embedding_bytes=embed, shares_embedding=False, shares_lm_head=True).embedding_bytes == 0
    )
