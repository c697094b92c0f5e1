"""A remote stage's gRPC status codes, mapped to errors that say what to do next."""

from __future__ import annotations

import grpc


class StageError(RuntimeError):
    """A remote stage failed, refused, or did not answer in time."""


class StageRefused(StageError):
    """The stage said no (stale epoch, not loaded): a new plan may help."""


class StagePending(StageRefused):
    """The stage is still adopting or loading this epoch: retry shortly."""


class PrefixMiss(StageError):
    """The stage no longer holds the prefix to resume from: resend the whole prompt."""

    quiet = True  # the head reruns the request at once


class StageFault(StageError):
    """The stage raised on its input: deterministic, so the generation ends."""


# Not yet. gRPC never makes ABORTED, NOT_FOUND or INVALID_ARGUMENT itself, so a lost connection is none of them.
EPOCH_PENDING = grpc.StatusCode.ABORTED
# The stage raised: INTERNAL, details starting FAULT (gRPC makes INTERNAL of its own too).
STAGE_FAULT, FAULT = grpc.StatusCode.INTERNAL, "stage fault: "


# Bad input: refused again if resent.
INVALID_INPUT = grpc.StatusCode.INVALID_ARGUMENT

# The prefix to resume from is not held.
PREFIX_MISS = grpc.StatusCode.NOT_FOUND


def is_fault(code: grpc.StatusCode | None, details: str | None) -> bool:
    return code == STAGE_FAULT and (details or "").startswith(FAULT)


class StageRefusal(Exception):
    """Why a stage will not run a message, as the caller's gRPC status."""

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
