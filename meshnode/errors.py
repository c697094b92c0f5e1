"""Every meshnode exception, under one root; and the one error a request can end with.

The tree (module, and the builtin kept as a base where callers catch it); each says what a retry can do:

* MeshnodeError
  * ApiError - a request ends with an HTTP status and an OpenAI body; Retry-After while re-planning
  * ConfigError (config, ValueError) - an unknown setting or a bad value: fix it, a retry fails alike
  * BlasError (blas, ValueError) - ``MESHNODE_BLAS`` names something unusable: MLX's own BLAS runs
  * IdentityError (identity, OSError) - the node id cannot be read or stored: fix the state folder
  * CommandFailed (service, RuntimeError) - a service manager's command exited non-zero
  * PlanError (planner.plans) - no plan fits: the next change of the mesh plans again
  * CannotRewind (model.rewind, RuntimeError) - this cache cannot be cut back: it never will
  * GenerationCancelled (model.scheduler) - the generation's consumer has gone: nothing to retry
  * TensorGroupError (model.tensor_worker, RuntimeError) - a group's worker failed: a new plan may help
  * WireError (model.wire, ValueError) - a peer's tensor is not what was expected: refused again if resent
  * FrameError (transport.dataport, ValueError) - a data-port frame breaks the protocol: the stream ends
  * StageError (transport.refusals, RuntimeError) - a remote stage failed or went silent: re-plan, retry
    * StageRefused - FAILED_PRECONDITION, the stage said no (a superseded epoch): a new plan may help
      * StageUnavailable - UNAVAILABLE, its layers are not loaded there or it cannot be reached: re-plan
      * StagePending - ABORTED, still adopting or loading this epoch: retry shortly, same plan
    * PrefixMiss - NOT_FOUND, the prefix to resume from is gone: resend the whole prompt at once
    * ContextExceeded - OUT_OF_RANGE, the request outgrew the stage's context: lost, as a StageError
    * StageFault - INTERNAL "stage fault: ...", the stage raised on its input: deterministic, it ends
      * InvalidInput - INVALID_ARGUMENT, the input is malformed: refused again if resent
  * PlacementLost (serving.resilience, RuntimeError) - the placement failed: a new plan may carry it on
    * EpochPending - a node is still switching epochs: retried shortly, costing no attempt
  * NotReady (serving.resilience, RuntimeError) - no placement newer than the failed one yet: wait
  * GenerationFault (serving.resilience, RuntimeError) - raised on the input: the generation ends
  * GrammarError (serving.grammar, RuntimeError) - the answer left its grammar: the generation ends
  * FetchError (weights.download, RuntimeError) - a model's files could not be fetched: try another source, later
    * DiskSpaceError - not enough free disk for a transfer, found before it starts: free some
  * ItemFailed (weights.download) - one piece from one peer failed: asked of another peer
  * UnsupportedGGUF (weights.gguf_tensors, ValueError) - a GGUF this node cannot serve: never will
  * NoMTPHead (model.mtp_load, ValueError) - the model's files hold no MTP head: draft another way
  * ModelNotFound (weights.modelsource, RuntimeError) - no such model folder or Hub id: fix the name
  * _StageOutput (model.shard), _Refused (trust.auth) - control flow, caught in their own modules

A stage's refusal is one of the StageError kinds on both sides of a stream: the serving side raises
it, :mod:`meshnode.transport.refusals` maps it to its gRPC status and back. This module imports
nothing from meshnode: every layer imports it.
"""

from __future__ import annotations

from typing import Any, NoReturn


class MeshnodeError(Exception):
    """The root of every exception meshnode raises."""


class ApiError(MeshnodeError):
    """The one error a request can end with, whichever layer finds it: an HTTP status, an OpenAI-style
    body and headers (Retry-After while re-planning). The API makes it the response or, mid-stream, an
    error event; serving raises it without depending on the API."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


async def abort(context: Any, code: Any, details: str) -> NoReturn:
    """Ends a gRPC call with ``code`` and ``details`` (grpc.aio's ``context.abort`` raises)."""
    await context.abort(code, details)
    raise AssertionError("context.abort returned")
