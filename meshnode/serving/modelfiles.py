"""A served model's files: where its metadata and layers come from, and what they say of it. A node
lacking the model asks peers for its small files; layers come from disk, peers or the Hub.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_config, load_tokenizer

from meshnode.ids import ModelId
from meshnode.serving.mtp_heads import ServedHead, head_source
from meshnode.weights.gguf_source import is_gguf_spec
from meshnode.weights.holdings import Holding
from meshnode.weights.manifest import read_marker
from meshnode.weights.modelsource import ModelNotFound, resolve_model
from meshnode.weights.profile import ModelProfile, profile_model
from meshnode.weights.sourcing import LayerSource, cached_metadata, holdings_of, metadata_from_peers
from meshnode.weights.store import ModelStore
from meshnode.weights.transfer import FetchError

if TYPE_CHECKING:
    from meshnode.metrics import Progress
    from meshnode.serving.settings import ServingSettings

log = logging.getLogger(__name__)
T = TypeVar("T")

# Seconds a node lacking its configured model waits for a peer that holds it.
MODEL_WAIT_S = 300.0

# Searches for a model's holders; yields a function returning (node id, channel) of each found.
Holders = Callable[[str], AbstractAsyncContextManager[Callable[[], list[tuple[str, Any]]]]]


class ModelFiles:
    """Resolves the served model and brings this node its metadata and its stages' layers."""

    def __init__(
        self,
        settings: ServingSettings,
        progress: Progress,
        event: Callable[..., None],
        *,
        model: str | None = None,
        store: ModelStore | None = None,
        learned: bool = False,
    ) -> None:
        """``model``: a folder or an id (None: the demo); ``learned``: a peer's model, from peers."""
        self.settings, self.progress, self._event = settings, progress, event
        self.spec, self._shared_store, self._learned = model, store, learned
        # None until load() reads them
        self.model_id: ModelId | None = None
        self.profile: ModelProfile | None = None
        self.tokenizer: TokenizerWrapper | None = None
        self.vocab_size = 0
        self._path: Path | None = None
        self._store: ModelStore | None = None  # serves held models to peers
        self._source: LayerSource | None = None  # folders holding layer ranges
        self.mtp: ServedHead | None = None  # the model's MTP head on this node

    async def load(self, holders: Holders) -> None:
        """Resolves the model, profiles it and loads its tokenizer (from peers if this disk lacks it)."""
        cache_dir = self.settings.resolved_cache_dir()
        peer_models = cache_dir / "peer-models"
        try:
            if self._learned:  # only the peers that offer it have it
                raise ModelNotFound(f"model {self.spec} is offered by a peer")
            try:
                model_id, path = await asyncio.to_thread(resolve_model, self.spec, cache_dir, self.progress.update)
            finally:
                self.progress.finish()
        except ModelNotFound as exc:  # from a folder fetched earlier, or from peers
            if not self.spec or (
                not self._learned and (is_gguf_spec(self.spec) or Path(self.spec).expanduser().is_absolute())
            ):
                raise
            model_id = self.spec
            path = cached_metadata(peer_models, model_id) or await self._from_peers(exc, model_id, holders, peer_models)
        self.model_id, self._path = ModelId(model_id), path
        # What this node serves to peers, and where missing layers come from.
        store = self._store = self._shared_store or ModelStore(peer_models)
        store.add(model_id, path if self.weights_local else cached_metadata(peer_models, model_id) or path)
        profile = await asyncio.to_thread(profile_model, path, model_id)
        if not self.settings.placement.may_use_mtp:  # the head's memory is planned only where it may draft
            profile = profile.without_mtp()
        self.profile = profile
        self.mtp = ServedHead(profile.mtp_bytes > 0, head_source(self.spec, path))
        self._source = LayerSource(model_id, path, peer_models, store, profile.num_layers)
        # As mlx_lm.load does: the model's own end-of-sequence ids.
        eos = (await asyncio.to_thread(load_config, path)).get("eos_token_id")
        tokenizer: TokenizerWrapper = await asyncio.to_thread(load_tokenizer, path, eos_token_ids=eos)
        self.tokenizer, self.vocab_size = tokenizer, profile.vocab_size or len(tokenizer)

    @property
    def path(self) -> Path:
        """The model's folder here (complete, or small files and some layers)."""
        return self._loaded(self._path)

    @property
    def store(self) -> ModelStore:
        """What this node serves to peers."""
        return self._loaded(self._store)

    @property
    def loaded_profile(self) -> ModelProfile:
        """The profile, once :meth:`load` ran."""
        return self._loaded(self.profile)

    def _loaded(self, value: T | None) -> T:
        if value is None:
            raise RuntimeError(f"model {self.spec}: its files are not loaded yet (ModelFiles.load)")
        return value

    @property
    def weights_local(self) -> bool:
        """Whether the configured model folder is complete."""
        return read_marker(self.path) is None

    def holdings(self) -> tuple[Holding, ...]:
        return holdings_of(self.store)

    async def _from_peers(self, exc: Exception, model_id: str, holders: Holders, peer_models: Path) -> Path:
        """Waits for a peer that holds the model and fetches its small files."""
        log.info("%s; asking peers for model %s", exc, model_id)
        try:
            async with holders(model_id) as candidates:
                return await metadata_from_peers(model_id, peer_models, candidates, deadline_s=MODEL_WAIT_S)
        except FetchError as err:
            raise ModelNotFound(str(err)) from err

    def local_layers(self, start: int, end: int) -> Path | None:
        """A folder on this disk holding layers [start, end), or None."""
        return self._loaded(self._source).local(start, end)

    async def fetch_layers(self, start: int, end: int, peers: list[tuple[str, Any]]) -> Path:
        """A folder holding layers [start, end) this disk lacks, from ``peers`` or else the Hub."""
        where = f"{len(peers)} peer(s)" if peers else "Hugging Face"
        task = f"fetching layers {start}-{end - 1} of {self.model_id} from {where}"
        self._event("fetch", layers=[start, end], peers=[p for p, _ in peers])
        t0 = time.monotonic()
        try:
            path = await self._loaded(self._source).folder(
                start, end, peers, on_progress=lambda d, n: self.progress.update(task, d, n)
            )
        finally:
            self.progress.finish()
        self._event("fetched", layers=[start, end], seconds=round(time.monotonic() - t0, 2))
        return path
