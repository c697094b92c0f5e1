"""Load and run a contiguous range of layers [start, end) of any mlx-lm model.

The family's own forward pass runs, so every quirk stays as mlx-lm wrote it; layers outside the
range become weightless placeholders, so only the shard's tensors are read from disk. mlx-lm
derives masks from a fixed layer's cache, so a request's cache list covers every layer: real
caches for the shard's own, for the others an alias of an owned cache of the same kind.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NoReturn, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache
from mlx_lm.utils import load_model

from meshnode.errors import MeshnodeError
from meshnode.logonce import Once
from meshnode.model.layer_shard import ShardSpec
from meshnode.model.rewind import CannotRewind, rewind_limit, rewind_owned
from meshnode.model.wire import Placeholder, dtype_name, placeholders_work
from meshnode.weights.kvquant import KV_GROUP_SIZE, kv_quant_problem
from meshnode.weights.profile import activation_dtype, hidden_size
from meshnode.weights.splits import split_boundaries, split_support

log = logging.getLogger(__name__)
_KV_TOLD = Once()  # (kv_bits, why not) warned of: every shard of the model has the same problem


class _StageOutput(MeshnodeError):
    """Carries the hidden state out of the family's forward pass at the shard's end."""

    def __init__(self, hidden: mx.array):
        super().__init__("stage output")
        self.hidden = hidden


class _Skip(nn.Module):
    """Stands in for a layer held by another stage: passes the hidden state through.

    ``arity``: the length of the tuple the real layer returns; the extra entries are None.
    """

    def __init__(self, arity: int = 1):
        super().__init__()  # type: ignore[no-untyped-call]  # mlx's Module has no annotations
        self._arity = arity

    def _out(self, h: mx.array) -> mx.array | tuple[mx.array | None, ...]:
        return h if self._arity == 1 else (h,) + (None,) * (self._arity - 1)

    def __call__(self, h: mx.array, *args: object, **kwargs: object) -> mx.array | tuple[mx.array | None, ...]:
        return self._out(h)


class _Inject(_Skip):
    """Stands in for layer start-1: replaces the hidden state with the received activation."""

    def __init__(self, slot: threading.local, arity: int = 1):
        super().__init__(arity)
        self._slot = slot

    def __call__(self, h: mx.array, *args: object, **kwargs: object) -> mx.array | tuple[mx.array | None, ...]:
        return self._out(self._slot.hidden)


class _Exit(nn.Module):
    """Stands in for layer ``end``: stops the forward pass and hands out the hidden state."""

    def __call__(self, h: mx.array, *args: object, **kwargs: object) -> NoReturn:
        raise _StageOutput(h)


class _NoEmbedding(nn.Module):
    """Replaces the embedding on stages that start with a received activation (never computed)."""

    def __init__(self, hidden_size: int, dtype: mx.Dtype):
        super().__init__()  # type: ignore[no-untyped-call]  # mlx's Module has no annotations
        self._hidden_size = hidden_size
        self._dtype = dtype

    def __call__(self, inputs: mx.array) -> mx.array:
        return mx.zeros((*inputs.shape, self._hidden_size), dtype=self._dtype)


class _Absent(nn.Module):
    """Replaces the final norm / head on stages that never reach them."""

    def __call__(self, *args: object, **kwargs: object) -> NoReturn:  # pragma: no cover - unreachable by construction
        raise RuntimeError("this shard does not hold the model's final norm or head")


def _inner(model: nn.Module) -> nn.Module:
    """The module that owns embed_tokens / layers / norm."""
    for name in ("model", "language_model", "transformer"):
        sub = getattr(model, name, None)
        if isinstance(sub, nn.Module) and hasattr(sub, "embed_tokens"):
            return sub
        if isinstance(sub, nn.Module) and isinstance(getattr(sub, "model", None), nn.Module):
            return _inner(sub)
    if hasattr(model, "embed_tokens"):
        return model
    raise ValueError(f"unsupported model layout: {type(model).__name__} has no embed_tokens")


def _plain_attributes(module: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items() if not k.startswith("_")}


def _stand_in(placeholder: nn.Module, original: nn.Module) -> nn.Module:
    """Give a placeholder the original layer's plain attributes (``use_sliding``, ...), sub-modules'
    included, since families read such flags in their forward pass."""
    for key, value in _plain_attributes(original).items():
        if key not in vars(placeholder):
            object.__setattr__(placeholder, key, value)
    for key, child in original.items():
        if isinstance(child, nn.Module) and not hasattr(placeholder, key):
            object.__setattr__(placeholder, key, SimpleNamespace(**_plain_attributes(child)))
    return placeholder


def _return_arity(layer: nn.Module) -> int:
    """How many values the layer's ``__call__`` returns: 1, or the length of its tuple."""
    import ast
    import inspect
    import textwrap

    try:
        source = textwrap.dedent(inspect.getsource(type(layer).__call__))
    except (OSError, TypeError):
        return 1
    func = ast.parse(source).body[0]
    arities = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue
            if isinstance(child, ast.Return) and child.value is not None:
                arities.add(len(child.value.elts) if isinstance(child.value, ast.Tuple) else 1)
            visit(child)

    visit(func)
    if len(arities) > 1:
        raise ValueError(f"{type(layer).__name__}: layers return values of different lengths {sorted(arities)}")
    return arities.pop() if arities else 1


def _private_arrays(module: nn.Module) -> list[mx.array]:
    """Every array held by ``module`` and its sub-modules outside their parameters."""
    found: list[mx.array] = []
    for _, sub in module.named_modules():
        for key, value in [*sub.items(), *vars(sub).items()]:  # an nn.Module keeps arrays as dict items
            if key.startswith("_") and isinstance(value, mx.array):
                found.append(value)
    return found


def _shard_layers(model: nn.Module, inner: nn.Module, start: int, end: int, group: mx.distributed.Group) -> None:
    """Tensor-parallel: split layers [start, end) over ``group`` with the family's own ``shard()``;
    embedding, norm and head stay whole, as in mlx-lm."""
    if not callable(getattr(model, "shard", None)):
        raise ValueError(
            f"{type(model).__module__.rsplit('.', 1)[-1]}: mlx-lm has no tensor-parallel shard() for this model family"
        )
    full = inner.layers
    inner.layers = full[start:end]
    try:
        model.shard(group)
    finally:
        kept = inner.layers
        inner.layers = full
        full[start:end] = kept


def _check_split(config: dict[str, Any], start: int, end: int, num_layers: int) -> None:
    if start == 0 and end == num_layers:
        return
    reason = split_support(config)
    if reason is not None:
        raise ValueError(f"cannot load layers [{start}, {end}) alone: {reason}; load it whole on one node")
    allowed = set(split_boundaries(config)) | {0, num_layers}
    bad = [i for i in (start, end) if i not in allowed]
    if bad:
        raise ValueError(
            f"{config.get('model_type')}: a stage cannot start or end at layer {bad[0]}; "
            f"allowed boundaries: {sorted(allowed)}"
        )


# --- Folders holding only some layers' tensors ---


def _flat(tree: Any) -> list[tuple[str, Any]]:
    """``tree_flatten``'s (dotted name, leaf) pairs."""
    return cast(list[tuple[str, Any]], tree_flatten(tree))


def _is_partial(model_path: Path) -> bool:
    from meshnode.weights.manifest import PARTIAL_MARKER

    return (model_path / PARTIAL_MARKER).is_file()


def _check_partial(model: nn.Module, model_path: Path, start: int, end: int) -> None:
    """After a strict=False load, every parameter the shard keeps must come from the files, not random init."""
    weights: dict[str, Any] = {}
    for wf in sorted(model_path.glob("model*.safetensors")):
        weights.update(cast(dict[str, mx.array], mx.load(str(wf))))  # lazy: headers only
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    missing = sorted(k for k, _ in _flat(model.parameters()) if k not in weights)
    if missing:
        shown = ", ".join(missing[:8]) + (", ..." if len(missing) > 8 else "")
        raise ValueError(
            f"{model_path} holds only some layers and lacks {len(missing)} tensor(s) that layers "
            f"[{start}, {end}) need: {shown}"
        )


# --------------------------------------------------------------------------------------------


_STREAM_LOCK = threading.Lock()
_STREAMS: dict[str, mx.Stream] = {}


def any_thread_stream() -> mx.Stream:
    """The process's one stream for shard work, usable from every thread.

    A step is built on one thread and evaluated on another, which MLX's per-thread streams forbid;
    graphs on this stream are evaluated one at a time, under the node's MLX baton.
    """
    device = str(mx.default_device())
    with _STREAM_LOCK:
        if device not in _STREAMS:
            _STREAMS[device] = mx.new_thread_unsafe_stream(mx.default_device())
        return _STREAMS[device]


def _cache_kind(c: Any) -> tuple[str, object, object]:
    return (type(c).__name__, getattr(c, "max_size", None), getattr(c, "keep", None))


class Shard:
    """Layers [start, end) of a model, ready to run one request's slice of the forward pass."""

    def __init__(
        self,
        model_path: str | Path,
        start: int,
        end: int,
        group: mx.distributed.Group | None = None,
        progress: Callable[[int, int], None] | None = None,
    ):
        model_path = Path(model_path)
        partial = _is_partial(model_path)
        model, config = load_model(model_path, lazy=True, strict=not partial)
        try:
            inner = _inner(model)
            layers = inner.layers  # the list itself: model.layers may be a copy
        except ValueError:  # another layout: only ever run whole
            if not isinstance(getattr(model, "layers", None), list):
                raise
            inner, layers = None, model.layers
        num_layers = len(layers)
        if not (0 <= start < end <= num_layers):
            raise ValueError(f"invalid layer range [{start}, {end}) for a {num_layers}-layer model")
        _check_split(config, start, end, num_layers)
        if inner is None and (group is not None and group.size() > 1 or not (start == 0 and end == num_layers)):
            raise ValueError(
                f"{config.get('model_type')}: unsupported model layout for a stage or a tensor group "
                f"({type(model).__name__} has no embed_tokens); it runs whole on one node"
            )
        self.path = model_path
        self.config = config
        self.spec = ShardSpec(start, end, num_layers)
        self.model = model
        self._slot = threading.local()
        self._lock = threading.Lock()

        # Caches of the whole model, to learn each layer's cache kind.
        self._cache_template = make_prompt_cache(model)
        # The plan's kv_bits (0: off), and why this model cannot quantize its KV ("": it can).
        self.kv_bits = 0
        self.kv_problem = kv_quant_problem(config)
        if len(self._cache_template) != num_layers and not (start == 0 and end == num_layers):
            raise ValueError(
                f"{config.get('model_type')}: one cache per layer expected, "
                f"got {len(self._cache_template)} for {num_layers} layers"
            )

        tied = not hasattr(model, "lm_head") or bool(config.get("tie_word_embeddings", False))
        # From config.json and the headers: packed quantized shapes hide the width.
        self.hidden_size = hidden_size(config)
        dtype = self.dtype = getattr(mx, activation_dtype(model_path))
        self.input_dtype = dtype  # what the stage before sends, learned as it comes

        # Weightless placeholders for every layer this shard does not hold.
        arity = _return_arity(layers[0])
        for i in range(num_layers):
            if i < start or i >= end:
                stand_in: nn.Module
                if i == start - 1:
                    stand_in = _Inject(self._slot, arity)
                elif i == end:
                    stand_in = _Exit()  # type: ignore[no-untyped-call]  # mlx's Module has no annotations
                else:
                    stand_in = _Skip(arity)
                layers[i] = _stand_in(stand_in, layers[i])
        # inner is None only for a model run whole, which stands in for nothing
        if inner is not None and start > 0 and not (self.spec.is_last and tied):
            inner.embed_tokens = _NoEmbedding(self.hidden_size, dtype)
        if inner is not None and not self.spec.is_last:
            inner.norm = _Absent()  # type: ignore[no-untyped-call]  # mlx's Module has no annotations
            if hasattr(model, "lm_head"):
                model.lm_head = _Absent()  # type: ignore[no-untyped-call]  # mlx's Module has no annotations
        if partial:
            _check_partial(model, model_path, start, end)
        if inner is not None and group is not None and group.size() > 1:
            _shard_layers(model, inner, start, end, group)
        self.group_size = group.size() if group is not None else 1
        # Read the remaining tensors, layer by layer, then the rest.
        for k, i in enumerate(range(start, end)):
            mx.eval(layers[i].parameters())
            if progress is not None:
                progress(k + 1, end - start)
        mx.eval(model.parameters())
        # Arrays outside the parameters (rope frequencies) are evaluated here, off the loader's stream.
        mx.eval(_private_arrays(model))
        self.nbytes = sum(v.nbytes for _, v in _flat(model.parameters()))
        log.info(
            "loaded layers [%d, %d) of %s (%d layers): %.1f MiB",
            start,
            end,
            model_path.name,
            num_layers,
            self.nbytes / 2**20,
        )

    @property
    def start(self) -> int:
        return self.spec.start

    @property
    def end(self) -> int:
        return self.spec.end

    def parameter_names(self) -> list[str]:
        return [k for k, _ in _flat(self.model.parameters())]

    @property
    def kv_quant_bits(self) -> int:
        """Bits the KV caches this shard makes are quantized to (0: not quantized)."""
        if self.kv_bits and self.kv_problem:
            if _KV_TOLD.first((self.kv_bits, self.kv_problem)):
                log.warning("kv_bits %d: the KV cache stays unquantized: %s", self.kv_bits, self.kv_problem)
            return 0
        return self.kv_bits

    def cache_template(self) -> list[Any]:
        """The whole model's caches, quantized when the KV is."""
        bits = self.kv_quant_bits
        if not bits:
            return self._cache_template
        return [
            QuantizedKVCache(group_size=KV_GROUP_SIZE, bits=bits) if type(c) is KVCache else c
            for c in self._cache_template
        ]

    @property
    def rewind_limit(self) -> tuple[int | None, str]:
        """How far a request's cache can be cut back."""
        return rewind_limit(self.cache_template())

    def make_cache(self, owned: list[Any] | None = None) -> list[Any]:
        """A per-request cache: real caches for owned layers (fresh, or ``owned``), aliases for the rest."""
        start, end = self.spec.start, self.spec.end
        templates = self.cache_template()
        if start == 0 and end == self.spec.num_layers:  # the whole model: the family's own caches
            return list(owned) if owned is not None else copy.deepcopy(templates)
        caches: list[Any] = [None] * self.spec.num_layers
        by_kind: dict[tuple[str, object, object], Any] = {}
        for i in range(start, end):
            caches[i] = owned[i - start] if owned is not None else copy.deepcopy(templates[i])
            by_kind.setdefault(_cache_kind(caches[i]), caches[i])
        for i, template in enumerate(templates):
            if caches[i] is None:
                # A kind this shard never runs gets a private, never-updated cache for its mask.
                caches[i] = by_kind.get(_cache_kind(template)) or copy.deepcopy(template)
        return caches

    @property
    def keeps_prefixes(self) -> bool:
        return True

    def owned(self, cache: list[Any]) -> list[Any]:
        """The caches of this shard's own layers."""
        return cache[self.spec.start : self.spec.end]

    def disk_template(self) -> list[Any]:
        return self.owned(self.cache_template())

    def rewind(self, cache: list[Any], positions: int) -> None:
        if positions <= 0:
            return
        try:
            rewind_owned(self.owned(cache), positions)
        except CannotRewind as exc:
            raise CannotRewind(f"layers [{self.spec.start}, {self.spec.end}): {exc}") from None

    def build_ahead(self, cache: list[Any]) -> tuple[Placeholder, mx.array] | None:
        """The next one-position step, built on a Placeholder before its input exists (None: unsupported)."""
        if not placeholders_work():
            return None
        first = self.spec.is_first
        with mx.stream(any_thread_stream()):  # the placeholder's bfloat16 view is a lazy op too
            placeholder = Placeholder(
                "int32" if first else dtype_name(self.input_dtype), (1, 1) if first else (1, 1, self.hidden_size)
            )
            return placeholder, self.forward(placeholder.array, cache)

    def forward(self, x: mx.array, cache: list[Any] | None, all_positions: bool = True) -> mx.array:
        """Run this shard's layers: a lazy hidden state or logits."""
        # On any_thread_stream: a step may be evaluated on another thread than the one that built it.
        with self._lock, mx.stream(any_thread_stream()):
            if self.spec.is_first:
                tokens = x
            else:
                self._slot.hidden = x
                self.input_dtype = x.dtype
                tokens = mx.zeros(x.shape[:2], dtype=mx.int32)
            out: mx.array
            try:
                out = self.model(tokens, cache=cache)
            except _StageOutput as stop:
                out = stop.hidden
            finally:
                self._slot.hidden = None
            return out
