"""Token generation over a chain of stages, with mlx-lm doing the generating.

:class:`PipelineModel` looks like an mlx-lm model to ``generate_step``. Each generation has its own
thread and gives up the MLX baton while a remote stage works, so generations overlap across stages.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
from collections.abc import AsyncGenerator, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step

from meshnode.ids import RequestId
from meshnode.model.arrivals import taken_in
from meshnode.model.prefixes import prefix_key
from meshnode.model.scheduler import TokenScheduler, mlx_idle, mlx_yield, raise_if_cancelled, set_priority
from meshnode.serving.local_stage import LocalSession, LocalStage
from meshnode.serving.passes import PassPipe
from meshnode.serving.prefill import ChunkSizer, pipelined_prefill, wait_first
from meshnode.serving.promptcache import MIN_REUSE, PrefixIndex
from meshnode.serving.sampling import SamplingParams, make_request_processors, make_request_sampler, sampled
from meshnode.serving.speculative import Speculation, speculative_tokens, why_not
from meshnode.tracing import mark
from meshnode.transport.refusals import PrefixMiss
from meshnode.transport.streams import StageStream, WaitHandle

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

log = logging.getLogger(__name__)

# One request's use of one stage: its KV cache here, or a stream to the node holding it.
StageSession: TypeAlias = "LocalSession | StageStream"


class StageHandle(Protocol):
    """A stage of a placement: LocalStage or RemoteStage."""

    start: int
    end: int
    prefill_rate: float | None  # seconds per position in the last prefill (None: not timed)

    def open(self, request_id: str, resume: tuple[str, int] | None = None) -> StageSession: ...


class Lockstep(Protocol):
    """A placement's batched decode steps."""

    def decoding(self, model: PipelineModel) -> None: ...

    def others_decoding(self, model: PipelineModel) -> bool: ...

    def alone(self, model: PipelineModel) -> None: ...

    def leave(self, model: PipelineModel) -> None: ...

    def step(self, model: PipelineModel, x: mx.array) -> mx.array: ...


class _RequestState:
    """What generate_step sees as the 'prompt cache': the request's open stage sessions."""

    def __init__(self, sessions: list[StageSession]):
        self.sessions = sessions

    @property
    def state(self) -> list[mx.array]:  # generate_step evaluates cache state after prefill
        return []

    def close(self) -> None:
        for session in self.sessions:
            try:
                session.close()
            except Exception:  # closing must never mask the request's own outcome
                log.debug("closing a stage session failed", exc_info=True)


class PipelineModel:
    """An mlx-lm-callable model made of stages covering layers [0, L) in order."""

    def __init__(
        self,
        stages: Sequence[StageHandle],
        request_id: str,
        resume: tuple[str, int] | None = None,
        batcher: Lockstep | None = None,
    ):
        """``resume``: (key, positions) of a kept prefix to start from."""
        ends = [0] + [s.end for s in stages]
        if [s.start for s in stages] != ends[:-1]:
            raise ValueError(f"stages do not tile the layers: {[(s.start, s.end) for s in stages]}")
        self._stages = list(stages)
        self.request_id = request_id
        self.resume = resume
        self.state: _RequestState | None = None
        self._batcher = batcher
        self._decoding = False
        self._promised = False  # its last lone step promised the stages a lone next one
        # Whether a step may promise the next is one position too (a drafting request may not).
        self.may_promise = True

    def make_cache(self) -> list[_RequestState]:
        sessions: list[StageSession] = []
        try:
            for stage in self._stages:
                sessions.append(
                    stage.open(self.request_id, self.resume) if self.resume else stage.open(self.request_id)
                )
        except BaseException:
            _RequestState(sessions).close()
            raise
        self.state = _RequestState(sessions)
        return [self.state]

    def __call__(self, inputs: mx.array, cache: list[_RequestState]) -> mx.array:
        x = inputs
        sessions = cache[0].sessions
        # One position: decoding (or the last prompt token).
        single = inputs.shape[1] == 1
        promise = single and self.may_promise
        batcher = self._batcher
        if single and batcher is not None:
            if not self._decoding:
                self._decoding = True
                batcher.decoding(self)
            if batcher.others_decoding(self):
                if not self._promised:  # another request decodes too: step with it
                    return batcher.step(self, inputs)
                promise = False  # one step on its own, promising nothing, then batched
            else:
                batcher.alone(self)
        self._promised = promise
        i = 0
        while i < len(sessions):
            session = sessions[i]
            after = sessions[i + 1] if i + 1 < len(sessions) else None
            if single and session.remote:
                ticket = session.submit(x, next_single=promise)
                if after is not None and not after.remote and after.prepare():
                    # The local stage after it builds its step while the remote one computes.
                    session.finish(ticket, into=after.placeholder)
                    mark("head.copied")
                    x = after.run_prepared()
                    mark("head.built")
                    i += 2
                    continue
                x = session.finish(ticket)
            else:
                x = session.forward(x)
            i += 1
        return x

    @property
    def sessions(self) -> list[StageSession]:
        assert self.state is not None, "make_cache() opened them"
        return self.state.sessions

    def passes(self, held: int) -> PassPipe:
        """Speculative passes through this request's stages, which hold ``held`` positions now."""
        return PassPipe(self.sessions, held, wait=_wait_idle)

    def alone(self) -> None:
        """The next step goes through the stages on its own and promises nothing."""
        self._promised = False
        if self._batcher is not None:
            if not self._decoding:
                self._decoding = True
                self._batcher.decoding(self)
            self._batcher.alone(self)  # no batched round waits for it

    def others_decoding(self) -> bool:
        """Whether other requests of this placement decode now (their steps batch)."""
        return self._batcher is not None and self._batcher.others_decoding(self)

    def rewind_limit(self) -> tuple[int | None, str]:
        """How far a request's caches can be cut back, judged by the head's own stage."""
        if isinstance(last := self._stages[-1], LocalStage):
            return last.shard.rewind_limit
        return 0, "the last stage cannot say how far its cache can be cut back"

    def prefill(self, tokens: Sequence[int], options: PrefillOptions, busy: Callable[[], bool] | None = None) -> int:
        """Run ``tokens`` through every stage, chunks pipelined; the number of chunks."""
        sessions = self.sessions
        seed = [stage.prefill_rate for stage in self._stages]
        sizer = ChunkSizer(len(sessions), max_step=options.max_step, max_chunk=options.max_chunk, seed=seed, busy=busy)
        try:
            chunks = pipelined_prefill(
                sessions, tokens, sizer, wait=_wait_idle, between_steps=_between_steps, on_cut=set_priority
            )
        finally:
            set_priority(0)  # decoding from here: a step at a time
            for stage, rate in zip(self._stages, sizer.per_position):
                if rate:
                    stage.prefill_rate = rate
        log.debug(
            "%s: prefilled %d tokens in %d chunks through %d stages",
            self.request_id,
            len(tokens),
            chunks,
            len(sessions),
        )
        return chunks

    def keep(self, key: str, positions: int) -> bool:
        """Ask every stage to keep this request's first ``positions`` of KV; whether all did."""
        if self.state is None:
            return False
        return all([session.keep(key, positions) is not False for session in self.state.sessions])

    def close(self) -> None:
        if self._batcher is not None and self._decoding:
            self._batcher.leave(self)
        if self.state is not None:
            self.state.close()


@dataclass(frozen=True)
class PrefillOptions:
    """Pipelined prefill: on, and the longest a stage's step may run."""

    pipelined: bool = True
    max_step: float = 0.5  # seconds
    max_chunk: int = 512  # positions in one message (the stages refuse more)


def generate_tokens(
    model: PipelineModel,
    prompt: Sequence[int],
    params: SamplingParams,
    *,
    prefill_step_size: int = 512,
    prefill: PrefillOptions | None = None,
    busy: Callable[[], bool] | None = None,
    keep: PrefixIndex | None = None,
    ended: threading.Event | None = None,
    tokenizer: TokenizerWrapper | None = None,
    speculation: Speculation | None = None,
) -> Generator[int, None, None]:
    """Token ids from mlx-lm's generate_step over the pipeline; closes the stages at the end.

    Pipelined prefill fills the caches with all but the last prompt token. ``keep``: where the prompt
    cache records what the stages kept; ``ended`` is set once that is done.
    """
    sampler = make_request_sampler(params)
    produced: list[int] = []
    finished = False  # to the end, or stopped by its consumer
    try:
        ids = list(prompt)
        cache = None
        skip = model.resume[1] if model.resume else 0  # positions every stage resumes
        pipelined = prefill if prefill is not None and prefill.pipelined else None
        drafter = (
            speculation.drafter(prompt)
            if speculation is not None and not why_not(params, model.rewind_limit())
            else None
        )
        if skip or (pipelined is not None and len(ids) > 1) or drafter is not None:
            cache = model.make_cache()
            ids = ids[skip:]
            if pipelined is not None and len(ids) > 1:
                model.prefill(ids[:-1], pipelined, busy)
                ids = ids[-1:]
            if speculation is not None and drafter is not None:  # (a drafter comes from speculation)
                for i in range(0, len(ids) - 1, prefill_step_size):  # not pipelined: chunk by chunk, as mlx-lm
                    raise_if_cancelled()
                    mx.eval(
                        model(mx.array([ids[i : min(i + prefill_step_size, len(ids) - 1)]], dtype=mx.uint32), cache)
                    )
                for confirmed in speculative_tokens(
                    model,
                    cache,
                    list(prompt),
                    params,
                    speculation,
                    drafter,
                    max_tokens=params.max_tokens,
                    others=model.others_decoding,
                ):
                    produced.append(int(confirmed))
                    yield confirmed
                finished = True
                return
        top = params.top_logprobs
        for token, logprobs in generate_step(
            mx.array(ids, dtype=mx.uint32),
            cast(nn.Module, model),  # generate_step only calls it and its make_cache
            max_tokens=params.max_tokens,
            sampler=sampler,
            logits_processors=make_request_processors(params, prompt[: len(prompt) - len(ids)], tokenizer),
            prompt_cache=cache,
            prefill_step_size=prefill_step_size,
        ):
            produced.append(int(token))
            mark("head.token")
            yield sampled(int(token), logprobs, top) if top >= 0 else int(token)
        finished = True
    except GeneratorExit:
        finished = True
        raise
    finally:
        try:
            # Every token but the last went through every stage: keep that for the next turn.
            fed = list(prompt) + produced[:-1]
            if finished and keep is not None and produced and len(fed) >= MIN_REUSE:
                key = prefix_key(fed)
                if model.keep(key, len(fed)):
                    keep.add(fed, key)
        finally:
            model.close()
            if ended is not None:
                ended.set()


# A prefill looks between its steps whether its client has gone, so a long prompt stops mid-way.
def _wait_idle(handles: Sequence[WaitHandle], timeout: float) -> None:
    raise_if_cancelled()
    with mlx_idle():
        wait_first(handles, timeout)


def _between_steps() -> None:
    raise_if_cancelled()
    mlx_yield()


class Ending(Generator[int, None, None]):
    """A generation's tokens whose ``ended`` is set once closed, even before their first step."""

    def __init__(self, tokens: Generator[int, None, None], ended: threading.Event):
        self._tokens, self._ended = tokens, ended

    def __next__(self) -> int:
        return next(self._tokens)

    def send(self, value: None) -> int:
        return self._tokens.send(value)

    def throw(self, *exc: Any) -> int:  # as the tokens' own (their signature's overloads)
        return self._tokens.throw(*exc)

    def close(self) -> None:
        try:
            self._tokens.close()
        finally:
            self._ended.set()


_ids = itertools.count(1)


def new_request_id(prefix: str = "req") -> RequestId:
    return RequestId(f"{prefix}-{secrets.token_hex(6)}-{next(_ids)}")


class PipelineSource:
    """Token ids from a pipeline of stages run by this node's scheduler."""

    def __init__(
        self,
        scheduler: TokenScheduler,
        stages: Callable[[], Sequence[StageHandle]],
        *,
        prefill_step_size: int = 512,
        prefill: PrefillOptions | None = None,
        prefixes: PrefixIndex | None = None,
        tokenizer: TokenizerWrapper | None = None,
        batcher: Lockstep | None = None,
        speculation: Speculation | None = None,
    ):
        """``prefixes``, ``batcher``, ``speculation``: None when off."""
        self._prefixes, self._tokenizer, self._batcher = prefixes, tokenizer, batcher
        self.speculation = speculation
        self._scheduler = scheduler
        self._stages = stages
        self._prefill_step_size = prefill_step_size
        self._prefill = prefill

    async def tokens(self, prompt: Sequence[int], params: SamplingParams) -> AsyncGenerator[int, None]:
        taken_in()  # generated by this pipeline: no batch loop waits for it
        index = self._prefixes
        # A previous turn may still be keeping the prefix this one resumes.
        resume = await index.settled_match(prompt) if index is not None else None
        scheduler = self._scheduler
        missed = False
        while True:
            model = PipelineModel(self._stages(), new_request_id(), resume, self._batcher)
            ended = threading.Event()
            job = scheduler.submit(
                Ending(
                    generate_tokens(
                        model,
                        prompt,
                        params,
                        prefill_step_size=self._prefill_step_size,
                        prefill=self._prefill,
                        busy=scheduler.others_waiting,
                        keep=index,
                        ended=ended,
                        tokenizer=self._tokenizer,
                        speculation=self.speculation,
                    ),
                    ended,
                ),
                work=len(prompt) - (resume[1] if resume else 0),
            )
            produced: list[int] = []
            try:
                async for token in job:
                    produced.append(int(token))
                    yield token
                return
            except PrefixMiss as miss:  # another kept prefix, once, then the whole prompt
                if produced or resume is None or index is None:  # (a resume comes from the index)
                    raise
                index.forget(resume[0], str(miss))
                resume = index.match(prompt) if not missed else None
                missed = True
                log.info(
                    "prompt cache: %s; %s",
                    miss,
                    f"resuming from {resume[0]} instead" if resume else f"prefilling all {len(prompt)} tokens",
                )
            finally:
                # Closed by the API, the generation may still be keeping its prefix.
                job.cancelled.set()
                if index is not None:
                    await index.until_kept(ended, [*prompt, *produced])
