"""Offline model building: every family loads in mlx-lm; builds are deterministic."""

import hashlib

import pytest
from mlx_lm import load

from meshnode.demo import DEMO_ARGS, ensure_demo_model
from meshnode.modelbuild import FAMILIES, build_model, build_tokenizer, model_dir_for


def digest(path):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir()) if f.is_file()}


def test_tokenizer_round_trips_any_text(tmp_path):
    assert build_tokenizer(tmp_path) <= 512
    _, tok = load(str(build_model(tmp_path / "m", "llama")))
    for text in ["Hello, world!", "café naïve Straße", "東京 こんにちは Привет", "emoji 🙂🚀 and \t tabs\n"]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("family", FAMILIES)
def test_family_loads_with_chat_template(tmp_path, family):
    model, tok = load(str(build_model(tmp_path / family, family)))
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert prompt[0] == tok.bos_token_id and len(prompt) > 3
    assert model.args.vocab_size == len(tok._tokenizer)


def test_builds_are_deterministic_and_split(tmp_path):
    a = build_model(tmp_path / "a", "qwen3_moe", max_file_size_mb=1)
    b = build_model(tmp_path / "b", "qwen3_moe", max_file_size_mb=1)
    assert digest(a) == digest(b)
    assert (a / "model.safetensors.index.json").exists() and len(list(a.glob("model-*.safetensors"))) > 1


def test_demo_model_is_cached_and_identical_everywhere(tmp_path):
    a = ensure_demo_model(tmp_path / "x")
    assert ensure_demo_model(tmp_path / "x") == a
    assert digest(a) == digest(ensure_demo_model(tmp_path / "y"))
    assert model_dir_for(tmp_path / "x", "llama", **DEMO_ARGS) == a
    assert not [p for p in (tmp_path / "x").iterdir() if p.name.startswith(".")]  # no half-built leftovers
