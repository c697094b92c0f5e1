"""Speculative decoding across the pipeline: a drafter's guesses checked by every stage in one pass.

The last token and k guesses (meshnode.serving.drafting) go through the stages as one step; the head
keeps the confirmed guesses and the model's next token, and the stages drop the rest from their KV
cache (meshnode.model.rewind). Each token is drawn as one-at-a-time decoding would draw it, and a guess
is kept only when equal, so greedy and seeded answers do not change and unseeded sampling keeps its
distribution. How many to guess, and whether to fill the pipeline: meshnode.serving.draft_length.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import mlx.core as mx

from meshnode.model.shard import any_thread_stream
from meshnode.serving.draft_length import DraftLength, PassCosts
from meshnode.serving.drafting import Drafter
from meshnode.serving.sampling import SamplingParams, make_indexed_sampler, sampled
from meshnode.tracing import mark

if TYPE_CHECKING:
    from meshnode.serving.passes import PassPipe


@dataclass
class Speculation:
    """What a placement gives its requests to speculate with."""

    # A request's drafter, from its tokens so far (None: no speculation).
    drafter: Callable[[Sequence[int]], Drafter | None]
    k_max: int  # the most guesses in one pass (the draft_max setting)
    costs: PassCosts = field(default_factory=PassCosts)
    # Told of every pass that checked guesses: (guessed, confirmed, yielded, passes cancelled).
    on_pass: Callable[[int, int, int, int], None] | None = None
    # Told after every pass and at the request's end: (PassCosts.ratio, filled share or None).
    on_costs: Callable[[float, float | None], None] | None = None
    depth: int | None = None  # passes in flight at once (None: meshnode.serving.speculative.pipe_depth)


def why_not(params: SamplingParams, limit: tuple[int | None, str]) -> str:
    """Why a request cannot speculate ('' when it can)."""
    if params.processed:
        return "logits processors (penalties, a bias, a grammar) see one token at a time"
    if limit[0] == 0:
        return limit[1] or "the cache cannot be cut back"
    return ""


Cache = TypeVar("Cache", contravariant=True)


class Session(Protocol):
    @property
    def remote(self) -> bool:
        """Whether the stage runs on another node."""
        ...


class PassModel(Protocol[Cache]):
    """A request's stages as its passes drive them (meshnode.serving.generation.PipelineModel)."""

    may_promise: bool  # the next step may be promised plain to the stages

    @property
    def sessions(self) -> Sequence[Session]: ...

    def __call__(self, inputs: mx.array, cache: Cache) -> mx.array: ...

    def passes(self, held: int) -> PassPipe: ...

    def alone(self) -> None: ...

    def rewind_limit(self) -> tuple[int | None, str]: ...


def speculative_tokens(
    model: PassModel[Cache],
    cache: Cache,
    history: list[int],
    params: SamplingParams,
    spec: Speculation,
    drafter: Drafter,
    *,
    max_tokens: int,
    others: Callable[[], bool] = lambda: False,
) -> Iterator[int]:
    """Token ids (or Sampled) of a request whose stages hold all of ``history`` but the last, with up
    to ``depth`` passes in flight (:class:`~meshnode.serving.passes.PassPipe`); ``others()``: other
    requests decode on the placement now (steps stay plain to batch)."""
    sample = make_indexed_sampler(params)
    greedy, top = params.temperature == 0, params.top_logprobs
    stages = len(model.sessions)
    depth = spec.depth if spec.depth is not None else pipe_depth(model.sessions)
    depth = max(1, drafter.fixed_depth or depth)
    length = DraftLength(spec.costs, spec.k_max, fills=depth > 1, stages=stages)
    free = drafter.free

    def ask_again() -> None:
        """In a dry pause, a free drafter's guess ends the pause."""
        if free and length.dry_paused and drafter.propose(1):
            length.found()

    fixed = drafter.fixed_k
    window = model.rewind_limit()[0]  # a sliding window: guesses only while the cut stays inside it
    held = len(history) - 1  # confirmed positions in the stages' caches
    local = not any(s.remote for s in model.sessions)
    pipe = model.passes(held)
    y, n = history[-1], 0
    # Yielded once the next passes are out, so the stages compute while these stream.
    drawn: list[int] = []
    last_out = None  # when the last pass came out
    promised = False  # the last step promised the stages that this one is plain
    try:
        while n < max_tokens:
            room = max_tokens - n  # positions that may still yield a token
            if window is not None:
                room = min(room, window - held - 1)
            k = 0 if others() or promised else min(length.choose() if fixed is None else fixed, room - 1)
            dry = False  # the drafter found nothing for this position (``length`` told once)
            if not pipe:
                drafts = drafter.propose(k) if k > 0 else []
                if k > 0 and not drafts:
                    dry = True
                    length.dry()
                elif promised and free:  # a promised plain step: would the drafter have found anything?
                    dry = not drafter.propose(1)
                fill = not promised and depth > 1 and not others() and (fixed is not None or length.fill_ok(0))
                promised = False
                if not drafts and not fill and not pipe.cut_pending:  # a plain step (it may batch)
                    yield from drawn
                    drawn = []
                    if local and length.paused() and not others():
                        # A pause: steps built ahead (as generate_step) until its last or others decode.
                        last = y
                        for y, logprobs in _plain_run(
                            model,
                            cache,
                            last,
                            min(length.plain_left, max_tokens - n),
                            greedy,
                            sample,
                            params.offset + n,
                            lambda: others() or length.plain_left <= 1,
                        ):
                            length.observe(0, 0)
                            held += 1
                            n += 1
                            drafter.extend([y])
                            ask_again()
                            yield sampled(y, logprobs[0], top) if top >= 0 else y
                        continue
                    # After a free drafter's miss the next is likely dry too: promise it plain.
                    model.may_promise = promised = length.paused() or (dry and free)
                    started = time.perf_counter()
                    logits = model(mx.array([[y]], dtype=mx.uint32), cache)[0]
                    out, logprobs = _draws(logits, [], greedy, sample, params.offset + n)
                    spec.costs.observe(1, time.perf_counter() - started)
                    length.observe(0, 0)
                    held += 1
                    y = out[-1]
                    yield sampled(y, logprobs[0], top) if top >= 0 else y
                    n += 1
                    drafter.extend(out)
                    ask_again()  # a step promised now stays plain: found() leaves one
                    continue
                model.alone()
                pipe.send([y, *drafts])
            # Fill: guesses behind the passes in flight, while each is likely kept.
            while len(pipe) < depth and not others():
                ahead = pipe.in_flight()[1:]  # guesses in flight (the first token is confirmed)
                size = 1 + max(k, 0)
                if len(ahead) + 1 + size > room or not (fixed is not None or length.fill_ok(len(ahead), len(pipe))):
                    break
                guesses = drafter.propose(len(ahead) + size)
                if guesses[: len(ahead)] != ahead or len(guesses) <= len(ahead):
                    if not ahead and not guesses and not dry:
                        length.dry()
                    break  # the drafter has nothing more (or changed its mind)
                model.alone()
                pipe.send(guesses[len(ahead) :])
            yield from drawn
            drawn = []
            mark("spec.wait")
            p, logits = pipe.result()
            behind = pipe.in_flight()[:1]
            checks = p.tokens[1:] + behind  # the guesses this pass's logits check
            out, logprobs = _draws(logits, checks, greedy, sample, params.offset + n)
            mark("spec.drawn")
            came = time.perf_counter()  # after the draws: local logits are computed lazily
            if not p.alone and last_out is not None and p.sent < last_out:  # in flight behind the last one
                spec.costs.observe_filled(len(p.tokens), came - last_out)
            last_out = came
            # out stops at the first draw that differs from its check
            accepted = next((j for j, (a, b) in enumerate(zip(out, checks)) if a != b), min(len(out), len(checks)))
            if p.alone:
                spec.costs.observe(len(p.tokens), came - p.sent)
            if spec.on_costs is not None:  # told as they change: the answer may reach its client first
                spec.on_costs(spec.costs.ratio(), spec.costs.measured_share)
            length.observe(len(checks), accepted)
            held = p.start + len(out)
            cancelled = 0
            if accepted < len(checks):
                cancelled = len(pipe)
                pipe.cancel(held)
            if checks and spec.on_pass is not None:
                spec.on_pass(len(checks), accepted, len(out), cancelled)
            y = out[-1]
            out = out[: max_tokens - n]
            drawn = [sampled(token, logprobs[j], top) if top >= 0 else token for j, token in enumerate(out)]
            n += len(out)
            drafter.extend(out)
        yield from drawn
    finally:
        if len(pipe):  # the consumer stopped early: nothing waits for the passes in flight
            pipe.cancel(held)
        if spec.on_costs is not None:
            spec.on_costs(spec.costs.ratio(), spec.costs.measured_share)


def _draws(
    logits: mx.array, checks: list[int], greedy: bool, sample: Callable[[mx.array, int], Any], offset: int
) -> tuple[list[int], mx.array]:
    """The model's tokens at a pass's positions, drawn as one-at-a-time decoding would (``offset + j``
    at j) up to the first that differs from ``checks[j]``, and the log probabilities. Greedy takes
    their argmax, as mlx-lm does: in bfloat16 the raw logits' can differ."""
    out: list[int] = []
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if greedy:
        picks = cast(list[int], mx.argmax(logprobs, axis=-1).tolist())
        for j, pick in enumerate(picks):
            out.append(pick)
            if j >= len(checks) or pick != checks[j]:
                break
        return out, logprobs
    for j in range(logits.shape[0]):
        # (1, vocab), as generate_step samples: MLX draws differently from a (vocab,) row
        out.append(sample(logprobs[j : j + 1], offset + j).item())
        if j >= len(checks) or out[-1] != checks[j]:
            break
    return out, logprobs


def _plain_run(
    model: PassModel[Cache],
    cache: Cache,
    y: int,
    steps: int,
    greedy: bool,
    sample: Callable[[mx.array, int], mx.array],
    offset: int,
    stop: Callable[[], bool],
) -> Iterator[tuple[int, mx.array]]:
    """Up to ``steps`` plain steps from ``y`` on all-local stages, each built while the one before
    computes (as mlx-lm's ``generate_step``); yields (token, log probabilities). Builds no further
    once ``stop()``."""

    def step(token: mx.array, index: int) -> tuple[mx.array, mx.array]:
        logits = model(token.reshape(1, 1), cache)[0]
        with mx.stream(any_thread_stream()):  # the shards' stream: the draw is built where they are
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return (mx.argmax(logprobs, axis=-1) if greedy else sample(logprobs, index)), logprobs

    if steps <= 0:
        return
    current = step(mx.array([y], dtype=mx.uint32), offset)
    mx.async_eval(*current)
    for i in range(steps):
        after = None
        if i + 1 < steps and not stop():
            after = step(current[0], offset + i + 1)
            mx.async_eval(*after)
        yield cast(int, current[0].item()), current[1]
        if after is None:
            return
        current = after


def pipe_depth(sessions: Sequence[Session]) -> int:
    """Passes in flight: one per stage plus one waiting at the first, so it never idles for a hop;
    one where all stages are local (they share this thread)."""
    return len(sessions) + 1 if any(s.remote for s in sessions) else 1
