"""Build real mlx-lm models offline: random weights from a fixed seed plus a locally trained tokenizer.

No model hub is needed: the model classes are mlx-lm's own, the tokenizer is a byte-level BPE
trained with ``tokenizers`` on a small built-in corpus and saved with transformers'
``PreTrainedTokenizerFast``, and the weights are written with mlx-lm's ``save_model``. Builds
are deterministic: the same arguments give byte-identical files on every machine (the demo
model relies on that, since every node of a mesh must hold the same weights).

About 100M parameters in float32: ``build_model(path, "llama", num_layers=12, hidden_size=768,
intermediate_size=2048, num_heads=12, num_kv_heads=4)``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3",
                             "phi3")

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
                  "<|endoftext|>"]  # the last: some tokenizer classes (qwen2) add it if missing

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

_CORPUS = """\
The sea was calm that morning, and the lighthouse keeper climbed the stairs to watch the boats.
Rivers run to the sea; the sea gives rain to the clouds, and the clouds give it back to the hills.
A small machine can hold a small model. Three machines together can hold a larger one, if the
network between them is fast enough to carry the activations from one stage to the next.
Once upon a time there was a fox who lived at the edge of a forest. Every evening she walked to
the river to drink, and every evening the heron told her a story about the mountains.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1024 2048 3.14159 2.71828. Dates: 2026-11-22, 12:30.
Code: def add(a, b): return a + b. for i in range(10): print(i). {"key": "value", "list": [1, 2]}
Questions and answers. What is the capital of France? Paris. How many legs does a spider have?
Eight. Why is the sky blue? Because air scatters blue light more than red light.
Cooking: chop the onions, warm the oil, add garlic, stir for a minute, then add the tomatoes.
Weather: cloudy with a chance of rain in the afternoon, clearing by evening, light winds.
Punctuation and symbols: ! ? , . ; : ' " ( ) [ ] { } < > / \\ | @ # $ % ^ & * - + = ~ `
Unicode: café, naïve, Straße, ¿qué tal?, 東京, 北京, こんにちは, Привет, γειά σου, 🙂 🚀.
"""


def build_tokenizer(out_dir: Path, vocab_size: int = 512) -> int:
    """Train a byte-level BPE tokenizer, save it with a chat template; returns its length."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    # End of an assistant turn counts as end of sequence, as with real chat models.
    gen = {"bos_token_id": fast.bos_token_id, "eos_token_id": [fast.eos_token_id,
                                                                fast.convert_tokens_to_ids("<|end|>")]}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return len(fast)


def _family_config(family: str, *, num_layers: int, hidden_size: int, intermediate_size: int, num_heads: int,
                   num_kv_heads: int, vocab_size: int, tie: bool | None, num_experts: int, experts_per_tok: int,
                   max_position_embeddings: int) -> dict[str, Any]:
    head_dim = hidden_size // num_heads
    base: dict[str, Any] = dict(
        hidden_size=hidden_size, num_hidden_layers=num_layers, intermediate_size=intermediate_size,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, rms_norm_eps=1e-5,
        vocab_size=vocab_size, max_position_embeddings=max_position_embeddings, rope_theta=10000.0,
    )
    if family in ("llama", "mistral"):
        cfg = dict(base, model_type=family, tie_word_embeddings=bool(tie) if tie is not None else False)
    elif family == "qwen2":
        cfg = dict(base, model_type="qwen2", tie_word_embeddings=True if tie is None else tie)
    elif family == "qwen3":
        cfg = dict(base, model_type="qwen3", head_dim=head_dim, tie_word_embeddings=True if tie is None else tie)
    elif family == "qwen3_moe":
        cfg = dict(base, model_type="qwen3_moe", head_dim=head_dim, num_experts=num_experts,
                   num_experts_per_tok=experts_per_tok, decoder_sparse_step=1, mlp_only_layers=[],
                   moe_intermediate_size=intermediate_size // 2, norm_topk_prob=True,
                   tie_word_embeddings=False if tie is None else tie)
    elif family == "mixtral":
        cfg = dict(base, model_type="mixtral", num_local_experts=num_experts, num_experts_per_tok=experts_per_tok,
                   tie_word_embeddings=False if tie is None else tie)
    elif family == "gemma2":
        cfg = dict(base, model_type="gemma2", head_dim=head_dim, query_pre_attn_scalar=head_dim,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=16)
    elif family == "gemma3":
        cfg = dict(base, model_type="gemma3_text", head_dim=head_dim, query_pre_attn_scalar=head_dim,
                   sliding_window=16, sliding_window_pattern=3, rope_local_base_freq=10000.0)
    elif family == "phi3":
        cfg = dict(base, model_type="phi3", tie_word_embeddings=False if tie is None else tie)
    else:
        raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILIES)}")
    return cfg


def build_model(
    out_dir: Path,
    family: str = "llama",
    *,
    num_layers: int = 6,
    hidden_size: int = 64,
    intermediate_size: int | None = None,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 512,
    dtype: str = "float32",
    seed: int = 0,
    tie_word_embeddings: bool | None = None,
    num_experts: int = 4,
    experts_per_tok: int = 2,
    max_position_embeddings: int = 4096,
    max_file_size_mb: int | None = None,
    **overrides: Any,
) -> Path:
    """Write a complete mlx-lm model directory (config, tokenizer, safetensors) and return it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import _get_classes, save_config, save_model

    out_dir = Path(out_dir)
    vocab = build_tokenizer(out_dir, vocab_size)
    config = _family_config(
        family, num_layers=num_layers, hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        vocab_size=vocab, tie=tie_word_embeddings, num_experts=num_experts, experts_per_tok=experts_per_tok,
        max_position_embeddings=max_position_embeddings,
    )
    config.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # SPECIAL_TOKENS order
    config.update(overrides)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    # mlx-lm's default init makes logits nearly flat: widen the embedding and head so greedy output
    # varies. (A tied head echoes the input embedding whatever its scale; tests of tied families
    # therefore compare logits bit for bit, not just tokens.)
    weights = dict(tree_flatten(model.parameters()))
    tied = not any(name.startswith("lm_head") for name in weights)
    for name, w in weights.items():
        if not tied and ("embed_tokens" in name or "lm_head" in name) and w.ndim == 2:
            weights[name] = w * 8.0
    model.load_weights(list(weights.items()))
    target = getattr(mx, dtype)
    model.update(tree_map(lambda p: p.astype(target) if mx.issubdtype(p.dtype, mx.floating) else p,
                          model.parameters()))
    mx.eval(model.parameters())
    config["torch_dtype"] = dtype
    if max_file_size_mb:
        _save_split(out_dir, dict(tree_flatten(model.parameters())), max_file_size_mb << 20)
    else:
        save_model(out_dir, model, donate_model=False)
    save_config(config, config_path=out_dir / "config.json")
    return out_dir


def _save_split(out_dir: Path, weights: dict, max_bytes: int) -> None:
    """Like mlx-lm's save_model, with a shard size below its whole-gigabyte granularity."""
    import mlx.core as mx

    shards: list[dict] = []
    size = 0
    for name, w in weights.items():
        if not shards or size + w.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = w
        size += w.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(out_dir / file), shard, metadata={"format": "mlx"})
        weight_map.update({k: file for k in shard})
    index = {"metadata": {"total_size": sum(w.nbytes for w in weights.values())},
             "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))


def model_dir_for(cache_root: Path, family: str = "llama", **kwargs: Any) -> Path:
    """A cached build: named by a hash of its arguments, built once, published atomically."""
    key = json.dumps({"family": family, **kwargs, "v": 1}, sort_keys=True)
    name = f"{family}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    final = Path(cache_root) / name
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
    try:
        build_model(tmp, family, **kwargs)
        try:
            os.replace(tmp, final)
        except OSError:  # another process published it first
            if not (final / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
