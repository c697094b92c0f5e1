"""Which models can be cut into pipeline stages, and where: pure functions of config.json, no MLX."""

from __future__ import annotations

from typing import Any

__all__ = ["split_boundaries", "split_support", "text_config"]


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields (multimodal configs nest them under ``text_config`` or
    ``language_config``)."""
    text = config.get("text_config") or config.get("language_config") or {}
    return {**config, **text} if isinstance(text, dict) else config


def _layer_count(config: dict[str, Any]) -> int | None:
    cfg = text_config(config)
    value = next((cfg[k] for k in ("num_hidden_layers", "num_layers", "n_layer", "n_layers") if cfg.get(k)), None)
    return int(value) if value is not None else None


# Families with no ``embed_tokens`` or no list of layers: Shard finds no place to cut them.
_OTHER_LAYOUTS = frozenset(
    {
        "gpt2",
        "gpt_neox",
        "gptj",
        "gpt_bigcode",
        "internlm2",
        "bailing_moe",
        "bailing_moe_linear",
        "bailing_moe_v3",
        "bailing_hybrid",
        "exaone",
        "mamba",
        "mamba2",
        "nanochat",
        "phixtral",
        "lille-130m",
        "talkie",
        "rwkv7",
        "phi",
        "dbrx",
        "openelm",
    }
)


def split_support(config: dict[str, Any]) -> str | None:
    """Why a model cannot be split into stages (then served whole), or None."""
    cfg = text_config(config)
    family = config.get("model_type")
    if int(cfg.get("num_kv_shared_layers") or 0) > 0:
        return (
            f"{family}: its last {cfg['num_kv_shared_layers']} layers reuse the keys and values computed by "
            "earlier layers (num_kv_shared_layers), which a later stage would not have"
        )
    if int(cfg.get("hidden_size_per_layer_input") or 0) > 0:
        return (
            f"{family}: every layer takes its own embedding of the input tokens (hidden_size_per_layer_input), "
            "but a later stage receives only the hidden state"
        )
    if family in _OTHER_LAYOUTS:
        return (
            f"{family}: its embedding and layers are not laid out as embed_tokens / layers / norm, which "
            "the stage runner splits; splitting it is not implemented"
        )
    if family in ("iquestloopcoder",):
        return f"{family}: it runs its layers more than once per token (loops), so no layer range is a stage"
    if (_layer_count(config) or 0) < 2:
        return f"{family}: a model needs at least two layers to split"
    return None


def split_boundaries(config: dict[str, Any]) -> list[int]:
    """The layers a stage may start at besides 0; with cross-layer attention (``use_cla``) only
    at a group of ``cla_share_factor`` layers, which share KV."""
    n = _layer_count(config) or 0
    cfg = text_config(config)
    step = 1
    if cfg.get("use_cla") and int(cfg.get("cla_share_factor") or 1) > 1:
        step = int(cfg["cla_share_factor"])
    return [i for i in range(1, n) if i % step == 0]


def config_value(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The first of ``keys`` set in ``cfg`` (not None), else ``default``."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default
