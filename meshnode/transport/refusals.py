"""What can go wrong with a remote stage, and what each outcome tells a generation to do.

Shared by both transports: a refusal is a gRPC status code and a message, mapped to the error
that says what to do next: retry the placement shortly (:class:`StagePending`), wait for a new
plan (:class:`StageRefused` or any :class:`StageError`), or give up (:class:`StageFault`).
"""

from __future__ import annotations

import grpc


class StageError(RuntimeError):
    """A remote stage failed, refused, or did not answer in time."""


class StageRefused(StageError):
    """The stage said no (stale epoch, not loaded): retrying on a new plan may help."""


class StagePending(StageRefused):
    """The stage's node is still adopting or loading this epoch: retry the same placement shortly."""


class PrefixMiss(StageError):
    """The stage no longer holds the kept prefix to resume from: resend the whole prompt."""

    quiet = True  # the head runs the request again at once (meshnode.serving.generation.PipelineSource)


class StageFault(StageError):
    """The stage raised on its input: deterministic, so the generation ends with this error."""


# "Not yet": retry the same placement shortly. gRPC never produces ABORTED itself, so a lost
# connection (UNAVAILABLE) is never taken for it.
EPOCH_PENDING = grpc.StatusCode.ABORTED
# The stage's computation raised: INTERNAL with details that start with FAULT (gRPC's client makes
# INTERNAL statuses of its own, grpc/grpc#36066, so the code alone is not enough).
STAGE_FAULT, FAULT = grpc.StatusCode.INTERNAL, "stage fault: "


# The stage refused its input: refused again if resent (gRPC never makes INVALID_ARGUMENT itself).
INVALID_INPUT = grpc.StatusCode.INVALID_ARGUMENT

# The prompt cache's prefix to resume from is not held there (gRPC never makes NOT_FOUND itself).
PREFIX_MISS = grpc.StatusCode.NOT_FOUND


def is_fault(code: grpc.StatusCode | None, details: str | None) -> bool:
    return code == STAGE_FAULT and (details or "").startswith(FAULT)


class StageRefusal(Exception):
    """Why a stage will not run a message, as the gRPC status the caller gets."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def refusal_kind(code: grpc.StatusCode | None, details: str | None) -> type[StageError]:
    """What a stage's (or a head's) error status means: the one reading of the codes above."""
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
    """The error for a refusal by stage ``st`` (its ``start``, ``end`` and ``node_id`` name it)."""
    code = exc.code() if exc is not None else code
    details = exc.details() if exc is not None else details
    name = code.name if code else "?"
    return refusal_kind(code, details)(f"stage [{st.start}, {st.end}) on {st.node_id}: {name}: {details}")
