"""What the head's generation thread holds of a stage on another node: one request's stream to it
(meshnode.transport.hop.HopSession over the data port, meshnode.transport.stage.RemoteSession over
gRPC), and a ticket for each message sent on it. Messages go ahead of their replies, which come
back in order."""

from __future__ import annotations

from typing import Literal, Protocol

import mlx.core as mx

from meshnode.model.wire import Placeholder


class StreamTicket(Protocol):
    """One message sent on a stream (meshnode.serving.prefill.Ticket, and more)."""

    positions: int

    def done(self) -> bool: ...

    def check(self) -> None: ...  # raises when the stage is lost (not when it is slow)

    def wait(self) -> None: ...  # until the reply is here, for as long as the stage is alive

    def wait_handle(self) -> object | None: ...  # see meshnode.serving.prefill.wait_first

    def result(self, into: Placeholder | None = None) -> mx.array:
        """The reply's activation; ``into``: written into that step built ahead (its input)."""
        ...


class StageStream(Protocol):
    """One request's stream to a remote stage, driven from the generation thread."""

    remote: Literal[True]

    def submit(self, x: mx.array, *, next_single: bool = False, work: int = 0) -> StreamTicket:
        """Send ``x`` without waiting for the reply."""
        ...

    def finish(self, ticket: StreamTicket, into: Placeholder | None = None) -> mx.array:
        """The reply to ``ticket``; other generations use MLX while this one waits."""
        ...

    def forward(self, x: mx.array) -> mx.array: ...

    def rewind(self, positions: int) -> None: ...  # the stage drops them with the next message

    def keep(self, key: str, positions: int) -> None: ...  # the prompt cache: keep the stage's KV

    def close(self) -> None: ...
