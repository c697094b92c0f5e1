"""Offline model building: every family loads and generates in mlx-lm; builds are deterministic."""

import hashlib
import json

import mlx.core as mx
import pytest
from mlx_lm import generate, load, stream_generate
from mlx_lm.generate import generate_step

from meshnode.demo import DEMO_ARGS, DEMO_MODEL_ID, default_models_dir, ensure_demo_model
from meshnode.model.build import FAMILIES, _uniform, build_model, build_tokenizer, model_dir_for

TEXTS = [
    "Hello, world!",
    "café naïve Straße",
    "東京 こんにちは Привет γειά",
    "emoji 🙂🚀👩‍👩‍👧 and \t tabs\n",
    "rare: ǅ ﬁ ℵ 𝔘𝔫𝔦 \u200b \x00 \x7f",
    "  leading and trailing spaces  ",
    "",
]


def digest(path):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir()) if f.is_file()}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: build_model(root / f, f) for f in FAMILIES}


def test_tokenizer_is_byte_level_with_chat_template(tmp_path):
    n = build_tokenizer(tmp_path, vocab_size=400)
    assert n == 400
    _, tok = load(str(build_model(tmp_path / "m", "llama")))
    for text in TEXTS:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|bos|><|system|>Be brief.<|end|><|user|>hi<|end|><|assistant|>"
    assert not tok.apply_chat_template(messages, tokenize=False).endswith("<|assistant|>")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    assert tok.convert_tokens_to_ids("<|end|>") in tok.eos_token_ids  # a finished turn stops generation


@pytest.mark.parametrize("family", FAMILIES)
def test_family_loads_and_generates_varied_text(models, family):
    model, tok = load(str(models[family]))
    assert model.args.vocab_size == len(tok._tokenizer)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Tell me a story about the sea."}], add_generation_prompt=True
    )
    text = generate(model, tok, prompt, max_tokens=20)  # greedy by default; stops at <|end|>
    responses = list(stream_generate(model, tok, prompt, max_tokens=20))
    assert text.strip() and text == "".join(r.text for r in responses)
    tokens = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=20)]  # ignores eos
    assert [r.token for r in responses] == tokens[: len(responses)]
    assert len(set(tokens)) >= 8, tokens  # not one token forever


def test_family_specifics(models):
    config = {f: json.loads((models[f] / "config.json").read_text()) for f in FAMILIES}
    assert config["gemma3"]["model_type"] == "gemma3_text"
    assert config["gemma3"]["sliding_window"] < config["gemma3"]["sliding_window_pattern"] * 8
    assert config["qwen3_moe"]["num_experts"] == 4 and config["mixtral"]["num_local_experts"] == 4
    tied = {
        f
        for f in FAMILIES
        if "lm_head.weight" not in json.loads((models[f] / "model.safetensors.index.json").read_text())["weight_map"]
    }
    assert tied == {"qwen2", "qwen3", "gemma2"}


@pytest.mark.parametrize("family,tie", [("gemma3", True), ("qwen2", False), ("llama", True)])
def test_tie_word_embeddings_either_way(tmp_path, family, tie):
    path = build_model(tmp_path, family, tie_word_embeddings=tie, num_layers=2)
    weights = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert ("lm_head.weight" not in weights) == tie
    model, tok = load(str(path))
    assert model(mx.array([[1, 2, 3]])).shape == (1, 3, len(tok._tokenizer))


def test_dtype_and_split_with_index(tmp_path):
    path = build_model(tmp_path, "llama", hidden_size=128, dtype="bfloat16", max_file_size_mb=1)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in path.glob("model-*.safetensors"))
    assert len(files) > 1 and files[0].endswith(f"-of-{len(files):05d}.safetensors")
    assert set(index["weight_map"].values()) == set(files) and not (path / "model.safetensors").exists()
    assert all(p.stat().st_size < (1 << 20) + 4096 for p in path.glob("model-*.safetensors"))
    model, _ = load(str(path))
    assert model.model.embed_tokens.weight.dtype == mx.bfloat16
    assert index["metadata"]["total_size"] == sum(p.stat().st_size for p in path.glob("model-*.safetensors")) - sum(
        8 + int.from_bytes(p.read_bytes()[:8], "little") for p in path.glob("model-*.safetensors")
    )


def test_builds_are_deterministic(tmp_path):
    a = build_model(tmp_path / "a", "qwen3_moe", max_file_size_mb=1)
    b = build_model(tmp_path / "b", "qwen3_moe", max_file_size_mb=1)
    assert digest(a) == digest(b)
    assert digest(build_model(tmp_path / "c", "qwen3_moe", seed=1, max_file_size_mb=1)) != digest(a)


# sha256 of _uniform((64, 64), seed=0, name="x", bound=0.125); a numpy reimplementation gives the same.
GOLDEN_UNIFORM = "f5e6e7dad149bf74b075da4bbf9f07982adcde21cd993042e01ee93b31796c59"


def test_weight_values_are_platform_independent():
    # Integer hashing and exact float steps: these bytes are the same on every machine (macOS and
    # Metal included). If this fails, nodes on different platforms would build different demo models.
    values = _uniform((64, 64), seed=0, name="x", bound=0.125)
    assert values.dtype == mx.float32 and -0.125 <= values.min().item() and values.max().item() < 0.125
    assert abs(values.mean().item()) < 0.005
    assert hashlib.sha256(bytes(memoryview(values))).hexdigest() == GOLDEN_UNIFORM


def test_demo_model_is_cached_and_identical_everywhere(tmp_path):
    a = ensure_demo_model(tmp_path / "x")
    assert a == tmp_path / "x" / f"{DEMO_MODEL_ID}-v1"
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model(tmp_path / "x") == a and (a / "model.safetensors").stat().st_mtime_ns == mtime
    assert digest(a) == digest(ensure_demo_model(tmp_path / "y"))
    assert [p.name for p in (tmp_path / "x").iterdir()] == [a.name]  # no half-built leftovers
    model, tok = load(str(a))
    assert model.args.num_hidden_layers == DEMO_ARGS["num_layers"]


def test_model_dir_for_caches_by_arguments(tmp_path):
    a = model_dir_for(tmp_path, "llama", num_layers=2)
    assert model_dir_for(tmp_path, "llama", num_layers=2) == a
    assert model_dir_for(tmp_path, "llama", num_layers=3) != a
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_default_models_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHNODE_CACHE_DIR", str(tmp_path / "c"))
    assert default_models_dir() == tmp_path / "c" / "models"
    monkeypatch.delenv("MESHNODE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr("meshnode.config._is_macos", lambda: False)
    assert default_models_dir() == tmp_path / "xdg" / "meshnode" / "models"


def test_bad_arguments_fail_before_writing(tmp_path):
    with pytest.raises(ValueError, match="unknown family"):
        build_model(tmp_path / "m", "gpt5")
    with pytest.raises(ValueError, match="dtype"):
        build_model(tmp_path / "m", "llama", dtype="int8")
    assert not (tmp_path / "m").exists()
    with pytest.raises(ValueError, match="quantize"):
        build_model(tmp_path / "m", "llama", quantize="3bit")


def test_generic_families_are_deterministic_and_tiny(tmp_path):
    # deepseek_v3: MLA, shared experts, grouped routing; its routing bias has no weight to take a fan-in from.
    a = build_model(tmp_path / "a", "deepseek_v3", num_layers=3)
    assert digest(a) == digest(build_model(tmp_path / "b", "deepseek_v3", num_layers=3))
    config = json.loads((a / "config.json").read_text())
    assert config["hidden_size"] == 64 and config["num_hidden_layers"] == 3 and config["kv_lora_rank"] == 16
    assert config["n_routed_experts"] == 4 and config["n_group"] == 2 and config["first_k_dense_replace"] == 1
    model, tok = load(str(a))
    assert model.args.vocab_size == len(tok._tokenizer)
    nested = json.loads((build_model(tmp_path / "l4", "llama4", num_layers=2) / "config.json").read_text())
    assert nested["text_config"]["hidden_size"] == 64 and nested["text_config"]["num_hidden_layers"] == 2


def test_quantized_builds_load_in_mlx_lm(tmp_path):
    path = build_model(tmp_path / "q", "qwen3_moe", num_layers=2, quantize="4bit", dtype="bfloat16")
    config = json.loads((path / "config.json").read_text())
    q = config["quantization"]
    assert {k: q[k] for k in ("group_size", "bits", "mode")} == {"group_size": 32, "bits": 4, "mode": "affine"}
    assert q["model.layers.0.mlp.gate"]["bits"] == 8  # the family's own quant_predicate: routers in 8 bits
    model, _ = load(str(path))
    assert type(model.model.layers[0].mlp.switch_mlp.gate_proj).__name__ == "QuantizedSwitchLinear"
    assert model.model.embed_tokens.scales.dtype == mx.bfloat16
    assert digest(path) == digest(
        build_model(tmp_path / "r", "qwen3_moe", num_layers=2, quantize="4bit", dtype="bfloat16")
    )
