"""What can go wrong with a remote stage, and what each outcome tells a generation to do.

Shared by every transport (gRPC, meshnode.transport.stage; the data port, meshnode.transport.hop): a
stage's refusal is a gRPC status code and a message, and the caller maps it to the error that
says what to do next: try the same placement again shortly (:class:`StagePending`), wait for a
new plan (:class:`StageRefused`, or any lost :class:`StageError`), or give up at once
(:class:`StageFault`: replaying would fail the same way).
"""

from __future__ import annotations

import grpc


class StageError(RuntimeError):
    """A remote stage failed, refused, or did not answer in time."""


class StageRefused(StageError):
    """The stage said no (stale epoch, not loaded): retrying on a new plan may help."""


class StagePending(StageRefused):
    """The stage's node has not switched to this epoch yet (adopting or loading it): the same
    placement will work shortly, so the caller retries it rather than waiting for a new plan."""


class PrefixMiss(StageError):
    """The stage does not hold the kept prefix the head asked to resume from (evicted, its node
    restarted, its layers moved): the same request with its whole prompt works."""

    quiet = True  # the head runs the request again at once (meshnode.serving.generation.PipelineSource)


class StageFault(StageError):
    """The stage raised on its input (a bug, a model it cannot run): deterministic, so neither a
    retry nor a new plan on the same nodes would help; the generation ends with this error."""


# "Not yet": retry the same placement shortly. gRPC never produces ABORTED itself, so a lost
# connection (UNAVAILABLE) is never taken for it.
EPOCH_PENDING = grpc.StatusCode.ABORTED
# The stage's computation raised: INTERNAL with details that start with FAULT. gRPC's client makes
# INTERNAL statuses of its own ("Internal error from Core" when a stream ends while the client
# still writes, grpc/grpc#36066), so the code alone would take a refusal for a fault.
STAGE_FAULT, FAULT = grpc.StatusCode.INTERNAL, "stage fault: "


# The stage refused its input (a dtype, shape or token it cannot take): sent again it is refused
# again, so the generation ends at once (gRPC never makes INVALID_ARGUMENT itself).
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
    return refusal_kind(code, details)(f"stage [{st.start}, {st.end}) on {st.node_id}: {code.name if code else '?'}: {details}")
