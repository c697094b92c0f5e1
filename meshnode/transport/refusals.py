"""A stage's refusals: one vocabulary for both ends of a stream.

The serving side raises a :class:`StageError` kind, which goes out as its gRPC status (:data:`STATUS`)
and its message as the details; the calling side maps the status back to the kind (:func:`refusal_kind`)
and says what to do next.
"""

from __future__ import annotations

from typing import Protocol

import grpc

from meshnode.errors import MeshnodeError


class StageError(MeshnodeError, RuntimeError):
    """A remote stage failed, refused, or did not answer in time."""

    @property
    def code(self) -> grpc.StatusCode:
        """The gRPC status this error goes out as."""
        return next(STATUS[kind] for kind in type(self).__mro__ if kind in STATUS)


class StageRefused(StageError):
    """The stage said no (stale epoch, not loaded): a new plan may help."""


class StageUnavailable(StageRefused):
    """The stage's layers are not loaded there, its tensor group broke, or it cannot be reached."""


class StagePending(StageRefused):
    """The stage is still adopting or loading this epoch: retry shortly."""


class PrefixMiss(StageError):
    """The stage no longer holds the prefix to resume from: resend the whole prompt."""

    quiet = True  # the head reruns the request at once


class ContextExceeded(StageError):
    """The request's positions outgrew the stage's context: lost, as any other stage error."""


class StageFault(StageError):
    """The stage raised on its input: deterministic, so the generation ends."""


class InvalidInput(StageFault):
    """The stage's input is malformed (a bad tensor, a rewind past its start): refused again if resent."""


# Each kind's status on the wire, both ways. gRPC never makes ABORTED, NOT_FOUND or INVALID_ARGUMENT
# itself, so a lost connection is none of them; it does make UNAVAILABLE and INTERNAL.
STATUS: dict[type[StageError], grpc.StatusCode] = {
    StageError: grpc.StatusCode.UNKNOWN,
    StageRefused: grpc.StatusCode.FAILED_PRECONDITION,
    StageUnavailable: grpc.StatusCode.UNAVAILABLE,
    StagePending: grpc.StatusCode.ABORTED,
    PrefixMiss: grpc.StatusCode.NOT_FOUND,
    ContextExceeded: grpc.StatusCode.OUT_OF_RANGE,
    StageFault: grpc.StatusCode.INTERNAL,
    InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
}
KINDS = {code: kind for kind, code in STATUS.items()}

# A fault's details start with FAULT: gRPC's own INTERNAL does not.
FAULT = "stage fault: "


def is_fault(code: grpc.StatusCode | None, details: str | None) -> bool:
    return code == STATUS[StageFault] and (details or "").startswith(FAULT)


def refusal_kind(code: grpc.StatusCode | None, details: str | None) -> type[StageError]:
    """What a stage's (or a head's) error status means."""
    kind = KINDS.get(code, StageError) if code is not None else StageError
    if kind is StageFault and not is_fault(code, details):
        return StageError  # gRPC's own INTERNAL: a stream that broke, lost like any other
    return kind


class RefusingStage(Protocol):
    """What a refusal's message names of the stage that refused."""

    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...
    @property
    def node_id(self) -> str: ...


def stage_error(
    st: RefusingStage,
    exc: grpc.aio.AioRpcError | None,
    code: grpc.StatusCode | None = None,
    details: str | None = None,
) -> StageError:
    """The error for a refusal by stage ``st``."""
    code = exc.code() if exc is not None else code
    details = exc.details() if exc is not None else details
    name = code.name if code else "?"
    return refusal_kind(code, details)(f"stage [{st.start}, {st.end}) on {st.node_id}: {name}: {details}")
