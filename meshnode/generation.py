"""Token generation over a chain of stages, with mlx-lm doing the generating.

:class:`PipelineModel` looks like an mlx-lm model to ``mlx_lm.generate.generate_step``: calling
it runs the request's slice through every stage in order (local shards, or remote stages over
gRPC) and returns the last stage's logits. mlx-lm keeps doing what it already does: sampling
(temperature, top_p) and the generation loop. The prompt (all but its last token) is prefilled
first with its chunks pipelined through the stages (meshnode.prefill).

:class:`TokenScheduler` runs all MLX work of the node one piece at a time (:class:`Baton`). Each
generation has its own thread and gives the baton up while a remote stage works on its
activation, so concurrent generations overlap across the stages; they take turns a token each
(fairness) and each keeps its own caches.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import queue
import secrets
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.sample_utils import apply_top_p, make_sampler

from meshnode.data.shard import Shard, any_thread_stream
from meshnode.data.wire import Placeholder
from meshnode.prefill import ChunkSizer, DoneTicket, pipelined_prefill, wait_first

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    # Tokens of this generation already produced elsewhere: a replay after failover passes how many
    # it carries over, so a seeded draw continues where it was instead of starting again.
    offset: int = 0


class StageSession(Protocol):
    """One request's use of one stage: keeps that stage's KV cache for the request."""

    def forward(self, x: mx.array) -> mx.array: ...

    def close(self) -> None: ...


class StageHandle(Protocol):
    start: int
    end: int

    def open(self, request_id: str) -> StageSession: ...


class LocalSession:
    remote = False

    def __init__(self, shard: Shard):
        self._shard = shard
        self._cache = shard.make_cache()
        self._prepared: tuple[Placeholder, mx.array] | None = None

    def prepare(self) -> bool:
        """Build the next one-position step on a placeholder while a remote stage before this one
        works (MLX builds graphs in Python, ~0.2-0.3 ms a layer); False where that cannot be done."""
        build_ahead = getattr(self._shard, "build_ahead", None)  # a tensor group's shard runs elsewhere
        self._prepared = build_ahead(self._cache) if build_ahead is not None else None
        if self._prepared is None:
            return False
        if self._shard.spec.is_last:
            placeholder, out = self._prepared
            self._prepared = (placeholder, out[:, -1:, :])
        return True

    @property
    def placeholder(self) -> Placeholder:
        """The input of the step :meth:`prepare` built: the stage before writes its reply here."""
        return self._prepared[0]

    def run_prepared(self) -> mx.array:
        """The step :meth:`prepare` built, its placeholder filled."""
        (_, out), self._prepared = self._prepared, None
        return out

    def submit(self, x: mx.array) -> DoneTicket:
        """Run one prefill chunk now (pipelined prefill); only its effect on the cache matters."""
        out = self._shard.forward(x, self._cache)
        if self._shard.spec.is_last:
            owned = getattr(self._shard, "owned", None)
            # As mlx-lm's own prefill: evaluate the cache, never the chunk's logits.
            mx.eval([c.state for c in owned(self._cache)] if owned is not None else out)
        else:
            mx.eval(out)
        return DoneTicket(out, x.shape[1])

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
        sessions = cache[0].sessions
        # One position: decoding (or the last prompt token), and one position at a time after it.
        single = inputs.shape[1] == 1
        i = 0
        while i < len(sessions):
            session = sessions[i]
            after = sessions[i + 1] if i + 1 < len(sessions) else None
            if single and session.remote:
                ticket = session.submit(x, next_single=True)
                if after is not None and not after.remote and after.prepare():
                    # The local stage after it builds its step while the remote one computes.
                    session.finish(ticket, into=after.placeholder)
                    x = after.run_prepared()
                    i += 2
                    continue
                x = session.finish(ticket)
            else:
                x = session.forward(x)
            i += 1
        return x

    def prefill(self, tokens: Sequence[int], options: PrefillOptions, busy: Callable[[], bool] | None = None) -> int:
        """Run ``tokens`` through every stage, chunks pipelined (meshnode.prefill); the number of chunks.

        ``busy()``: other generations run on this node now (chunks are then cut short, so they get
        their turns at every stage). Each stage's measured speed is kept on its handle (the
        placement's, shared by its requests) to size the next request's first chunk.
        """
        sessions = self.state.sessions
        seed = [getattr(stage, "prefill_rate", None) for stage in self._stages]
        sizer = ChunkSizer(len(sessions), max_step=options.max_step, max_chunk=options.max_chunk, seed=seed,
                           busy=busy)
        try:
            chunks = pipelined_prefill(sessions, tokens, sizer, wait=_wait_idle, between_steps=mlx_yield)
        finally:
            for stage, rate in zip(self._stages, sizer.per_position):
                if rate:
                    try:
                        stage.prefill_rate = rate
                    except AttributeError:  # a handle that keeps no attributes
                        pass
        log.debug("%s: prefilled %d tokens in %d chunks through %d stages", self._request_id, len(tokens), chunks,
                  len(sessions))
        return chunks

    def close(self) -> None:
        if self.state is not None:
            self.state.close()


def make_request_sampler(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """mlx-lm's sampler; with a seed, the same filtering drawn from the request's own keys.

    MLX's random state is global, so concurrent requests would share one stream; a seeded request
    instead draws token ``i`` of its generation with a key made from ``(seed, i)`` alone. So it is
    reproducible whatever else runs, and a replay that starts at ``params.offset`` (failover)
    draws exactly what the lost placement would have drawn next.
    """
    if params.seed is None or params.temperature == 0:
        return make_sampler(temp=params.temperature, top_p=params.top_p)
    # The API accepts any int64 seed (OpenAI's range): fold it to the key's uint64 (a negative seed
    # used to fail the generation; found by tests/test_fuzz.py).
    seed, index = params.seed % 2**64, params.offset
    top_p, inv_temp = params.top_p, 1.0 / params.temperature

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal index
        key = draw_key(seed, index)
        index += 1
        if 0 < top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        return mx.random.categorical(logprobs * inv_temp, key=key)

    return sample


def draw_key(seed: int, index: int) -> mx.array:
    """The random key of token ``index`` of a generation seeded with ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return mx.random.key(int.from_bytes(digest, "little"))


@dataclass(frozen=True)
class PrefillOptions:
    """Pipelined prefill (meshnode.prefill): on, and the longest a stage's step may run."""

    pipelined: bool = True
    max_step: float = 0.5  # seconds
    max_chunk: int = 512  # positions in one message (the stages refuse more)


def generate_tokens(
    model: PipelineModel,
    prompt: Sequence[int],
    params: SamplingParams,
    *,
    prefill_step_size: int = 512,
    prefill: PrefillOptions | None = None,
    busy: Callable[[], bool] | None = None,
) -> Iterator[int]:
    """Token ids from mlx-lm's generate_step over the pipeline; closes the stages at the end.

    With pipelined prefill, every prompt token but the last first streams through the stages in
    chunks (meshnode.prefill); generate_step then gets the filled cache and the last token, and
    samples and decodes exactly as it does for a prompt it prefilled itself.
    """
    sampler = make_request_sampler(params)
    try:
        ids = list(prompt)
        cache = None
        if prefill is not None and prefill.pipelined and len(ids) > 1:
            cache = model.make_cache()
            model.prefill(ids[:-1], prefill, busy)
            ids = ids[-1:]
        for token, _ in generate_step(
            mx.array(ids, dtype=mx.uint32),
            model,
            max_tokens=params.max_tokens,
            sampler=sampler,
            prompt_cache=cache,
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


_held = threading.local()


class Baton:
    """The right to run MLX work on this node: one thread at a time, handed on in FIFO order.

    Each generation runs on its own thread but computes only while holding the baton; it lets go
    while it waits for a remote stage, so another generation computes meanwhile (overlapped
    decoding), and after every token, so generations take turns (fairness).
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._queue: deque[object] = deque()
        self._busy = False

    def acquire(self) -> None:
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            while self._busy or self._queue[0] is not ticket:
                self._cond.wait()
            self._queue.popleft()
            self._busy = True
        _held.baton = self

    def release(self) -> None:
        _held.baton = None
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    def pass_on(self, settle: Callable[[], None] | None = None) -> None:
        """Let every thread already waiting go first, then take the baton back.

        ``settle`` runs first (only when someone waits): it finishes the work this thread left
        running, so the next holder gets the processor to itself and work finishes in turn
        (first come, first done) instead of sharing it and everything finishing late.
        """
        with self._cond:
            waiting = bool(self._queue)
        if waiting:
            if settle is not None:
                settle()
            self.release()
            self.acquire()

    @contextlib.contextmanager
    def holding(self):
        self.acquire()
        try:
            yield
        finally:
            self.release()


@contextlib.contextmanager
def mlx_idle():
    """While waiting (on the network), let other generations run MLX work."""
    baton = getattr(_held, "baton", None)
    if baton is None:
        yield
        return
    baton.release()
    try:
        yield
    finally:
        baton.acquire()
        _held.idled = True


def mlx_yield() -> None:
    """Let generations that are waiting for the MLX thread take a turn."""
    baton = getattr(_held, "baton", None)
    if baton is not None:
        baton.pass_on()


def _settle_generation() -> None:
    """Wait for the step generate_step left running: it is built on the shards' stream
    (meshnode.data.shard.any_thread_stream), which only one generation may use at a time."""
    mx.synchronize(generation_stream)
    mx.synchronize(any_thread_stream())


def _wait_idle(handles: list, timeout: float) -> None:
    with mlx_idle():
        wait_first(handles, timeout)


class TokenScheduler:
    """Runs all MLX work of this node, one piece at a time (:class:`Baton`).

    Every generation gets a thread that advances it one token at a time, holding the baton
    while it computes and letting go while a remote stage works on its activation; one-off calls
    (a stage's step for another node's generation, loading a shard) run on the scheduler's own
    thread, also under the baton.
    """

    def __init__(self, name: str = "meshnode-mlx"):
        self._inbox: queue.Queue[TokenJob | _Call | None] = queue.Queue()
        self._baton = Baton()
        self._name = name
        self._jobs: set[TokenJob] = set()
        self._jobs_lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def active(self) -> int:
        return len(self._jobs)

    def submit(self, tokens: Iterator[int]) -> TokenJob:
        job = TokenJob(tokens, asyncio.get_running_loop())
        with self._jobs_lock:
            if self._stopped:
                raise RuntimeError("the scheduler is stopped")
            self._jobs.add(job)
        threading.Thread(target=self._drive, args=(job,), name=f"{self._name}-gen", daemon=True).start()
        return job

    def call(self, fn: Callable[[], Any]) -> "asyncio.Future[Any]":
        """Run ``fn`` on the MLX thread (between tokens) and await its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._inbox.put(_Call(fn, loop, future))
        return future

    def run_here(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the calling thread, holding the baton (a data-port stream's own thread)."""
        with self._baton.holding():
            return fn()

    def stop(self) -> None:
        with self._jobs_lock:
            self._stopped = True
            jobs = list(self._jobs)
        for job in jobs:
            job.cancelled.set()
            job._put(_END)
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            call = self._inbox.get()
            if call is None:
                return
            with self._baton.holding():
                call.run()

    def _drive(self, job: TokenJob) -> None:
        """One generation's thread: a token at a time, each computed holding the baton."""
        self._baton.acquire()
        try:
            while not job.cancelled.is_set():
                try:
                    token = next(job.tokens)
                except StopIteration:
                    job._put(_END)
                    return
                except Exception as exc:  # the failure belongs to this request only
                    log.warning("generation failed: %s", exc, exc_info=log.isEnabledFor(logging.DEBUG))
                    job._put(exc)
                    return
                job._put(token)
                if getattr(_held, "idled", False):
                    # This token waited on a remote stage and queued for the baton again after
                    # it: the others already had their turn, and this generation goes on to send
                    # its next activation as soon as its own step is done.
                    _held.idled = False
                else:
                    # All stages local: the others' turn, a token each. generate_step left this
                    # request's next step running (async_eval); it finishes first.
                    self._baton.pass_on(_settle_generation)
        finally:
            try:
                job.tokens.close()
            except Exception:  # closing must not mask the outcome already sent
                log.debug("closing a generation failed", exc_info=True)
            finally:
                self._baton.release()
                with self._jobs_lock:
                    self._jobs.discard(job)


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
        prefill: PrefillOptions | None = None,
    ):
        self._scheduler = scheduler
        self._stages = stages
        self._prefill_step_size = prefill_step_size
        self._prefill = prefill

    async def tokens(self, prompt: Sequence[int], params: SamplingParams):
        model = PipelineModel(self._stages(), new_request_id())
        scheduler = self._scheduler
        job = scheduler.submit(
            generate_tokens(model, prompt, params, prefill_step_size=self._prefill_step_size,
                            prefill=self._prefill, busy=lambda: scheduler.active > 1)
        )
        async for token in job:
            yield token
