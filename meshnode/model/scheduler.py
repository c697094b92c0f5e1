"""All of a node's MLX work, one piece at a time: MLX evaluation is not re-entrant across threads
for one model, so generations and one-off calls take turns under a :class:`Baton`; a job waiting
on the network lets go of it (:func:`mlx_idle`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from typing import Any, TypeVar

import mlx.core as mx
from mlx_lm.generate import generation_stream

from meshnode.errors import MeshnodeError
from meshnode.model.arrivals import Arrivals
from meshnode.model.shard import any_thread_stream

log = logging.getLogger(__name__)

_END = object()
_T = TypeVar("_T")


class TokenJob:
    """One generation's link between the scheduler thread and an asyncio consumer."""

    def __init__(self, tokens: Generator[int, None, None], loop: asyncio.AbstractEventLoop):
        self.tokens = tokens
        self.loop = loop
        # tokens (an int, or one with its logprobs), then _END or the error that ended the generation
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.cancelled = threading.Event()
        self._ended = False
        self._end_lock = threading.Lock()

    def end(self, error: BaseException | None = None) -> None:
        """Hand the consumer the generation's end (or failure) once, whoever ends it first."""
        with self._end_lock:
            if self._ended:
                return
            self._ended = True
        self.put(error if error is not None else _END)

    def put(self, item: Any) -> None:
        """Hand the consumer ``item`` (a token) from any thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is gone
            self.cancelled.set()

    async def __aiter__(self) -> AsyncIterator[int]:
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


# The baton goes to the claim with the least work before its next token (prompt positions left;
# 0 for a decode step), earliest among equals; one waiting AGE_S goes first, so none starves.
AGE_S = 0.25


def set_priority(work: int) -> None:
    """Declare this thread's work left before its next token (see AGE_S)."""
    _held.priority = max(0, int(work))
    generations = getattr(_held, "generations", None)
    if generations is not None:  # a generation's thread: its scheduler knows what it has left
        generations[threading.get_ident()] = _held.priority


class _Claim:
    __slots__ = ("work", "seq", "since", "granted")

    def __init__(self, work: int, seq: int, since: float):
        self.work, self.seq, self.since, self.granted = work, seq, since, False


class Baton:
    """The right to run MLX work on this node, one thread at a time. A generation lets go while
    it waits for a remote stage and after every token or chunk; the releasing thread hands it to
    one waiting claim (see AGE_S)."""

    def __init__(self, age_s: float = AGE_S, clock: Callable[[], float] = time.monotonic):
        self._cond = threading.Condition()
        self._waiting: list[_Claim] = []
        self._busy = False
        self._seq = itertools.count()
        self.age_s, self._clock = age_s, clock

    def _claim(self) -> _Claim:
        return _Claim(getattr(_held, "priority", 0), next(self._seq), self._clock())

    def _first(self, claims: list[_Claim]) -> _Claim | None:
        if not claims:
            return None
        now = self._clock()
        aged = [c for c in claims if now - c.since >= self.age_s]
        if aged:
            return min(aged, key=lambda c: c.seq)
        return min(claims, key=lambda c: (c.work, c.seq))

    def acquire(self) -> None:
        with self._cond:
            if not self._busy:
                self._busy = True
            else:
                claim = self._claim()
                self._waiting.append(claim)
                while not claim.granted:
                    self._cond.wait()
        _held.baton = self

    def release(self) -> None:
        _held.baton = None
        with self._cond:
            nxt = self._first(self._waiting)
            if nxt is None:
                self._busy = False
                return
            self._waiting.remove(nxt)
            nxt.granted = True  # passed straight on: nobody can slip in between
            self._cond.notify_all()

    def pass_on(self, settle: Callable[[], None] | None = None) -> None:
        """Let a waiting thread with a better claim go first, then take the baton back. ``settle``
        (run only when someone goes first) finishes this thread's running work."""
        with self._cond:
            mine = self._claim()
            yields = bool(self._waiting) and self._first([*self._waiting, mine]) is not mine
        if yields:
            if settle is not None:
                settle()
            self.release()
            self.acquire()

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        self.acquire()
        try:
            yield
        finally:
            self.release()

    def turn(self) -> contextlib.AbstractContextManager[None]:
        """Hold the baton for one piece of work, unless this thread holds it already."""
        return contextlib.nullcontext() if getattr(_held, "baton", None) is self else self.holding()


@contextlib.contextmanager
def mlx_idle() -> Iterator[None]:
    """While waiting (on the network), let other generations run MLX work."""
    flush = getattr(_held, "flush", None)
    if flush is not None:  # tokens held back until this wait (TokenScheduler._drive)
        flush()
    baton = getattr(_held, "baton", None)
    if baton is None:
        yield
        return
    baton.release()
    _held.idle = baton
    try:
        yield
    finally:
        _held.idle = None
        baton.acquire()
        _held.idled = True


@contextlib.contextmanager
def mlx_turn() -> Iterator[None]:
    """Inside :func:`mlx_idle`: hold the baton for one piece of MLX work; elsewhere nothing."""
    baton = getattr(_held, "idle", None)
    if baton is None:
        yield
        return
    baton.acquire()
    try:
        yield
    finally:
        baton.release()


class GenerationCancelled(MeshnodeError):
    """The generation's consumer has gone: raised on its own thread between steps of a long prefill."""

    quiet = True  # a client leaving is normal (TokenScheduler._drive logs it at INFO)


def raise_if_cancelled() -> None:
    """On a generation's thread, raise GenerationCancelled once its consumer has gone; elsewhere nothing."""
    cancelled = getattr(_held, "cancelled", None)
    if cancelled is not None and cancelled.is_set():
        raise GenerationCancelled("the request was cancelled")


def mlx_yield() -> None:
    """Let generations that are waiting for the MLX thread take a turn."""
    baton = getattr(_held, "baton", None)
    if baton is not None:
        baton.pass_on()


def _settle_generation() -> None:
    """Wait for the step generate_step left running on the shards' stream (one user at a time)."""
    mx.synchronize(generation_stream)
    mx.synchronize(any_thread_stream())


class TokenScheduler:
    """Runs all MLX work of this node under one :class:`Baton`: a thread per generation, a token
    at a time; one-off calls run on the scheduler's own thread."""

    def __init__(self, name: str = "meshnode-mlx", age_s: float = AGE_S):
        """``age_s``: see AGE_S; 0 serves claims in the order they came."""
        self._inbox: queue.Queue[_Call | None] = queue.Queue()
        self._baton = Baton(age_s)
        self._name = name
        self._jobs: set[TokenJob] = set()
        self._jobs_lock = threading.Lock()
        self._left: dict[int, int] = {}  # thread -> prompt positions still to prefill
        self._stopped = False
        self.arrivals = Arrivals()  # generation requests on their way here
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def active(self) -> int:
        return len(self._jobs)

    @property
    def baton(self) -> Baton:
        """The right to run MLX work here."""
        return self._baton

    def others_waiting(self) -> bool:
        """Whether another generation has no more prompt left than this thread's, and would wait
        behind its long chunks."""
        me = threading.get_ident()
        left = dict(self._left)  # a copy: other threads add and remove themselves
        mine = left.pop(me, 0)
        return any(theirs <= mine for theirs in left.values())

    def submit(self, tokens: Generator[int, None, None], work: int = 0) -> TokenJob:
        """Run a generation; ``work``: prompt positions it prefills first (see AGE_S)."""
        job = TokenJob(tokens, asyncio.get_running_loop())
        with self._jobs_lock:
            if self._stopped:
                raise RuntimeError("the scheduler is stopped")
            self._jobs.add(job)
        threading.Thread(target=self._drive, args=(job, work), name=f"{self._name}-gen", daemon=True).start()
        return job

    def track(self, job: TokenJob) -> None:
        """Count a generation run elsewhere as active until :meth:`untrack`."""
        with self._jobs_lock:
            if self._stopped:
                raise RuntimeError("the scheduler is stopped")
            self._jobs.add(job)

    def untrack(self, job: TokenJob) -> None:
        with self._jobs_lock:
            self._jobs.discard(job)

    def call(self, fn: Callable[[], _T]) -> asyncio.Future[_T]:
        """Run ``fn`` on the MLX thread (between tokens) and await its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_T] = loop.create_future()
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
            job.end()
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            call = self._inbox.get()
            if call is None:
                return
            with self._baton.holding():
                call.run()

    def _drive(self, job: TokenJob, work: int) -> None:
        """One generation's thread: a token at a time, each computed holding the baton."""
        _held.generations = self._left
        # A token whose step waited on a remote stage goes to the event loop once the next step is
        # out (mlx_idle), so the loop's work overlaps the stage's instead of delaying the send.
        held: list[int] = []

        def flush() -> None:
            while held:
                job.put(held.pop(0))

        _held.flush = flush
        _held.cancelled = job.cancelled
        set_priority(work)
        self._baton.acquire()
        try:
            while not job.cancelled.is_set():
                try:
                    token = next(job.tokens)
                except StopIteration:
                    flush()
                    job.end()
                    return
                except Exception as exc:  # this request's failure only; its caller handles it
                    log.log(
                        logging.INFO if getattr(exc, "quiet", False) else logging.WARNING,
                        "generation failed: %s",
                        exc,
                        exc_info=log.isEnabledFor(logging.DEBUG),
                    )
                    flush()
                    job.end(exc)
                    return
                if getattr(_held, "idled", False):
                    # Waited on a remote stage: the others already had their turn.
                    _held.idled = False
                    held.append(token)
                else:
                    flush()
                    job.put(token)
                    # All stages local: the others' turn, after this request's running step ends.
                    self._baton.pass_on(_settle_generation)
        finally:
            flush()
            _held.flush = _held.cancelled = None
            try:
                job.tokens.close()
            except Exception:  # closing must not mask the outcome already sent
                log.debug("closing a generation failed", exc_info=True)
            finally:
                self._baton.release()
                self._left.pop(threading.get_ident(), None)
                with self._jobs_lock:
                    self._jobs.discard(job)


class _Call:
    """A one-off function for the MLX thread (loading a shard, a remote stage's forward)."""

    def __init__(self, fn: Callable[[], Any], loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any]):
        self.fn, self.loop, self.future = fn, loop, future

    def run(self) -> None:
        try:
            result, exc = self.fn(), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            result, exc = None, e
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, result, exc)
        except RuntimeError:  # the caller's loop is gone
            pass


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


class StepWatch:
    """The model steps in flight, to tell a stalled node (a step that never ends while the event
    loop heartbeats) from a busy one."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._running: dict[int, float] = {}
        self._ids = itertools.count()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        key = next(self._ids)
        with self._lock:
            self._running[key] = self._clock()
        try:
            yield
        finally:
            with self._lock:
                del self._running[key]

    def longest(self) -> float:
        """Seconds the oldest step in flight has run (0 with none in flight)."""
        with self._lock:
            oldest = min(self._running.values(), default=None)
        return 0.0 if oldest is None else self._clock() - oldest
