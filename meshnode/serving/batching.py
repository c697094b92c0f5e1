"""Continuous batching where one node holds the whole model (setting ``batching``).

One loop runs all generations of a whole-model local shard with mlx-lm's ``BatchGenerator``,
holding the node's baton a step at a time. Each request keeps its sampler, processors,
log-probabilities and prompt cache.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncGenerator, Generator, Sequence
from typing import TYPE_CHECKING, Any

import mlx.nn as nn
from mlx_lm.generate import BatchGenerator

from meshnode.model.arrivals import taken_in
from meshnode.model.prefixes import PrefixStore, cache_positions, prefix_key
from meshnode.model.scheduler import Baton, TokenJob, TokenScheduler, _settle_generation
from meshnode.model.shard import Shard, any_thread_stream
from meshnode.serving.local_stage import LocalStage
from meshnode.serving.promptcache import MIN_REUSE, PrefixIndex
from meshnode.serving.sampling import SamplingParams, make_request_processors, make_request_sampler, sampled

if TYPE_CHECKING:
    import mlx.core as mx
    from mlx_lm.sample_utils import LogitsProcessor
    from mlx_lm.tokenizer_utils import TokenizerWrapper

log = logging.getLogger(__name__)

# Prompt positions a joining request prefills per step while others decode.
DECODING_CHUNK = 128

# The longest a loop with nothing running waits for requests still on their way before it prefills
# the ones it has: requests sent together are prefilled together and decode in step.
GATHER_S = 0.25


_TOLD_QUANTIZED = False  # the log said once that kv_bits turns batching off


def batchable(handles: Sequence[Any]) -> bool:
    """Whether a placement is one local plain shard holding every layer, with batchable caches."""
    if len(handles) != 1 or not isinstance(handles[0], LocalStage):
        return False
    shard = handles[0].shard
    if not (isinstance(shard, Shard) and shard.group_size == 1 and shard.spec.is_first and shard.spec.is_last):
        return False
    if shard.kv_quant_bits:
        global _TOLD_QUANTIZED
        if not _TOLD_QUANTIZED:
            log.info(
                "kv_bits %d: continuous batching is off (mlx-lm's BatchGenerator cannot hold a quantized KV "
                "cache); concurrent requests take turns",
                shard.kv_quant_bits,
            )
            _TOLD_QUANTIZED = True
        return False
    return True


class ShardModel(nn.Module):
    """The whole-model shard as BatchGenerator wants a model: logits of every position."""

    def __init__(self, shard: Shard):
        super().__init__()  # type: ignore[no-untyped-call]  # mlx's Module has no annotations
        self.shard = shard
        self.layers = shard.model.layers

    def make_cache(self) -> list[Any]:
        return self.shard.make_cache()

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        return self.shard.forward(inputs, cache)


class _Request:
    __slots__ = ("prompt", "params", "resume", "ended", "job", "produced", "grown", "error", "resumed_from")

    def __init__(
        self,
        prompt: list[int],
        params: SamplingParams,
        resume: tuple[str, int] | None,
        ended: threading.Event,
        job: TokenJob,
    ):
        self.prompt, self.params, self.resume, self.ended, self.job = prompt, params, resume, ended, job
        self.produced = self.grown = 0
        self.error: BaseException | None = None
        self.resumed_from: tuple[str, int] | None = None  # the kept prefix its cache started from


def _guarded(request: _Request, processor: LogitsProcessor) -> LogitsProcessor:
    """A processor whose failure fails its own request only; the batch step goes on."""

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        if request.error is not None:
            return logits
        try:
            return processor(tokens, logits)
        except Exception as exc:  # noqa: BLE001 - handed to the request's consumer
            request.error = exc
            return logits

    return process


def _no_tokens() -> Generator[int, None, None]:
    """A batched request's own generator, never stepped: the loop hands its job the tokens."""
    yield from ()


class BatchLoop:
    """One BatchGenerator over a whole-model shard, driven by a thread that exists while requests run."""

    def __init__(
        self,
        scheduler: TokenScheduler,
        stage: LocalStage,
        *,
        prefill_step_size: int = 512,
        prefixes: PrefixIndex | None = None,
        tokenizer: TokenizerWrapper | None = None,
    ):
        self._scheduler = scheduler
        assert isinstance(stage.shard, Shard), "batchable() ran on a local whole-model Shard"
        self._shard = stage.shard
        self._store: PrefixStore | None = stage.prefixes  # the node's kept prefixes
        self._index = prefixes if self._store is not None else None
        self._layers = (self._shard.start, self._shard.end)
        self._tokenizer = tokenizer
        self._prefill_step_size = prefill_step_size
        self._lock = threading.Lock()
        self._incoming: list[_Request] = []
        self._running: dict[int, _Request] = {}
        self._thread: threading.Thread | None = None
        self._generator: BatchGenerator | None = None
        self.widest = 0  # the most requests one step has decoded for
        self.admissions = 0  # times requests were taken into the batch (one prefill batch each)
        self.admitted = 0  # requests taken in

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def queued(self) -> int:
        """Requests submitted that the loop has not yet taken."""
        return len(self._incoming)

    def submit(
        self, prompt: Sequence[int], params: SamplingParams, resume: tuple[str, int] | None, ended: threading.Event
    ) -> TokenJob:
        job = TokenJob(_no_tokens(), asyncio.get_running_loop())
        request = _Request(list(prompt), params, resume, ended, job)
        self._scheduler.track(job)
        with self._lock:
            self._incoming.append(request)
            taken_in()  # (once in: a loop waiting for it takes it)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="meshnode-batch", daemon=True)
                self._thread.start()
        return job

    # -- the loop's thread
    def _run(self) -> None:
        baton = self._scheduler.baton
        baton.acquire()
        try:
            while True:
                with self._lock:
                    incoming, self._incoming = self._incoming, []
                    if not incoming and not self._running:
                        self._thread = None
                        return
                if not self._running:
                    incoming += self._gather(baton)
                try:
                    self._admit(incoming)
                    self._leave({uid: r for uid, r in self._running.items() if r.job.cancelled.is_set()})
                    if self._running:
                        self._step()
                except Exception as exc:  # the step failed: every request in it
                    log.warning("batched generation failed: %s", exc, exc_info=log.isEnabledFor(logging.DEBUG))
                    for request in list(self._running.values()):
                        self._finish(request, exc)
                    self._running.clear()
                    self._generator = None
                baton.pass_on(_settle_generation)
        finally:
            baton.release()

    def _gather(self, baton: Baton) -> list[_Request]:
        """With nothing running, the requests still on their way (waited for, the baton let go), so
        those sent together are prefilled in one batch and decode in step, as mlx_lm.server takes in
        every queued request before its next step."""
        arrivals = self._scheduler.arrivals
        if arrivals.pending:
            baton.release()
            try:
                arrivals.settled(GATHER_S)
            finally:
                baton.acquire()
        with self._lock:
            incoming, self._incoming = self._incoming, []
        return incoming

    def _batch(self) -> BatchGenerator:
        if self._generator is None:
            self._generator = BatchGenerator(
                ShardModel(self._shard),
                max_tokens=1,
                prefill_step_size=self._prefill_step_size,
                stream=any_thread_stream(),
            )
        return self._generator

    def _grow(self, request: _Request, positions: int) -> None:
        request.grown += positions
        if self._store is not None:
            self._store.grow(self._layers, positions)

    def _admit(self, incoming: list[_Request]) -> None:
        """Takes every request that came since the last step into the batch at once: one insert,
        so the next step prefills their prompts together."""
        entries: list[tuple[_Request, dict[str, Any]]] = []
        for request in incoming:
            if request.job.cancelled.is_set():
                self._finish(request)
                continue
            try:
                entries.append((request, self._entry(request)))
            except Exception as exc:  # noqa: BLE001 - this request's own parameters (a bad grammar)
                self._finish(request, exc)
        if not entries:
            return
        batch = self._batch()
        try:
            uids: list[int | None] = list(batch.insert(**{k: [e[k] for _, e in entries] for k in entries[0][1]}))
        except ValueError:  # one request's own (insert checks all before it takes any): each alone
            uids = [self._insert_alone(request, entry) for request, entry in entries]
        for (request, _), uid in zip(entries, uids):
            if uid is not None:
                self._running[uid] = request
                self._grow(request, len(request.prompt))
        self.admissions += 1
        self.admitted += sum(uid is not None for uid in uids)

    def _entry(self, request: _Request) -> dict[str, Any]:
        """The request's arguments to BatchGenerator.insert, its prompt cache resumed if it can be."""
        params, prompt, skip, cache = request.params, request.prompt, 0, None
        # (a request resumes only where the head matched its prompt)
        if request.resume is not None and self._store is not None and self._index is not None:
            cache, skip = self._resume(self._store, self._index, prompt, *request.resume)
            request.resumed_from = getattr(cache, "resumed_from", None)
        processors = make_request_processors(params, (), self._tokenizer) or []
        # the batch's own sampler: greedy requests share one batched argmax
        sampler = make_request_sampler(params) if params.temperature > 0 else self._batch().sampler
        return {
            "prompts": prompt[skip:],
            "max_tokens": params.max_tokens,
            "caches": cache,
            "all_tokens": prompt[:skip],
            "samplers": sampler,
            "logits_processors": [_guarded(request, p) for p in processors],
        }

    def _insert_alone(self, request: _Request, entry: dict[str, Any]) -> int | None:
        try:
            (uid,) = self._batch().insert(**{k: [v] for k, v in entry.items()})
        except ValueError as exc:
            self._finish(request, exc)
            return None
        return int(uid)

    def _step(self) -> None:
        batch = self._batch()
        # Beside decoders, a prompt is prefilled in shorter chunks, so a step waits for a fraction of it.
        decoding = any(r.produced for r in self._running.values())
        batch.prefill_step_size = min(self._prefill_step_size, DECODING_CHUNK) if decoding else self._prefill_step_size
        _, responses = batch.next()
        self.widest = max(self.widest, len(responses))
        failed: list[tuple[int, _Request]] = []
        for response in responses:
            request = self._running.get(response.uid)
            if request is None:
                continue
            if request.error is not None:
                failed.append((response.uid, request))
                continue
            request.produced += 1
            self._grow(request, 1)
            top = request.params.top_logprobs
            token = int(response.token)
            request.job.put(sampled(token, response.logprobs, top) if top >= 0 else token)
            if response.finish_reason is not None:
                del self._running[response.uid]
                self._release(request)  # its positions are the kept prefix's now
                self._keep(response.prompt_cache, response.all_tokens, request.resumed_from)
                self._finish(request)
        for uid, request in failed:
            self._batch().remove([uid])
            del self._running[uid]
            self._finish(request, request.error)

    def _resume(
        self, store: PrefixStore, index: PrefixIndex, prompt: list[int], key: str, positions: int
    ) -> tuple[Any, int]:
        """A copy of the kept prefix the head chose, else the best one still kept; (None, 0): none."""
        for _ in range(2):
            cache, why = store.resume(self._layers, key, positions, self._shard)
            if cache is not None:
                return cache, positions
            index.forget(key, why)
            again = index.match(prompt)
            if again is None:
                break
            log.debug("prompt cache: prefix %s: %s; resuming from %s instead", key, why, again[0])
            key, positions = again
        log.info("prompt cache: prefix %s: %s; prefilling all %d tokens", key, why, len(prompt))
        return None, 0

    def _leave(self, cancelled: dict[int, _Request]) -> None:
        """Requests whose consumer stopped leave the batch (by uid), their KV kept for the next turn."""
        if not cancelled:
            return
        caches = self._batch().remove(list(cancelled), return_prompt_caches=True)
        for uid, request in cancelled.items():
            del self._running[uid]
            self._release(request)
            if request.produced and uid in caches:  # decoding: its cache holds what it was fed
                cache, tokens = caches[uid]
                self._keep(cache, tokens, request.resumed_from)
            self._finish(request)

    def _keep(self, cache: list[Any] | None, tokens: Sequence[int], parent: tuple[str, int] | None = None) -> None:
        if (
            self._store is None
            or self._index is None
            or cache is None
            or not tokens
            or len(tokens) < MIN_REUSE
            or cache_positions(cache) != len(tokens)
        ):
            return
        tokens = list(tokens)
        key = prefix_key(tokens)
        try:
            if self._store.keep(self._layers, key, cache, len(tokens), parent):
                self._index.add(tokens, key)
        except Exception:  # the answer is complete; only the cache is lost
            log.debug("keeping a prefix failed", exc_info=True)

    def _release(self, request: _Request) -> None:
        """The request's positions are no longer in use (counted once: a kept prefix counts them next)."""
        if request.grown and self._store is not None:
            self._store.grow(self._layers, -request.grown)
        request.grown = 0

    def _finish(self, request: _Request, error: BaseException | None = None) -> None:
        self._release(request)
        request.job.end(error)
        self._scheduler.untrack(request.job)
        request.ended.set()


class BatchedSource:
    """Token ids of generations run by a :class:`BatchLoop`, as PipelineSource gives them."""

    def __init__(
        self,
        scheduler: TokenScheduler,
        stage: LocalStage,
        *,
        prefill_step_size: int = 512,
        prefixes: PrefixIndex | None = None,
        tokenizer: TokenizerWrapper | None = None,
    ):
        self._prefixes = prefixes if stage.prefixes is not None else None
        self.loop = BatchLoop(
            scheduler, stage, prefill_step_size=prefill_step_size, prefixes=self._prefixes, tokenizer=tokenizer
        )

    async def tokens(self, prompt: Sequence[int], params: SamplingParams) -> AsyncGenerator[int, None]:
        index = self._prefixes
        resume = await index.settled_match(prompt) if index is not None else None
        ended = threading.Event()
        job = self.loop.submit(prompt, params, resume, ended)
        produced: list[int] = []
        try:
            async for token in job:
                produced.append(int(token))
                yield token
        finally:  # the prefix kept for the next turn (as PipelineSource.tokens)
            job.cancelled.set()
            if index is not None:
                await index.until_kept(ended, [*prompt, *produced])
