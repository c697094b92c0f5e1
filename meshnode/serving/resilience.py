"""Generations that survive the loss of a stage.

:class:`FailoverSource` is the token source the API's engine uses in a mesh. It asks the node for
the current plan's placement (the local pipeline on the head, or the head over gRPC) and relays
its tokens. When that fails mid-way (a stage died, hung, or the head vanished), it waits for the
mesh to publish and load a new plan, then replays the prompt plus every token already produced
on the new placement (prefill rebuilds the KV caches) and carries on. The client sees one
stream: no token missing, none repeated; with greedy decoding the output is identical to a run
without the fault. Attempts are bounded and logged; waiting for the new plan uses tenacity.

A false suspicion costs nothing: a generation waits for a new plan only while one can come. If
no newer plan is known and every node of the lost placement has been heard from (a heartbeat)
since the loss, nothing failed, so nobody is re-planning: the generation replays at once on the
same epoch (``same_epoch``). A node that is really gone is never heard from again, so its
generation waits for the coordinator's new plan as before.

Waiting on a peer (:func:`await_while_alive`) lasts as long as the peer is alive by the control
plane (heartbeats), not a fixed time: a busy peer is not a lost one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Protocol

from tenacity import AsyncRetrying, RetryError, retry_if_exception_type, stop_after_delay, wait_fixed

from meshnode.serving.sampling import SamplingParams

log = logging.getLogger(__name__)


class PlacementLost(RuntimeError):
    """The placement serving a generation failed; a new plan may carry it on."""


class NotReady(RuntimeError):
    """No placement newer than the failed one is ready yet."""


class EpochPending(PlacementLost):
    """A node of the placement has not switched to the placement's epoch yet (it is adopting or
    loading it): transient, so the same placement is tried again shortly, with backoff, until the
    epoch is ready there or a newer plan supersedes it. Costs no attempt."""


class GenerationFault(RuntimeError):
    """A stage raised on the generation's input (a bug, a model it cannot run). Deterministic:
    replaying it would fail the same way, so it ends the generation at once with the stage's error."""


async def await_while_alive(awaitable: Awaitable, alive: Callable[[], bool], lost: Callable[[float], str],
                            poll: float = 0.25):
    """The result of ``awaitable``, waited for as long as ``alive()`` holds (the peer heartbeats);
    raises :class:`PlacementLost` with ``lost(seconds waited)`` once it does not. The awaitable is
    never cancelled by a slow answer (cancelling a gRPC read would end the call)."""
    task = asyncio.ensure_future(awaitable)
    started = time.monotonic()
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll)
            if done:
                return task.result()
            if not alive():
                raise PlacementLost(lost(time.monotonic() - started))
    except BaseException:
        if not task.done():
            task.cancel()
        raise


class Placement(Protocol):
    epoch: int

    def tokens(self, prompt: Sequence[int], params: SamplingParams) -> AsyncGenerator[int, None]: ...


class FailoverSource:
    """Token source that replays a generation onto a new plan when its placement fails.

    ``current(after_epoch)`` returns the placement to use now; with ``after_epoch`` set it must
    raise :class:`NotReady` until a plan with a higher epoch is ready (and may raise any other
    error to give up at once, e.g. when the model no longer fits).
    """

    def __init__(
        self,
        current: Callable[[int | None], Placement],
        *,
        attempts: int = 4,
        deadline: float = 30.0,
        poll: float = 0.05,
        retryable: tuple[type[BaseException], ...] = (PlacementLost,),
        on_retry: Callable[[], None] | None = None,
        give_up: Callable[[BaseException], BaseException] | None = None,
        same_epoch: Callable[[int, float], Placement | None] | None = None,
    ):
        # same_epoch(lost epoch, when it was lost (time.monotonic())): the placement of that epoch
        # again if no newer plan is coming and every node of it was heard from since; else None.
        self._same_epoch = same_epoch
        self._on_retry = on_retry  # called once per retry (metrics)
        # What the caller gets when the generation is lost for good (the API: a 503, retry later).
        self._give_up = give_up
        self._current = current
        self._attempts = attempts
        self._deadline = deadline
        self._poll = poll
        self._retryable = retryable

    async def _next_placement(self, after_epoch: int, until: float, lost_at: float) -> Placement:
        retrying = AsyncRetrying(
            stop=stop_after_delay(max(0.0, until - time.monotonic())),
            wait=wait_fixed(self._poll),
            retry=retry_if_exception_type(NotReady),
        )
        try:
            async for attempt in retrying:
                with attempt:
                    try:
                        return self._current(after_epoch)
                    except NotReady:
                        again = self._same_epoch(after_epoch, lost_at) if self._same_epoch is not None else None
                        if again is None:
                            raise
                        log.info("no new plan is coming and every node of epoch %d answered since; retrying "
                                 "on the same epoch", after_epoch)
                        return again
        except RetryError:
            raise PlacementLost(f"no new plan was ready within {self._deadline:.0f} s of losing epoch "
                                f"{after_epoch}") from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _newer(self, epoch: int) -> Placement | None:
        """The placement of a ready plan newer than ``epoch``, if there is one now."""
        try:
            return self._current(epoch)
        except NotReady:
            return None

    async def tokens(self, prompt: Sequence[int], params: SamplingParams) -> AsyncGenerator[int, None]:
        try:
            async for token in self._tokens(prompt, params):
                yield token
        except (PlacementLost, GenerationFault) as exc:
            if self._give_up is None:
                raise
            raise self._give_up(exc) from exc

    async def _tokens(self, prompt: Sequence[int], params: SamplingParams) -> AsyncGenerator[int, None]:
        produced: list[int] = []
        placement = self._current(None)
        attempt = 1
        pending_since: float | None = None  # the first refusal of a not-yet-switched epoch, in a row
        pending_wait = self._poll
        while True:
            left = params.max_tokens - len(produced)
            if left <= 0:
                return
            again = replace(params, max_tokens=left, offset=params.offset + len(produced))
            try:
                async with contextlib.aclosing(placement.tokens([*prompt, *produced], again)) as tokens:
                    async for token in tokens:
                        produced.append(token)
                        pending_since, pending_wait = None, self._poll
                        yield token
                return
            except EpochPending as exc:
                # Not lost: a node is still switching to this epoch. Use a newer plan if one is
                # ready, else try the same placement again shortly (no attempt spent).
                now = time.monotonic()
                pending_since = now if pending_since is None else pending_since
                newer = self._newer(placement.epoch)
                if newer is not None:
                    placement = newer
                    continue
                if now - pending_since >= self._deadline:
                    log.error("generation failed: epoch %d was not ready on every node of it within %.0f s: %s",
                              placement.epoch, self._deadline, exc)
                    raise PlacementLost(f"epoch {placement.epoch} did not become ready within "
                                        f"{self._deadline:.0f} s ({exc})") from None
                log.info("epoch %d is not ready everywhere yet (%s); trying it again in %.2f s", placement.epoch,
                         exc, pending_wait)
                await asyncio.sleep(pending_wait)
                pending_wait = min(1.0, pending_wait * 2)
            except self._retryable as exc:
                lost, lost_at = placement.epoch, time.monotonic()
                pending_since, pending_wait = None, self._poll
                if attempt == self._attempts:
                    log.error("generation failed for good on epoch %d after %d tokens (%d attempts): %s",
                              lost, len(produced), attempt, exc)
                    raise
                log.warning("generation lost epoch %d after %d tokens: %s; waiting for a new plan, or for "
                            "every node to answer (retry %d/%d)", lost, len(produced), exc, attempt,
                            self._attempts - 1)
                if self._on_retry is not None:
                    self._on_retry()
                # The wait for a new plan counts from the loss: a generation that ran for minutes
                # before it is as entitled to a new plan as one that had just started.
                placement = await self._next_placement(lost, lost_at + self._deadline, lost_at)
                attempt += 1
                log.info("retry %d: replaying %d prompt + %d produced tokens on epoch %d", attempt - 1,
                         len(prompt), len(produced), placement.epoch)
