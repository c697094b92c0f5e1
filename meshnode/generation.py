"""Token generation over a chain of stages, with mlx-lm doing the generating.

:class:`PipelineModel` looks like an mlx-lm model to ``mlx_lm.generate.generate_step``: calling
it runs the request's slice through every stage in order (local shards, or remote stages over
gRPC) and returns the last stage's logits. mlx-lm keeps doing what it already does: chunked
prefill, sampling (temperature, top_p), and the generation loop.

:class:`TokenScheduler` owns the one thread that runs MLX work. It advances every active
generation by one token in turn (round robin), so concurrent requests share the node fairly
and never interleave their caches.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import secrets
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import apply_top_p, make_sampler

from meshnode.data.shard import Shard

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


class StageSession(Protocol):
    """One request's use of one stage: keeps that stage's KV cache for the request."""

    def forward(self, x: mx.array) -> mx.array: ...

    def close(self) -> None: ...


class StageHandle(Protocol):
    start: int
    end: int

    def open(self, request_id: str) -> StageSession: ...


class LocalSession:
    def __init__(self, shard: Shard):
        self._shard = shard
        self._cache = shard.make_cache()

    def forward(self, x: mx.array) -> mx.array:
        # Stays lazy: generate_step overlaps building the next step with evaluating this one.
        # (A remote stage evaluates when it encodes the activation for the wire.)
        out = self._shard.forward(x, self._cache)
        if self._shard.spec.is_last:
            out = out[:, -1:, :]
        return out

    def close(self) -> None:
        self._cache = None


class LocalStage:
    """A shard held by this process."""

    def __init__(self, shard: Shard):
        self.shard = shard
        self.start, self.end = shard.start, shard.end

    def open(self, request_id: str) -> LocalSession:
        return LocalSession(self.shard)


class _RequestState:
    """What generate_step sees as the 'prompt cache': the request's open stage sessions."""

    def __init__(self, sessions: list[StageSession]):
        self.sessions = sessions

    @property
    def state(self) -> list[mx.array]:  # generate_step evaluates cache state after prefill
        return []

    def close(self) -> None:
        for session in self.sessions:
            try:
                session.close()
            except Exception:  # closing must never mask the request's own outcome
                log.debug("closing a stage session failed", exc_info=True)


class PipelineModel:
    """An mlx-lm-callable model made of stages covering layers [0, L) in order."""

    def __init__(self, stages: Sequence[StageHandle], request_id: str):
        ends = [0] + [s.end for s in stages]
        if [s.start for s in stages] != ends[:-1]:
            raise ValueError(f"stages do not tile the layers: {[(s.start, s.end) for s in stages]}")
        self._stages = list(stages)
        self._request_id = request_id
        self.state: _RequestState | None = None

    def make_cache(self) -> list[_RequestState]:
        sessions: list[StageSession] = []
        try:
            for stage in self._stages:
                sessions.append(stage.open(self._request_id))
        except BaseException:
            _RequestState(sessions).close()
            raise
        self.state = _RequestState(sessions)
        return [self.state]

    def __call__(self, inputs: mx.array, cache: list[_RequestState]) -> mx.array:
        x = inputs
        for session in cache[0].sessions:
            x = session.forward(x)
        return x

    def close(self) -> None:
        if self.state is not None:
            self.state.close()


def make_request_sampler(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """mlx-lm's sampler; with a seed, the same filtering drawn from the request's own key.

    MLX's random state is global, so concurrent requests would share one stream; a seeded
    request instead splits its own key per token and is reproducible whatever else runs.
    """
    if params.seed is None or params.temperature == 0:
        return make_sampler(temp=params.temperature, top_p=params.top_p)
    # The API accepts any int64 seed (OpenAI's range); mx.random.key takes uint64 only: a negative
    # seed used to fail the generation (a 500, or a broken stream). Found by tests/test_fuzz.py.
    key = mx.random.key(params.seed % 2**64)
    top_p, inv_temp = params.top_p, 1.0 / params.temperature

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        if 0 < top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    return sample


def generate_tokens(
    model: PipelineModel,
    prompt: Sequence[int],
    params: SamplingParams,
    *,
    prefill_step_size: int = 512,
) -> Iterator[int]:
    """Token ids from mlx-lm's generate_step over the pipeline; closes the stages at the end."""
    sampler = make_request_sampler(params)
    try:
        for token, _ in generate_step(
            mx.array(list(prompt), dtype=mx.uint32),
            model,
            max_tokens=params.max_tokens,
            sampler=sampler,
            prefill_step_size=prefill_step_size,
        ):
            yield int(token)
    finally:
        model.close()


_END = object()


class TokenJob:
    """One generation's link between the scheduler thread and an asyncio consumer."""

    def __init__(self, tokens: Iterator[int], loop: asyncio.AbstractEventLoop):
        self.tokens = tokens
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()

    def _put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is gone
            self.cancelled.set()

    async def __aiter__(self):
        try:
            while True:
                item = await self.queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancelled.set()


class TokenScheduler:
    """Runs all MLX work on one thread, one token per active generation in turn."""

    def __init__(self, name: str = "meshnode-mlx"):
        self._inbox: queue.Queue[TokenJob | _Call | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._active = 0
        self._thread.start()

    @property
    def active(self) -> int:
        return self._active

    def submit(self, tokens: Iterator[int]) -> TokenJob:
        job = TokenJob(tokens, asyncio.get_running_loop())
        self._inbox.put(job)
        return job

    def call(self, fn: Callable[[], Any]) -> "asyncio.Future[Any]":
        """Run ``fn`` on the MLX thread (between tokens) and await its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._inbox.put(_Call(fn, loop, future))
        return future

    def stop(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        active: list[TokenJob] = []
        while True:
            # Block only when idle; otherwise pick up newcomers between tokens.
            try:
                while True:
                    job = self._inbox.get(block=not active)
                    if job is None:
                        for j in active:
                            j.tokens.close()
                            j._put(_END)
                        return
                    if isinstance(job, _Call):
                        job.run()
                    else:
                        active.append(job)
            except queue.Empty:
                pass
            self._active = len(active)
            for job in list(active):
                if job.cancelled.is_set():
                    job.tokens.close()
                    active.remove(job)
                    continue
                try:
                    token = next(job.tokens)
                except StopIteration:
                    job._put(_END)
                    active.remove(job)
                except Exception as exc:  # the failure belongs to this request only
                    log.warning("generation failed: %s", exc, exc_info=log.isEnabledFor(logging.DEBUG))
                    job._put(exc)
                    active.remove(job)
                else:
                    job._put(token)
            self._active = len(active)


class _Call:
    """A one-off function for the MLX thread (loading a shard, a remote stage's forward)."""

    def __init__(self, fn: Callable[[], Any], loop: asyncio.AbstractEventLoop, future: asyncio.Future):
        self.fn, self.loop, self.future = fn, loop, future

    def run(self) -> None:
        try:
            result, exc = self.fn(), None
        except BaseException as e:  # handed to the awaiting coroutine
            result, exc = None, e
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, result, exc)
        except RuntimeError:  # the caller's loop is gone
            pass


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


_ids = itertools.count(1)


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{secrets.token_hex(6)}-{next(_ids)}"


class PipelineSource:
    """Token ids from a pipeline of stages run by this node's scheduler."""

    def __init__(
        self,
        scheduler: TokenScheduler,
        stages: Callable[[], Sequence[StageHandle]],
        *,
        prefill_step_size: int = 512,
    ):
        self._scheduler = scheduler
        self._stages = stages
        self._prefill_step_size = prefill_step_size

    async def tokens(self, prompt: Sequence[int], params: SamplingParams):
        model = PipelineModel(self._stages(), new_request_id())
        job = self._scheduler.submit(
            generate_tokens(model, prompt, params, prefill_step_size=self._prefill_step_size)
        )
        async for token in job:
            yield token
