"""What can go wrong with a remote stage: gRPC status codes mapped to the error that says what to do next."""

from __future__ import annotations

import grpc


class StageError(RuntimeError):
    """A remote stage failed, refused, or did not answer in time."""


class StageRefused(StageError):
    """The stage said no (stale epoch, not loaded): retrying on a new plan may help."""


class StagePending(StageRefused):
    """The stage is still adopting or loading this epoch: retry the same placement shortly."""


class PrefixMiss(StageError):
    """The stage no longer holds the kept prefix to resume from: resend the whole prompt."""

    quiet = True  # the head reruns the request at once


class StageFault(StageError):
    """The stage raised on its input: deterministic, so the generation ends with this error."""


# "Not yet": gRPC never makes ABORTED itself, so a lost connection is never taken for it.
EPOCH_PENDING = grpc.StatusCode.ABORTED
# The stage raised: INTERNAL with details starting FAULT (gRPC's client makes INTERNAL of its own).
STAGE_FAULT, FAULT = grpc.StatusCode.INTERNAL, "stage fault: "


# Bad input: refused again if resent (gRPC never makes INVALID_ARGUMENT itself).
INVALID_INPUT = grpc.StatusCode.INVALID_ARGUMENT

# The prefix to resume from is not held (gRPC never makes NOT_FOUND itself).
PREFIX_MISS = grpc.StatusCode.NOT_FOUND


def is_fault(code: grpc.StatusCode | None, details: str | None) -> bool:
    return code == STAGE_FAULT and (details or "").startswith(FAULT)


class StageRefusal(Exception):
    """Why a stage will not run a message, as the gRPC status the caller gets."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def refusal_kind(code: grpc.StatusCode | None, details: str | None) -> type[StageError]:
    """What a stage's (or a head's) error status means."""
    if code == EPOCH_PENDING:
        return StagePending
    if code == PREFIX_MISS:
        return PrefixMiss
    if is_fault(code, details) or code == INVALID_INPUT:
        return StageFault
    if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE):
        return StageRefused
    return StageError


def stage_error(st, exc: grpc.aio.AioRpcError | None, code=None, details=None) -> StageError:
    """The error for a refusal by stage ``st``."""
    code = exc.code() if exc is not None else code
    details = exc.details() if exc is not None else details
    name = code.name if code else "?"
    return refusal_kind(code, details)(f"stage [{st.start}, {st.end}) on {st.node_id}: {name}: {details}")
