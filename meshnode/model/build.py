"""Build real mlx-lm models offline: random weights from a fixed seed plus a locally trained
byte-level BPE tokenizer, in the family's own mlx-lm class. Builds are byte-identical for the same
arguments on every platform (weights come from an integer hash): demo nodes rely on it."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshnode.model.tinyconfig import NOT_BUILDABLE, family_config, generic_config, is_mlx_family

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn

FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3", "phi3")

# Every family build_model builds that splits as a pipeline token-identical to mlx-lm in float32
# (tests/test_families.py); hunyuan only between groups of cla_share_factor layers.
SPLIT_FAMILIES: tuple[str, ...] = FAMILIES + (
    # asked for by name
    "deepseek_v3",
    "glm4_moe",
    "gpt_oss",
    "qwen3_next",
    "minimax",
    "llama4",
    "gemma4_text",
    "hunyuan",
    "olmo2",
    "granite",
    "cohere2",
    "glm4",
    "exaone4",
    "ernie4_5_moe",
    "smollm3",
    "qwen3_5",
    # the rest of mlx-lm's models/ that the generic path builds
    "Klear",
    "cohere",
    "deepseek",
    "deepseek_v32",
    "dots1",
    "ernie4_5",
    "falcon_h1",
    "gemma",
    "glm",
    "glm4_moe_lite",
    "granitemoe",
    "helium",
    "hunyuan_v1_dense",
    "internlm3",
    "kimi_k25",
    "kimi_vl",
    "laguna",
    "mimo",
    "minicpm",
    "nanbeige",
    "nemotron",
    "olmo3",
    "olmo_hybrid",
    "olmoe",
    "phimoe",
    "qwen2_moe",
    "seed_oss",
    "solar_open",
    "stablelm",
    "starcoder2",
    "telechat3",
    "youtu_llm",
)

# Bump when the same arguments would build different files (model_dir_for's cache key).
BUILD_VERSION = 2

SPECIAL_TOKENS = [
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "<|endoftext|>",
]  # the last: some tokenizer classes (qwen2) add it if missing

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# chat="agent": a Qwen3/GLM-shaped template: tools in a system turn, calls as
# <tool_call>{json}</tool_call> (mlx-lm's json_tools parser), <think> unless thinking is off.
AGENT_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
AGENT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|system|>You may call these functions:"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|end|>{%- endif %}'
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|assistant|>{{ message.content or '' }}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '<tool_call>{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}</tool_call>'
    "{%- endfor %}<|end|>"
    "{%- else %}{{ '<|' + message.role + '|>' + message.content + '<|end|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think></think>{%- else %}<think>{%- endif %}"
    "{%- endif %}"
)
CHATS = ("plain", "agent")

_CORPUS = """\
The sea was calm that morning, and the lighthouse keeper climbed the stairs to watch the boats.
Rivers run to the sea; the sea gives rain to the clouds, and the clouds give it back to the hills.
Once upon a time there was a fox who lived at the edge of a forest. Every evening she walked to
the river to drink, and every evening the heron told her a story about the mountains.
"Where are you going?" asked the old man. "To the market," said the girl, "to sell our apples."
She smiled, picked up the basket, and walked down the road while the dog followed behind her.
The train was late again. People checked their phones, looked at the clock, and sighed.
In the library it was quiet; only the pages turned, and somewhere a pencil scratched on paper.
A small machine can hold a small model. Three machines together can hold a larger one, if the
network between them is fast enough to carry the activations from one stage to the next.
Each node announces itself on the local network, measures its links, and joins the mesh.
When a node leaves, the others agree on a new plan and carry on with the request in flight.
The coordinator splits the layers so that every stage fits into the memory of its machine.
Latency is the time one message takes; bandwidth is how much data can move in one second.
Questions and answers. What is the capital of France? Paris. How many legs does a spider have?
Eight. Why is the sky blue? Because air scatters blue light more than red light.
What is two plus two? Four. Who wrote Hamlet? William Shakespeare. What is water made of?
Hydrogen and oxygen. Which planet is the largest? Jupiter. How many days are in a week? Seven.
Cooking: chop the onions, warm the oil, add garlic, stir for a minute, then add the tomatoes.
Bake the bread at two hundred degrees for forty minutes, then let it cool on a wire rack.
Weather: cloudy with a chance of rain in the afternoon, clearing by evening, light winds.
Tomorrow will be sunny and warm, with a gentle breeze from the south and clear skies at night.
Shopping list: milk, eggs, butter, flour, sugar, salt, pepper, rice, beans, lemons, coffee, tea.
Dear Anna, thank you for your letter. We are all well here, and the garden is full of flowers.
Please find attached the report for the third quarter. Let me know if you have any questions.
Meeting notes: review the budget, plan the release, fix the login bug, and update the docs.
History: the printing press spread books across Europe, and with them new ideas and old ones.
Science: plants turn sunlight, water and carbon dioxide into sugar and oxygen by photosynthesis.
Music: the orchestra tuned their instruments, the conductor raised her hands, and silence fell.
Sports: the team scored twice in the second half and won the final in front of a happy crowd.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 42 64 100 128 256 512 1024 2048 4096 65536.
Decimals and dates: 3.14159 2.71828 1.41421 0.5 -7 +3 1e-5 2026-11-22 12:30:45 $19.99 50% 3/4.
Code: def add(a, b): return a + b. for i in range(10): print(i). if x > 0 and y < 1: pass.
class Node: def __init__(self, name): self.name = name. import os, sys, json. return None.
const total = items.reduce((sum, x) => sum + x, 0); fn main() { println!("hello"); }
SELECT name, age FROM users WHERE age >= 18 ORDER BY name; git commit -m "fix: handle errors"
JSON: {"key": "value", "list": [1, 2, 3], "nested": {"ok": true, "none": null}}.
Paths and addresses: /usr/local/bin, ~/.cache/models, C:\\Users\\me, https://example.com/a?b=c#d.
Punctuation and symbols: ! ? , . ; : ' " ( ) [ ] { } < > / \\ | @ # $ % ^ & * - + = ~ `_ ...
Lists:
- first item
- second item
  1. nested one
  2. nested two
Tabs\tand\tcolumns\there, and CAPITAL LETTERS, MixedCase words, and snake_case_names too.
Unicode: café, naïve, résumé, Straße, ¿qué tal?, ça va, smørrebrød, Zürich, Kraków, São Paulo.
东京, 北京, 你好世界, こんにちは, ありがとう, 안녕하세요, Привет, мир, γειά σου, שלום, مرحبا, नमस्ते.
Emoji and symbols: 🙂 🚀 ❤️ 👍 🎉 ✓ ✗ → ← ↑ ↓ • € £ ¥ © ® ™ ° ± × ÷ ≤ ≥ ≠ ∞ π Σ √.
"""


def build_tokenizer(out_dir: Path, vocab_size: int = 512, chat: str = "plain") -> int:
    """Train a byte-level BPE tokenizer with a chat template ("plain" or "agent") into ``out_dir``;
    any text round-trips. Returns the vocabulary's length."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if chat not in CHATS:
        raise ValueError(f"chat must be one of {', '.join(CHATS)}, not {chat!r}")
    specials = SPECIAL_TOKENS + (AGENT_TOKENS if chat == "agent" else [])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=specials[3:],
    )
    fast.chat_template = AGENT_TEMPLATE if chat == "agent" else CHAT_TEMPLATE
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    gen = {
        "bos_token_id": fast.bos_token_id,
        "eos_token_id": [fast.eos_token_id, fast.convert_tokens_to_ids("<|end|>")],
    }
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return len(fast)


_GAINS = (
    ("gate_proj.weight", 3.0),
    ("up_proj.weight", 3.0),
    ("q_proj.weight", 2.0),
    ("k_proj.weight", 2.0),
    ("lm_head.weight", 4.0),
)


def _hash32(x: mx.array) -> mx.array:
    """Wellons' lowbias32 integer hash, elementwise on uint32 (exact everywhere)."""
    import mlx.core as mx

    x = x ^ (x >> 16)
    x = x * mx.array(0x7FEB352D, mx.uint32)
    x = x ^ (x >> 15)
    x = x * mx.array(0x846CA68B, mx.uint32)
    return x ^ (x >> 16)


def _uniform(shape: tuple[int, ...], seed: int, name: str, bound: float) -> mx.array:
    """Uniform values in [-bound, bound) from (seed, name, position) alone; bit-identical on any CPU."""
    import mlx.core as mx

    salt = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    i = mx.arange(math.prod(shape), dtype=mx.uint32)
    h = _hash32(_hash32(i ^ mx.array(salt & 0xFFFFFFFF, mx.uint32)) ^ mx.array(salt >> 32, mx.uint32))
    u = (h >> 8).astype(mx.float32) * (2.0**-23) - 1.0
    return (u * bound).reshape(shape)


def _init_weights(model: nn.Module, seed: int) -> dict[str, Any]:
    """Deterministic float32 values for every parameter: uniform with bound gain / sqrt(fan_in), as
    mlx's Linear init; norm scales keep the class's init."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    params = dict(tree_flatten(model.parameters()))
    out = {}
    with mx.stream(mx.cpu):
        for name, p in params.items():
            if not mx.issubdtype(p.dtype, mx.floating) or (p.ndim == 1 and not name.endswith("bias")):
                out[name] = p
                continue
            if name.endswith("bias"):
                weight = params.get(name[: -len("bias")] + "weight")
                if weight is None:  # a standalone bias (routing correction, dt_bias): the class's init
                    out[name] = p
                    continue
                fan_in = weight.shape[-1]
            else:
                fan_in = p.shape[-1]
            if "embed_tokens" in name:
                bound = math.sqrt(3.0 / fan_in)
            else:
                bound = next((g for suffix, g in _GAINS if name.endswith(suffix)), 1.0) / math.sqrt(fan_in)
            out[name] = _uniform(tuple(p.shape), seed, name, bound)
            mx.eval(out[name])
    return out


def _save_weights(out_dir: Path, weights: dict[str, mx.array], max_bytes: int) -> None:
    """mlx-lm's save_model layout (shards, names, index) with any shard size, not whole gigabytes."""
    import mlx.core as mx

    shards: list[dict[str, mx.array]] = []
    size = 0
    for name, w in weights.items():
        if not shards or size + w.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = w
        size += w.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        mx.save_safetensors(str(out_dir / file), shard, metadata={"format": "mlx"})
        weight_map.update({k: file for k in shard})
    index = {
        "metadata": {
            "total_size": sum(w.nbytes for w in weights.values()),
            "total_parameters": sum(w.size for w in weights.values()),
        },
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))


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
    quantize: str | None = None,
    group_size: int | None = None,
    chat: str = "plain",
    **overrides: Any,
) -> Path:
    """Write a complete mlx-lm model directory (config, tokenizer, safetensors) and return it.
    ``overrides`` go into config.json last."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import MAX_FILE_SIZE_GB, _get_classes, save_config

    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, not {dtype!r}")
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"quantize must be one of {', '.join(map(str, QUANTIZATIONS))}, not {quantize!r}")
    if family not in FAMILIES and not is_mlx_family(family):
        raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILIES)} or another mlx-lm model type")
    if family in NOT_BUILDABLE:
        raise ValueError(f"{family}: {NOT_BUILDABLE[family]}")
    out_dir = Path(out_dir)
    vocab = build_tokenizer(out_dir, vocab_size, chat)
    sizes: dict[str, Any] = dict(
        num_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        vocab_size=vocab,
        tie=tie_word_embeddings,
        num_experts=num_experts,
        experts_per_tok=experts_per_tok,
        max_position_embeddings=max_position_embeddings,
    )
    legacy = family in FAMILIES
    config = family_config(family, **sizes) if legacy else generic_config(family, **sizes)
    config.update(overrides)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)  # the values themselves come from _init_weights
    model = model_class(args_class.from_dict(config))
    weights = _init_weights(model, seed)
    tied = bool(config.get("tie_word_embeddings") or (config.get("text_config") or {}).get("tie_word_embeddings"))
    target = getattr(mx, dtype)
    # mlx-lm's convert keeps some parameters (routing biases, ...) in float32: its cast_predicate.
    keep = (lambda _: True) if legacy else getattr(model, "cast_predicate", lambda _: True)
    weights = {
        k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) and keep(k) else v for k, v in weights.items()
    }
    config["torch_dtype"] = dtype
    if quantize is not None:
        model.load_weights(list(weights.items()), strict=False)
        config = _quantize(model, config, quantize, group_size)
        weights = dict(tree_flatten(model.parameters()))
    if tied:
        # gemma3_text builds an lm_head whatever the config says and ties when the file has none.
        weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
    max_bytes = (max_file_size_mb << 20) if max_file_size_mb else (MAX_FILE_SIZE_GB << 30)
    _save_weights(out_dir, weights, max_bytes)
    save_config(config, config_path=out_dir / "config.json")
    return out_dir


QUANTIZATIONS: tuple[str | None, ...] = (None, "4bit", "8bit", "mixed", "mxfp4")


def _quantize(model: nn.Module, config: dict[str, Any], quantize: str, group_size: int | None) -> dict[str, Any]:
    """Quantize ``model`` in place with mlx-lm's ``quantize_model``; returns the config it writes.
    Layers narrower than a group stay unquantized, hence a default group size of 32."""
    import contextlib
    import io

    from mlx_lm.convert import mixed_quant_predicate_builder
    from mlx_lm.utils import quantize_model

    mode, bits, predicate = "affine", 4, None
    if quantize == "8bit":
        bits = 8
    elif quantize == "mxfp4":
        mode, group_size = "mxfp4", group_size or 32
    elif quantize == "mixed":
        predicate = mixed_quant_predicate_builder("mixed_4_6", model, group_size or 32)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints the bits per weight
        _, config = quantize_model(model, config, group_size or 32, bits, mode=mode, quant_predicate=predicate)  # type: ignore[arg-type]  # mlx-lm's own annotations disagree
    return config


def build_once(final: Path, family: str = "llama", **kwargs: Any) -> Path:
    """``build_model`` into ``final`` unless there, via a renamed temporary sibling; of two racing
    builds the first wins."""
    final = Path(final)
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build_model(tmp, family, **kwargs)
        try:
            os.replace(tmp, final)
        except OSError:  # another process published it first
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def model_dir_for(cache_root: Path, family: str = "llama", **kwargs: Any) -> Path:
    """A cached build under ``cache_root``, named by a hash of its arguments; built once, atomically."""
    key = json.dumps({"family": family, **kwargs, "v": BUILD_VERSION}, sort_keys=True)
    name = f"{family}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    return build_once(Path(cache_root) / name, family, **kwargs)
