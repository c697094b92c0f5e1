"""config.json for tiny test models of every mlx-lm family (meshnode.model.build).

Nine families have hand-written configs (:func:`family_config`); every other family's ModelArgs
dataclass is filled with tiny sizes by field name (:func:`generic_config`), with per-family
overrides where a field has no default or must agree with others.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


def family_config(
    family: str,
    *,
    num_layers: int,
    hidden_size: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    vocab_size: int,
    tie: bool | None,
    num_experts: int,
    experts_per_tok: int,
    max_position_embeddings: int,
) -> dict[str, Any]:
    """config.json for one family: its model_type and every field its ModelArgs needs."""
    head_dim = hidden_size // num_heads
    cfg: dict[str, Any] = dict(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        intermediate_size=intermediate_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        rms_norm_eps=1e-5,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        rope_theta=10000.0,
        model_type=family,
        tie_word_embeddings=bool(tie),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,  # SPECIAL_TOKENS order
    )
    if family in ("qwen2", "qwen3"):  # small Qwen models tie their embeddings
        cfg.update(tie_word_embeddings=True if tie is None else tie)
        if family == "qwen3":
            cfg.update(head_dim=head_dim)
    elif family == "qwen3_moe":
        cfg.update(
            head_dim=head_dim,
            num_experts=num_experts,
            num_experts_per_tok=experts_per_tok,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            moe_intermediate_size=max(1, intermediate_size // 2),
            norm_topk_prob=True,
        )
    elif family == "mixtral":
        cfg.update(num_local_experts=num_experts, num_experts_per_tok=experts_per_tok)
    elif family == "gemma2":  # mlx-lm's gemma2 always ties; it has no sliding-window attention of its own
        if tie is False:
            raise ValueError("gemma2 always ties its embeddings in mlx-lm")
        cfg.update(
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            sliding_window=16,
            tie_word_embeddings=True,
        )
    elif family == "gemma3":  # text-only Gemma 3; every third layer global, the rest a 16-token window
        # (mlx-lm fails on fewer layers than the pattern)
        cfg.update(
            model_type="gemma3_text",
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            sliding_window=16,
            sliding_window_pattern=min(3, num_layers),
            rope_local_base_freq=10000.0,
        )
    return cfg


# --- Every other mlx-lm family: its ModelArgs dataclass filled with tiny sizes by field name ----------

# Families mlx-lm cannot build or run without extra packages or weights of their own, or whose
# forward pass has no list of layers to split; build_model refuses them.
NOT_BUILDABLE = {
    "olmo": "mlx-lm's olmo needs the ai2-olmo package",
}

# Per-family fields that have no default, must be consistent with others, or keep a tiny model
# within its own patterns (values over the generic table, before the caller's overrides).
_FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    "deepseek_v3": dict(
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
    ),
    "glm4_moe": dict(n_group=2, topk_group=1, first_k_dense_replace=1),
    "gpt_oss": dict(sliding_window=8, layer_types=None),
    "qwen3_next": dict(full_attention_interval=2, partial_rotary_factor=0.5),
    "minimax": dict(rotary_dim=8),
    "hunyuan": dict(
        use_cla=True,
        cla_share_factor=2,
        use_mixed_mlp_moe=True,
        num_shared_expert=1,
        moe_topk=2,
        rope_scaling={"alpha": 1.0, "factor": 1.0, "type": "dynamic"},
    ),
    "gemma4_text": dict(
        num_kv_shared_layers=0, hidden_size_per_layer_input=0, sliding_window_pattern=2, global_head_dim=16
    ),
    "granite": dict(attention_multiplier=0.25, embedding_multiplier=1.0, residual_multiplier=1.0, logits_scaling=1.0),
    "exaone4": dict(sliding_window=8, sliding_window_pattern="LLG"),
    "ernie4_5_moe": dict(moe_layer_start_index=1, moe_layer_interval=1),
    "smollm3": dict(no_rope_layer_interval=2),
    "llama4": dict(attention_chunk_size=8, interleave_moe_layer_step=2, num_experts_per_tok=1),
}


def _tiny_sizes(
    *,
    num_layers: int,
    hidden_size: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    vocab_size: int,
    tie: bool | None,
    num_experts: int,
    experts_per_tok: int,
    max_position_embeddings: int,
) -> dict[str, Any]:
    """Values for ModelArgs fields, by name, shared by every family's generic config."""
    head_dim = hidden_size // num_heads
    expert = max(1, intermediate_size // 2)
    table: dict[str, Any] = dict(
        vocab_size=vocab_size,
        tie_word_embeddings=bool(tie),
        max_position_embeddings=max_position_embeddings,
        n_positions=max_position_embeddings,
        n_ctx=max_position_embeddings,
        model_max_length=max_position_embeddings,
        rope_theta=10000.0,
        rotary_emb_base=10000,
        rope_scaling=None,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        head_dim=head_dim,
        rotary_dim=head_dim,
        partial_rotary_factor=1.0,
        rotary_pct=1.0,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_shared_experts=1,
        num_shared_experts=1,
        num_shared_expert=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=0,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_layer_freq=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        sliding_window=8,
        sliding_window_size=8,
        attention_window_size=8,
        attention_chunk_size=8,
        linear_num_value_heads=num_heads,
        linear_num_key_heads=num_kv_heads,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        linear_conv_kernel_dim=4,
        conv_kernel=4,
        conv_L_cache=3,
        use_qk_norm=True,
        qk_norm=True,
    )
    for name in ("hidden_size", "n_embd", "d_model", "model_dim", "hidden_dim"):
        table[name] = hidden_size
    for name in ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_transformer_layers"):
        table[name] = num_layers
    for name in (
        "intermediate_size",
        "ffn_hidden_size",
        "n_inner",
        "ff_intermediate_size",
        "intermediate_size_mlp",
        "dense_intermediate_size",
    ):
        table[name] = intermediate_size
    for name in (
        "moe_intermediate_size",
        "expert_ffn_hidden_size",
        "shared_intermediate_size",
        "shared_expert_intermediate_size",
        "moe_ffn_hidden_size",
    ):
        table[name] = expert
    for name in ("num_attention_heads", "n_head", "n_heads", "num_heads"):
        table[name] = num_heads
    for name in ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "num_global_key_value_heads"):
        table[name] = num_kv_heads
    for name in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
        table[name] = num_experts
    for name in ("num_experts_per_tok", "moe_topk", "top_k_experts", "moe_k"):
        table[name] = experts_per_tok
    for name in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "layernorm_epsilon", "norm_eps"):
        table[name] = 1e-5
    return table


def _args_classes(family: str) -> tuple[type[DataclassInstance], type[DataclassInstance] | None]:
    """(ModelArgs, text-config args class or None) of an mlx-lm module."""
    import importlib

    from mlx_lm.utils import MODEL_REMAPPING

    module = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(family, family)}")
    args = module.ModelArgs
    fields = {f.name for f in dataclasses.fields(args)}
    text = None
    if "text_config" in fields:
        text = (
            getattr(module, "TextArgs", None)
            or getattr(module, "TextConfig", None)
            or getattr(module, "TextModelArgs", None)
        )
        if text is None:
            try:
                text = importlib.import_module(f"mlx_lm.models.{family}_text").ModelArgs
            except ImportError:
                text = None
    return args, text


def _fill(args_class: type[DataclassInstance], table: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A config for ``args_class``: the table's tiny sizes, neutral values for other required fields."""
    import typing

    cfg: dict[str, Any] = {}
    for f in dataclasses.fields(args_class):
        if f.name in overrides:
            cfg[f.name] = overrides[f.name]
        elif f.name in table:
            cfg[f.name] = table[f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            t = f.type if not isinstance(f.type, str) else f.type
            origin = typing.get_origin(t) or t
            if t in (bool, "bool"):
                cfg[f.name] = False
            elif t in (int, "int"):
                cfg[f.name] = 1
            elif t in (float, "float"):
                cfg[f.name] = 1.0
            elif origin in (list, "list") or str(t).startswith(("typing.List", "List")):
                cfg[f.name] = []
            elif origin in (dict,) or str(t).startswith(("typing.Dict", "Dict")):
                cfg[f.name] = {}
            else:
                cfg[f.name] = None
    for k, v in overrides.items():
        cfg.setdefault(k, v)
    return cfg


def generic_config(family: str, **sizes: Any) -> dict[str, Any]:
    """config.json for any mlx-lm family: its ModelArgs (and nested text config) filled by name."""
    args_class, text_class = _args_classes(family)
    table = _tiny_sizes(**sizes)
    overrides = dict(_FAMILY_OVERRIDES.get(family, {}))
    overrides = {k: v for k, v in overrides.items()}
    cfg = _fill(args_class, table, overrides)
    cfg["model_type"] = family
    if text_class is not None:
        text_type = next(
            (
                f.default
                for f in dataclasses.fields(text_class)
                if f.name == "model_type" and isinstance(f.default, str)
            ),
            f"{family}_text",
        )
        text = _fill(text_class, table, overrides)
        text["model_type"] = text_type if isinstance(text_type, str) else f"{family}_text"
        cfg["text_config"] = text
        for key in ("vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
            cfg[key] = table[key]
    return cfg


# Gains over the usual 1/sqrt(fan_in) init, by parameter-name suffix: with plain init a random model
# repeats one token forever; sharper attention, a more nonlinear MLP and a larger head give varied
# greedy output with logits far enough apart that ties are rare even in bfloat16.
def is_mlx_family(family: str) -> bool:
    """Whether mlx-lm has a model module (with ModelArgs) for this model type."""
    import importlib.util

    from mlx_lm.utils import MODEL_REMAPPING

    name = MODEL_REMAPPING.get(family, family)
    if not name.replace("_", "").replace("-", "").isalnum():
        return False
    try:
        return importlib.util.find_spec(f"mlx_lm.models.{name}") is not None
    except (ImportError, ValueError):
        return False
