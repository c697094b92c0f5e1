"""A served model's MTP head on this node, loaded where this node runs every layer of a plan alone,
and the drafter factory its requests speculate with."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshnode.model.shard import Shard
from meshnode.serving.drafter_choice import MTPState
from meshnode.serving.local_stage import LocalStage
from meshnode.weights.gguf_source import OLLAMA_PREFIX, is_gguf_spec, ollama_blob

if TYPE_CHECKING:
    from meshnode.model.mtp import MTPHead
    from meshnode.model.scheduler import TokenScheduler
    from meshnode.serving.drafting import DrafterFactory

log = logging.getLogger(__name__)


def whole_model(handles: Sequence[object]) -> Any:
    """The mlx-lm model of a placement whose one stage is this node's plain shard of every layer (else None)."""
    if len(handles) != 1 or not isinstance(handles[0], LocalStage):
        return None
    shard = handles[0].shard
    if not (isinstance(shard, Shard) and shard.group_size == 1 and shard.spec.is_first and shard.spec.is_last):
        return None
    return shard.model


def head_source(spec: str | None, folder: Path) -> Path:
    """Where the head's tensors are: a GGUF model's own file (its converted folder leaves them out),
    else the model's folder."""
    if spec and is_gguf_spec(spec):
        return ollama_blob(spec) if spec.startswith(OLLAMA_PREFIX) else Path(spec).expanduser()
    return folder


def describe(head: MTPHead) -> str:
    """ "1 layer, 8-bit" or "1 layer, float32": what ``meshnode status`` says of a head."""
    bits = head.quantized_bits()
    dtype = str(head.eh_proj.weight.dtype).removeprefix("mlx.core.")
    return f"1 layer, {bits}-bit" if bits is not None else f"1 layer, {dtype}"


class ServedHead:
    """A model's MTP head on this node: whether its files carry one, and the head loaded for the
    whole-model shard it shares its embedding and LM head with."""

    def __init__(self, present: bool, source: Path):
        self.present, self.source = present, source
        self._head: MTPHead | None = None
        self._model: Any = None  # the backbone _head was loaded for
        self._drafters: DrafterFactory | None = None
        self.error = ""

    def state(self, model: Any) -> MTPState:
        """What a placement running ``model`` (None: not the whole model) knows of the head."""
        loaded = self._head is not None and model is not None and self._model is model
        return MTPState(
            present=self.present,
            whole=model is not None,
            loaded=describe(self._head) if loaded and self._head is not None else "",
            error=self.error,
        )

    def drafters(self, model: Any) -> DrafterFactory:
        """The drafter factory of the head loaded for ``model`` (one tap on its final norm)."""
        from meshnode.serving.mtp_drafting import mtp_drafters

        assert self._head is not None and self._model is model, "state() said the head is loaded for it"
        if self._drafters is None:
            self._drafters = mtp_drafters(self._head, model)
        return self._drafters

    async def load(self, scheduler: TokenScheduler, model: Any) -> None:
        """Load the head for ``model`` (an mlx-lm model of every layer), once per model; a head that
        does not load is logged and leaves the requests to the other drafters."""
        if not self.present or model is self._model:
            return
        from meshnode.model.mtp_load import load_mtp

        try:
            head = await scheduler.call(lambda: load_mtp(self.source, model))
        except Exception as exc:  # noqa: BLE001 - requests then draft another way
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("the MTP head in %s did not load: %s", self.source, self.error)
            return
        self._head, self._model, self._drafters, self.error = head, model, None, ""
        log.info("MTP head loaded from %s: %s", self.source, describe(head))


async def load_for_plan(served: Any, plan: Any, shards: dict[Any, Any]) -> None:
    """Load ``served``'s MTP head where this node runs ``plan``'s one stage alone (``shards``: its shards by key)."""
    head: ServedHead | None = served.files.mtp
    if head is None or not head.present or len(plan.stages) != 1 or list(plan.stages[0].nodes) != [served.node_id]:
        return
    stage = plan.stages[0]
    shard = shards.get((stage.start_layer, stage.end_layer))
    if isinstance(shard, Shard) and shard.spec.is_first and shard.spec.is_last and shard.group_size == 1:
        await head.load(served.scheduler, shard.model)
