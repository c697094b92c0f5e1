"""Where a generation of one plan runs: here (this node is the head) or on the head over gRPC. Every
failure becomes :class:`EpochPending`, :class:`GenerationFault` or :class:`PlacementLost`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from meshnode.errors import ApiError
from meshnode.model.arrivals import taken_in
from meshnode.model.tensor import TensorGroupError
from meshnode.proto import mesh_pb2, mesh_pb2_grpc
from meshnode.serving.batching import BatchedSource, batchable
from meshnode.serving.drafter_choice import DRAFT_MODEL, MTP, PROMPT_LOOKUP, DrafterChoice, MTPState, choose_drafter
from meshnode.serving.drafting import PromptLookup
from meshnode.serving.generation import PipelineSource, PrefillOptions, new_request_id
from meshnode.serving.grammar import GrammarError, grammar_error
from meshnode.serving.local_stage import LocalStage
from meshnode.serving.lockstep import LockstepGroups, can_lockstep, lockstep_wanted
from meshnode.serving.mtp_heads import ServedHead, whole_model
from meshnode.serving.resilience import EpochPending, GenerationFault, PlacementLost, await_while_alive
from meshnode.serving.sampling import Sampled, SamplingParams
from meshnode.serving.settings import PlacementSettings
from meshnode.serving.speculative import Speculation, why_not
from meshnode.transport.refusals import (
    FAULT,
    STATUS,
    InvalidInput,
    StageError,
    StageFault,
    StagePending,
    StageRefused,
    StageUnavailable,
    refusal_kind,
)

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from meshnode.model.scheduler import TokenScheduler
    from meshnode.planner.plans import Plan
    from meshnode.serving.drafting import DrafterFactory, DraftModel
    from meshnode.serving.promptcache import PrefixIndex
    from meshnode.transport.remote_stage import RemoteStage

log = logging.getLogger(__name__)


def unavailable(message: str, retry_after: int = 2, code: str = "mesh_unavailable") -> ApiError:
    return ApiError(503, message, type="server_error", code=code, headers={"Retry-After": str(retry_after)})


def gave_up(exc: BaseException) -> ApiError:
    """The client's error for a generation that cannot go on (an error event mid-stream)."""
    if isinstance(exc, GenerationFault):
        return unavailable(f"a stage of the mesh failed on this request: {exc}", 5, "stage_fault")
    return unavailable(
        f"the mesh lost this generation's placement and had no new plan ready in time ({exc})", 2, "placement_lost"
    )


def head_of(plan: Plan) -> str:
    """The node holding the last layers: it runs each generation of the plan."""
    return plan.stages[-1].nodes[0]


class HeadPlacement:
    """This node is the head of the plan: generate here, calling the other stages."""

    def __init__(
        self,
        epoch: int,
        scheduler: TokenScheduler,
        handles: list[LocalStage | RemoteStage],
        settings: PlacementSettings,
        on_fault: Callable[[str], None],
        *,
        prefixes: PrefixIndex | None = None,
        tokenizer: TokenizerWrapper | None = None,
        on_lockstep_round: Callable[[int], None] | None = None,
        lockstep: bool = True,
        on_speculated: Callable[[int, int, int, int], None] | None = None,
        on_spec_costs: Callable[[float, float | None], None] | None = None,
        draft: DraftModel | None = None,
        mtp: ServedHead | None = None,
    ) -> None:
        """``lockstep``: concurrent decode steps may go through the stages together; ``mtp``: the
        model's MTP head on this node."""
        self.epoch, self._on_fault, self._scheduler = epoch, on_fault, scheduler
        s = settings
        prefill = PrefillOptions(
            pipelined=s.pipelined_prefill, max_step=s.max_step_ms / 1000, max_chunk=s.prefill_step_size
        )
        batched = s.batching and batchable(handles)  # the whole model here: one batch
        model = whole_model(handles)
        state = mtp.state(model) if mtp is not None else MTPState()
        drafts = mtp.drafters if mtp is not None else None
        spec_for = functools.partial(
            speculation_for, s, on_speculated, draft, on_spec_costs, batched=batched, drafts=drafts, model=model
        )
        speculation, self.drafter = spec_for(mtp=state)
        head = handles[-1]
        limit = head.shard.rewind_limit if isinstance(head, LocalStage) else (None, "")
        if speculation is not None and limit[0] == 0:
            log.info("epoch %d: speculative decoding is off for this model: %s", epoch, limit[1])
            speculation, self.drafter = None, DrafterChoice("off", limit[1])
        self._alone: PipelineSource | None = None  # a lone request's source where concurrent ones batch
        self._limit = limit  # how far the caches can be cut back
        # Bound now: a later plan swapping shards cannot pull them away.
        if batched:
            assert isinstance(handles[0], LocalStage), "batchable() found the whole model here"
            self._source: BatchedSource | PipelineSource = BatchedSource(
                scheduler, handles[0], prefill_step_size=s.prefill_step_size, prefixes=prefixes, tokenizer=tokenizer
            )
            if speculation is not None:  # alone it speculates; with others it joins their batch
                self._alone = PipelineSource(
                    scheduler,
                    lambda: handles,
                    prefill_step_size=s.prefill_step_size,
                    prefill=prefill,
                    prefixes=prefixes,
                    tokenizer=tokenizer,
                    speculation=speculation,
                )
            return
        batcher = (
            LockstepGroups(handles, on_lockstep_round)
            if lockstep and lockstep_wanted(s.lockstep) and can_lockstep(handles)
            else None
        )
        if batcher is not None and self.drafter.kind == MTP:  # a batched step is not recorded for its drafter
            speculation, self.drafter = spec_for(mtp=dataclasses.replace(state, steps_batched=True))
        self._source = PipelineSource(
            scheduler,
            lambda: handles,
            prefill_step_size=s.prefill_step_size,
            prefill=prefill,
            prefixes=prefixes,
            tokenizer=tokenizer,
            batcher=batcher,
            speculation=speculation,
        )

    async def tokens(self, prompt: Sequence[int], params: SamplingParams) -> AsyncGenerator[int, None]:
        source = self._source
        # A request that cannot speculate goes into the batch, so later requests batch with it.
        if self._alone is not None and self._scheduler.active == 0 and not why_not(params, self._limit):
            source = self._alone
        try:
            async with contextlib.aclosing(source.tokens(prompt, params)) as tokens:
                async for token in tokens:
                    yield token
        except StagePending as exc:
            raise EpochPending(str(exc)) from None
        except StageFault as exc:
            raise GenerationFault(str(exc)) from None
        except (StageError, TensorGroupError) as exc:
            raise PlacementLost(str(exc)) from None
        except GrammarError as exc:  # the request's grammar, not this node's layers
            raise GenerationFault(str(exc)) from None
        except Exception as exc:  # this node's own layers raised on the input
            log.exception("epoch %d: the generation failed here", self.epoch)
            self._on_fault(f"the head's layers failed on this input: {type(exc).__name__}: {exc}")
            raise GenerationFault(f"{type(exc).__name__}: {exc}") from None


def speculation_for(
    settings: PlacementSettings,
    on_pass: Callable[[int, int, int, int], None] | None,
    draft: DraftModel | None = None,
    on_costs: Callable[[float, float | None], None] | None = None,
    *,
    batched: bool = False,
    mtp: MTPState | None = None,
    drafts: Callable[[Any], DrafterFactory] | None = None,
    model: Any = None,
) -> tuple[Speculation | None, DrafterChoice]:
    """A placement's speculative decoding (None: off) and its drafter's choice (drafter_choice);
    ``drafts(model)``: the MTP head's drafter factory on ``model``, the whole model here."""
    mode = settings.speculative
    choice = choose_drafter(mode, mtp or MTPState(), batched=batched, draft=draft.name if draft is not None else "")
    if mode == MTP and choice.kind != MTP:
        log.warning('speculative = "mtp": %s; drafting with %s instead', choice.why, choice.kind)
    drafter: DrafterFactory
    if choice.kind == DRAFT_MODEL and draft is not None:
        drafter = draft.drafter
    elif choice.kind == PROMPT_LOOKUP:
        drafter = PromptLookup
    elif choice.kind == MTP and drafts is not None:
        drafter = drafts(model)
    else:
        return None, choice
    if settings.drafters is not None:  # a test harness's drafter
        drafter = settings.drafters(drafter)
    return Speculation(drafter=drafter, on_pass=on_pass, on_costs=on_costs, k_max=settings.draft_max), choice


AFTER_MAX = 16  # given-up generations one request asks its head to wait for


class RemoteHeadPlacement:
    """Another node is the head: ask it for tokens over a gRPC Generate stream."""

    def __init__(
        self,
        epoch: int,
        head: str,
        caller: str,
        channel: Callable[[str], grpc.aio.Channel],
        alive: Callable[[str], bool],
        model: str = "",
    ):
        self.epoch, self.head, self._caller, self.model = epoch, head, caller, model
        self._channel, self._alive = channel, alive
        # Given up since the last request: the next asks the head to wait for them.
        self._given_up: list[str] = []

    async def tokens(self, prompt: Sequence[int], params: SamplingParams) -> AsyncGenerator[int, None]:
        taken_in()  # generated on the head: no batch loop here waits for it
        stub = mesh_pb2_grpc.MeshStub(self._channel(self.head))
        request = generate_request(new_request_id(self._caller), self.epoch, prompt, params)
        request.model = self.model
        request.after.extend(self._given_up[-AFTER_MAX:])
        self._given_up.clear()
        call = stub.Generate(request, wait_for_ready=True)
        over = False  # the head ended the stream (it has kept the prefix)
        # Waited for while it heartbeats; it reports its stages' faults on this stream.
        alive = lambda: self._alive(self.head)  # noqa: E731
        lost = lambda waited: f"head {self.head} stopped heartbeating or is stalled ({waited:.1f} s into a wait)"  # noqa: E731
        try:
            while True:
                reply = await await_while_alive(call.read(), alive, lost)
                if reply is grpc.aio.EOF:
                    over = True
                    code = await call.code()
                    if code != grpc.StatusCode.OK:
                        raise head_failure(self.head, code, await call.details())
                    return
                yield (
                    Sampled(reply.token, reply.logprob, tuple(zip(reply.top_ids, reply.top_logprobs)))
                    if reply.has_logprob
                    else reply.token
                )
        except grpc.aio.AioRpcError as exc:
            over = True
            raise head_failure(self.head, exc.code(), exc.details()) from None
        finally:
            call.cancel()
            if not over:  # complete here first: the head is still finishing it
                self._given_up.append(request.request_id)


def generate_request(
    request_id: str, epoch: int, prompt: Sequence[int], params: SamplingParams
) -> mesh_pb2.GenerateRequest:
    """The GenerateRequest asking a remote head for this generation."""
    penalties = {
        name: value
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty")
        if (value := getattr(params, name)) is not None
    }
    return mesh_pb2.GenerateRequest(
        request_id=request_id,
        epoch=epoch,
        prompt=list(prompt),
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        has_seed=params.seed is not None,
        seed=params.seed or 0,
        offset=params.offset,
        top_k=params.top_k,
        min_p=params.min_p,
        logit_bias=dict(params.logit_bias),
        logprobs=params.wants_logprobs,
        top_logprobs=max(params.top_logprobs, 0),
        grammar=params.grammar,
        **penalties,
    )


def received_params(request: mesh_pb2.GenerateRequest) -> SamplingParams:
    """The SamplingParams of a peer's GenerateRequest (the caller checks ranges)."""
    return SamplingParams(
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed if request.has_seed else None,
        offset=request.offset,
        top_k=request.top_k,
        min_p=request.min_p,
        presence_penalty=request.presence_penalty if request.HasField("presence_penalty") else None,
        frequency_penalty=request.frequency_penalty if request.HasField("frequency_penalty") else None,
        repetition_penalty=request.repetition_penalty if request.HasField("repetition_penalty") else None,
        logit_bias=tuple(sorted(request.logit_bias.items())),
        top_logprobs=request.top_logprobs if request.logprobs else -1,
        grammar=request.grammar,
    )


def head_failure(head: str, code: grpc.StatusCode, details: str) -> Exception:
    """What a remote head's error status means for the generation."""
    kind, message = refusal_kind(code, details), f"head {head}: {code.name}: {details}"
    if issubclass(kind, StagePending):
        return EpochPending(message)
    return GenerationFault(message) if issubclass(kind, StageFault) else PlacementLost(message)


async def serve_generate(
    served: Any, request: mesh_pb2.GenerateRequest, context: grpc.aio.ServicerContext, epoch_now: int
) -> AsyncGenerator[mesh_pb2.GenerateReply, None]:
    """A peer's Generate, where this node is the head of ``request.epoch``."""
    serving = served.serving_plan()
    if serving is None or serving.epoch != request.epoch:
        # Not switched yet: the caller retries shortly. Older than this node's plan: superseded.
        pending = request.epoch > epoch_now or (request.epoch == epoch_now and served.plan is not None)
        await context.abort(
            STATUS[StagePending if pending else StageRefused],
            f"epoch {request.epoch} is not the epoch served here "
            f"({serving.epoch if serving else 'none'}{' yet' if pending else ''})",
        )
    if head_of(serving) != served.node_id:
        await context.abort(STATUS[StageRefused], "this node is not the head of the plan")
    prompt = list(request.prompt)
    if not prompt or len(prompt) >= serving.max_context or max(prompt) >= served.files.vocab_size:
        await context.abort(STATUS[InvalidInput], "prompt is empty, too long or out of vocabulary")
    vocab = served.files.vocab_size
    if (
        not (1 <= request.max_tokens <= served.settings.max_tokens_limit)
        or not (0 <= request.temperature <= 2)
        or not (0 < request.top_p <= 1)
        or not (0 <= request.min_p <= 1)
        or request.top_logprobs > 20
        or any(not 0 <= t < vocab for t in request.logit_bias)
    ):
        await context.abort(STATUS[InvalidInput], "sampling parameters out of range")
    params = received_params(request)
    if params.grammar and (why := await asyncio.to_thread(grammar_error, params.grammar, served.files.tokenizer)):
        await context.abort(STATUS[InvalidInput], f"grammar: {why}")
    index = served.prefix_index
    if index is not None:  # the caller's previous turn may still be keeping its prefix here
        await index.after(request.after[:AFTER_MAX])
    over = index.relayed(request.request_id) if index is not None else None
    try:
        # Closed here, not by the GC: ``over`` is set once the prefix is kept.
        async with contextlib.aclosing(served.placement_for(serving).tokens(prompt, params)) as tokens:
            async for token in tokens:
                if isinstance(token, Sampled):
                    top_ids, top_logprobs = zip(*token.top) if token.top else ((), ())
                    yield mesh_pb2.GenerateReply(
                        token=token, has_logprob=True, logprob=token.logprob, top_ids=top_ids, top_logprobs=top_logprobs
                    )
                else:
                    yield mesh_pb2.GenerateReply(token=token)
    except EpochPending as exc:
        await context.abort(STATUS[StagePending], str(exc))
    except PlacementLost as exc:
        await context.abort(STATUS[StageUnavailable], str(exc))
    except GenerationFault as exc:
        await context.abort(STATUS[StageFault], f"{FAULT}{exc}")
    finally:
        if over is not None:
            over.set()
