"""MTP heads read from the files that carry them (``meshnode.weights.mtp_layout`` names the layouts):
Qwen3.5 ``mtp.*`` safetensors, DeepSeek-V3 extra layers, GGUF ``blk.N.nextn.*`` in the model's file or
a sibling MTP file. The stored precision is kept: quantized layers stay quantized at their bits."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from meshnode.errors import MeshnodeError
from meshnode.model.mtp import MTPHead, Shared, shared_from
from meshnode.weights import mtp_layout
from meshnode.weights.gguf_config import metadata
from meshnode.weights.gguf_tensors import open_gguf, plan_tensor

log = logging.getLogger(__name__)

# At or under this many bits a head's guesses lose most of their worth.
POOR_BITS = 4


class NoMTPHead(MeshnodeError, ValueError):
    """The files hold no MTP head (the message says where it looked)."""


def build_head(weights: Mapping[str, mx.array], args: Any, shared: Shared | None, source: str) -> MTPHead:
    """An MTPHead holding ``weights`` (the head's names), quantized where they are, checked whole."""
    head = MTPHead(
        args,
        shared,
        own_embed="embed.weight" in weights,
        own_head="head.weight" in weights,
    )
    _quantize_like(head, weights)
    head.load_weights(list(weights.items()), strict=True)
    mx.eval(head.parameters())  # type: ignore[no-untyped-call]  # mlx's Module has no annotations
    bits = head.quantized_bits()
    if bits is not None and bits <= POOR_BITS:
        log.warning("MTP head of %s is quantized to %d bits: a 4-bit head drafts badly", source, bits)
    return head


def _quantize_like(head: MTPHead, weights: Mapping[str, mx.array]) -> None:
    """Quantize the layers whose weights come with scales, at the bits and group size they were
    stored with (read off the shapes: packed width against the layer's float width)."""
    params: dict[str, dict[str, Any]] = {}
    for path, module in head.named_modules():  # type: ignore[no-untyped-call]  # mlx's Module has no annotations
        scales = weights.get(f"{path}.scales")
        if scales is None or not hasattr(module, "to_quantized"):
            continue
        width = module.weight.shape[-1]
        packed = weights[f"{path}.weight"].shape[-1]
        params[path] = {"group_size": width // scales.shape[-1], "bits": packed * 32 // width}
    if params:
        nn.quantize(head, class_predicate=lambda path, _m: params.get(path, False))


def _safetensors(source: Path) -> dict[str, mx.array]:
    files = [source] if source.is_file() else sorted(source.glob("*.safetensors"))
    out: dict[str, mx.array] = {}
    for f in files:
        out.update(mx.load(str(f)))  # type: ignore[arg-type]
    return out


def _config(source: Path) -> dict[str, Any]:
    folder = source if source.is_dir() else source.parent
    path = folder / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def from_qwen(
    weights: Mapping[str, mx.array], args: Any, shared: Shared | None, layer: int = 0, *, zero_centered: bool = False
) -> MTPHead:
    """The head in Qwen3-Next / Qwen3.5 ``mtp.*`` tensors (layer ``layer`` of ``mtp.layers``);
    ``zero_centered``: the checkpoint stores norms as w - 1, as those families' checkpoints do."""
    mine = {n: w for k, w in weights.items() if (n := mtp_layout.qwen_name(k, layer)) is not None}
    if not mine:
        raise NoMTPHead("no mtp.* tensors")
    if zero_centered:
        mine = {n: w + 1.0 if n.endswith("norm.weight") else w for n, w in mine.items()}
    return build_head(mine, args, shared, "mtp.*")


def from_deepseek(
    weights: Mapping[str, mx.array], config: Mapping[str, Any], args: Any, shared: Shared | None, layer: int = 0
) -> MTPHead:
    """The head in DeepSeek-V3 / GLM-4.5 extra layers ``model.layers.{num_hidden_layers + layer}``."""
    count = int(config.get("num_nextn_predict_layers") or 0)
    if not 0 <= layer < count:
        raise NoMTPHead(f"MTP layer {layer}: num_nextn_predict_layers is {count}")
    n = int(config["num_hidden_layers"])
    mine = {name: w for k, w in weights.items() if (name := mtp_layout.deepseek_name(k, n, layer)) is not None}
    if not mine:
        raise NoMTPHead(f"no model.layers.{n + layer}.* tensors")
    return build_head(mine, args, shared, f"model.layers.{n + layer}")


def load_safetensors(source: Path, backbone: nn.Module | None, *, args: Any = None, layer: int = 0) -> MTPHead:
    """The head in a model folder or a safetensors file (Qwen3.5 or DeepSeek layout, told apart
    by names; DeepSeek needs config.json's ``num_nextn_predict_layers``)."""
    weights, config = _safetensors(source), dict(mtp_layout.text_config(_config(source)))
    args = args if args is not None else backbone.args  # type: ignore[union-attr]
    shared = shared_from(backbone) if backbone is not None else None
    kind = mtp_layout.detect(weights, config)
    if kind == mtp_layout.QWEN:
        centered = config.get("model_type") in mtp_layout.ZERO_CENTERED_NORMS
        return from_qwen(weights, args, shared, layer, zero_centered=centered)
    if kind == mtp_layout.DEEPSEEK:
        return from_deepseek(weights, config, args, shared, layer)
    raise NoMTPHead(f"{source}: no MTP head (no mtp.* tensors, no layers past num_hidden_layers)")


def mtp_sibling(model: Path) -> Path | None:
    """The MTP GGUF beside ``model``'s file (``*mtp*.gguf`` or ``*nextn*.gguf``): the one named
    after the model first, else the only one there."""
    found = sorted(
        p
        for p in model.parent.glob("*.gguf")
        if p != model and re.search(r"mtp|nextn", p.name, re.IGNORECASE) is not None
    )
    stem = model.name.split(".")[0].lower()
    named = [p for p in found if p.name.lower().startswith(stem)]
    return named[0] if named else found[0] if len(found) == 1 else None


def load_gguf(path: Path, backbone: nn.Module | None, *, args: Any = None, layer: int = 0) -> MTPHead:
    """The head in a GGUF file's ``blk.N.nextn.*`` and block ``N`` tensors; in ``path``, or in its
    sibling MTP file where ``path`` has none."""
    reader = open_gguf(path)
    blocks = sorted({int(m.group(1)) for t in reader.tensors if (m := re.match(r"blk\.(\d+)\.nextn\.", t.name))})
    if not blocks:
        sibling = mtp_sibling(path)
        if sibling is None:
            raise NoMTPHead(f"{path}: no blk.N.nextn.* tensors and no MTP file beside it")
        return load_gguf(sibling, backbone, args=args, layer=layer)
    meta = metadata(reader)
    arch = str(meta.get("general.architecture", ""))
    count = int(meta.get(f"{arch}.nextn_predict_layers") or len(blocks))
    if not 0 <= layer < min(count, len(blocks)):
        raise NoMTPHead(f"{path}: MTP layer {layer}, the file has {len(blocks)}")
    block = blocks[layer]
    args = args if args is not None else backbone.args  # type: ignore[union-attr]
    # llama.cpp reorders llama's q/k rows for its interleaved rope: undone as the model's are
    heads = {"attn_q": args.num_attention_heads, "attn_k": args.num_key_value_heads} if arch == "llama" else {}
    weights: dict[str, mx.array] = {}
    for t in reader.tensors:
        name = mtp_layout.gguf_name(t.name, block)
        if name is None:
            continue
        kind = t.name.split(".")[-2]
        for planned in plan_tensor(t, name, unpermute=heads.get(kind, 0)):
            weights[planned.name] = planned.make()
    shared = shared_from(backbone) if backbone is not None else None
    return build_head(weights, args, shared, f"{path.name} blk.{block}")


def load_mtp(source: Path | str, backbone: nn.Module | None, *, args: Any = None, layer: int = 0) -> MTPHead:
    """The MTP head in ``source`` (a GGUF file, a safetensors file, or a model folder), sharing
    ``backbone``'s embedding and LM head (an mlx-lm model; None: the head must carry its own, and
    ``args`` give the block's shape)."""
    source = Path(source)
    if source.suffix.lower() == ".gguf":
        return load_gguf(source, backbone, args=args, layer=layer)
    return load_safetensors(source, backbone, args=args, layer=layer)


def save_qwen(head: MTPHead, path: Path) -> None:
    """Save ``head`` in the Qwen3.5 layout (``mtp.*``), as a safetensors file of its own."""
    from mlx.utils import tree_flatten

    back = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc", "norm": "norm"}
    back |= {"embed": "embed_tokens", "head": "lm_head"}
    out: dict[str, mx.array] = {}
    for name, array in dict(tree_flatten(head.parameters())).items():  # type: ignore[no-untyped-call]  # mlx's Module has no annotations
        module, _, rest = name.partition(".")
        out["mtp." + ("layers.0." + rest if module == "block" else f"{back[module]}.{rest}")] = array
    mx.save_safetensors(str(path), out, metadata={"format": "mlx"})
