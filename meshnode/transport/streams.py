"""One request's stream to a remote stage, a ticket per message; replies come in order."""

from __future__ import annotations

import concurrent.futures
from typing import Any, Literal, Protocol, TypeAlias

import mlx.core as mx

from meshnode.model.wire import Placeholder


class Readable(Protocol):
    """A socket-like handle: select() tells when its reply can be read."""

    def fileno(self) -> int: ...


# What a ticket waits on: its reply's future, or a handle to select() on.
WaitHandle: TypeAlias = "concurrent.futures.Future[Any] | Readable"


class StreamTicket(Protocol):
    """One message sent on a stream."""

    positions: int

    def done(self) -> bool: ...

    def check(self) -> None: ...  # raises when the stage is lost, not when slow

    def wait(self) -> None: ...

    def wait_handle(self) -> WaitHandle | None: ...  # see meshnode.serving.prefill.wait_first

    def result(self, into: Placeholder | None = None) -> mx.array:
        """The reply's activation, written into ``into`` when given."""
        ...


class StageStream(Protocol):
    """One request's stream to a remote stage, driven from the generation thread."""

    remote: Literal[True]

    def submit(self, x: mx.array, *, next_single: bool = False, work: int = 0) -> StreamTicket:
        """Send ``x`` without waiting for the reply."""
        ...

    def finish(self, ticket: StreamTicket, into: Placeholder | None = None) -> mx.array:
        """The reply to ``ticket``; other generations use MLX meanwhile."""
        ...

    def forward(self, x: mx.array) -> mx.array: ...

    def rewind(self, positions: int) -> None: ...  # applied with the next message

    def keep(self, key: str, positions: int) -> None: ...  # the stage keeps its KV for the prompt cache

    def close(self) -> None: ...
