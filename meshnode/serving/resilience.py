"""Generations that survive the loss of a stage: the prompt and every token so far replay on a new
plan, so the client sees one stream. A peer that still heartbeats is busy, not lost."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Protocol, TypeVar

from tenacity import AsyncRetrying, RetryError, retry_if_exception_type, stop_after_delay, wait_fixed

from meshnode.errors import MeshnodeError
from meshnode.serving.sampling import SamplingParams

log = logging.getLogger(__name__)

T = TypeVar("T")


class PlacementLost(MeshnodeError, RuntimeError):
    """The placement serving a generation failed; a new plan may carry it on."""


class NotReady(MeshnodeError, RuntimeError):
    """No placement newer than the failed one is ready yet."""


class EpochPending(PlacementLost):
    """A node is still switching to the placement's epoch: retried shortly, costing no attempt."""


class GenerationFault(MeshnodeError, RuntimeError):
    """A stage raised on the generation's input: deterministic, so the generation ends at once."""


async def await_while_alive(
    awaitable: Awaitable[T], alive: Callable[[], bool], lost: Callable[[float], str], poll: float = 0.25
) -> T:
    """``awaitable``'s result, waited for while ``alive()``; else :class:`PlacementLost`. Never
    cancelled for slowness (that would end a gRPC call)."""
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
    """The engine's token source in a mesh: relays a placement's tokens and replays the generation
    on a new plan when it fails. ``current(after_epoch)`` raises :class:`NotReady` until one is ready."""

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
        # same_epoch(epoch, lost at): that placement again if nothing failed.
        self._same_epoch = same_epoch
        self._on_retry = on_retry
        # What the caller gets when the generation is lost for good.
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
                        log.info(
                            "no new plan is coming and every node of epoch %d answered since; retrying "
                            "on the same epoch",
                            after_epoch,
                        )
                        return again
        except RetryError:
            raise PlacementLost(
                f"no new plan was ready within {self._deadline:.0f} s of losing epoch {after_epoch}"
            ) from None
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
        pending_since: float | None = None  # the first of consecutive EpochPending refusals
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
                # Not lost: a node is still switching. A newer ready plan, else the same again.
                now = time.monotonic()
                pending_since = now if pending_since is None else pending_since
                newer = self._newer(placement.epoch)
                if newer is not None:
                    placement = newer
                    continue
                if now - pending_since >= self._deadline:
                    log.error(
                        "generation failed: epoch %d was not ready on every node of it within %.0f s: %s",
                        placement.epoch,
                        self._deadline,
                        exc,
                    )
                    raise PlacementLost(
                        f"epoch {placement.epoch} did not become ready within {self._deadline:.0f} s ({exc})"
                    ) from None
                log.info(
                    "epoch %d is not ready everywhere yet (%s); trying it again in %.2f s",
                    placement.epoch,
                    exc,
                    pending_wait,
                )
                await asyncio.sleep(pending_wait)
                pending_wait = min(1.0, pending_wait * 2)
            except self._retryable as exc:
                lost, lost_at = placement.epoch, time.monotonic()
                pending_since, pending_wait = None, self._poll
                if attempt == self._attempts:
                    log.error(
                        "generation failed for good on epoch %d after %d tokens (%d attempts): %s",
                        lost,
                        len(produced),
                        attempt,
                        exc,
                    )
                    raise
                log.warning(
                    "generation lost epoch %d after %d tokens: %s; waiting for a new plan, or for "
                    "every node to answer (retry %d/%d)",
                    lost,
                    len(produced),
                    exc,
                    attempt,
                    self._attempts - 1,
                )
                if self._on_retry is not None:
                    self._on_retry()
                # The wait for a new plan counts from the loss, not from the generation's start.
                placement = await self._next_placement(lost, lost_at + self._deadline, lost_at)
                attempt += 1
                log.info(
                    "retry %d: replaying %d prompt + %d produced tokens on epoch %d",
                    attempt - 1,
                    len(prompt),
                    len(produced),
                    placement.epoch,
                )
