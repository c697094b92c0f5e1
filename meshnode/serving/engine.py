"""Turns a stream of token ids into the text a client sees."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from mlx_lm.tokenizer_utils import TokenizerWrapper

from meshnode.ids import ModelId
from meshnode.model.arrivals import Arrivals
from meshnode.serving.answer import AnswerShape, AnswerSplitter, Pieces, ToolCall, initial_state
from meshnode.serving.sampling import Sampled, SamplingParams

if TYPE_CHECKING:
    from meshnode.metrics import NodeMetrics


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and, if asked, the most likely alternatives."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Delta:
    """A piece of the answer; the last has ``finish_reason`` set ("stop", "length" or "tool_calls")."""

    text: str
    completion_tokens: int
    finish_reason: str | None = None
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    stop_sequence: str | None = None  # the stop string that ended the answer

    @property
    def carries(self) -> bool:
        """Whether the piece has anything for the client."""
        return bool(self.text or self.reasoning or self.tool_calls or self.logprobs)


class TokenSource(Protocol):
    def tokens(self, prompt: Sequence[int], params: SamplingParams) -> AsyncGenerator[int, None]: ...


class Engine:
    """Owns what is per-request on the serving node: detokenizer, EOS, stop strings, max_tokens, and
    a chat answer's split into content, reasoning and tool calls. Token ids come from a
    :class:`TokenSource`, so a generation moved to another placement still reads as one stream."""

    def __init__(
        self,
        model_id: ModelId,
        tokenizer: TokenizerWrapper,
        source: TokenSource,
        *,
        max_context: int,
        vocab_size: int,
        metrics: NodeMetrics | None = None,
    ):
        self.metrics = metrics
        self.arrivals: Arrivals | None = None  # this node's requests on their way to a generation
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.source = source
        self.max_context = max_context

    def arriving(self) -> contextlib.AbstractContextManager[None]:
        """Counts a request from its arrival until a generation takes it in (see Arrivals)."""
        return self.arrivals.arriving() if self.arrivals is not None else contextlib.nullcontext()

    async def stream(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        stop: Sequence[str] = (),
        shape: AnswerShape | None = None,
    ) -> AsyncGenerator[Delta, None]:
        """The answer to ``prompt`` in pieces. ``shape``: how a chat answer splits (None: all text,
        a completion that continues the prompt)."""
        tokenizer = self.tokenizer
        detokenizer = tokenizer.detokenizer
        lead = Continuation(tokenizer, prompt) if shape is None else None
        eos = tokenizer.eos_token_ids
        splitter = None
        if shape is not None:
            splitter = AnswerSplitter(tokenizer, shape, initial_state(tokenizer, prompt, shape.forced_tool))
        stops = [s for s in stop if s]
        hold = max((len(s) for s in stops), default=1) - 1
        text, emitted, count = "", 0, 0
        finish = "length"
        logprobs: list[TokenLogprob] = []

        def cut() -> tuple[str, str | None]:
            """Content safe to emit now, and the stop string that ended the output, if any."""
            nonlocal emitted
            if stops:
                window = max(0, emitted - hold)
                hits = [(i, s) for i, s in ((text.find(s, window), s) for s in stops) if i >= 0]
                if hits:
                    end, which = min(hits)
                    out, emitted = text[emitted:end], max(emitted, end)
                    return out, which
            safe = len(text) - hold if stops else len(text)
            if safe <= emitted:
                return "", None
            out, emitted = text[emitted:safe], safe
            return out, None

        def newest() -> str:
            """The detokenizer's newest text, a completion's first with the space it trimmed."""
            text = detokenizer.last_segment
            return lead.first(text, detokenizer.tokens) if lead is not None else text

        def piece(segment: str, final: bool = False) -> Delta:
            nonlocal text
            parts = splitter.feed(segment) if splitter is not None else Pieces(content=segment)
            if final and splitter is not None:
                rest = splitter.finish()
                parts = Pieces(
                    parts.content + rest.content, parts.reasoning + rest.reasoning, parts.tool_calls + rest.tool_calls
                )
            text += parts.content
            out, stopped = cut()
            if final and not stopped:
                out += text[emitted:]  # the tail held back for stop strings
            reason = "stop" if stopped else (finish if final else None)
            if reason == "stop" and splitter is not None and splitter.made_calls:
                reason = "tool_calls"
            delta = Delta(
                out,
                count,
                reason,
                reasoning=parts.reasoning,
                tool_calls=tuple(parts.tool_calls),
                logprobs=tuple(logprobs),
                stop_sequence=stopped,
            )
            logprobs.clear()
            return delta

        metrics, started, first_at, stopped_at = self.metrics, time.monotonic(), None, None
        # Closed before the last piece goes out, so the stages keep the prefix before the next turn.
        async with contextlib.aclosing(self.source.tokens(prompt, params)) as tokens:
            async for token in tokens:
                if metrics is not None:
                    if first_at is None:
                        first_at = time.monotonic()
                        metrics.first_token(first_at - started)
                    if token not in eos:
                        metrics.token()
                        if count:  # the decode rate so far
                            metrics.generation_done(count, time.monotonic() - first_at)
                if token in eos:
                    finish = "stop"
                    break
                count += 1
                if isinstance(token, Sampled):
                    logprobs.append(self._logprob(token))
                detokenizer.add_token(int(token))
                delta = piece(newest())
                if delta.finish_reason is not None:  # a stop string: the last piece
                    stopped_at = delta
                    break
                if delta.carries:
                    yield delta
                if count >= params.max_tokens:
                    break
        if stopped_at is not None:
            yield stopped_at
            return
        detokenizer.finalize()
        yield piece(newest(), final=True)

    def _logprob(self, token: Sampled) -> TokenLogprob:
        decode = self.tokenizer.decode
        return TokenLogprob(decode([int(token)]), token.logprob, tuple((decode([t]), lp) for t, lp in token.top))


class Continuation:
    """A completion's text is what follows the prompt when both are decoded together. mlx-lm's
    streaming detokenizers read an answer as the start of a text and trim its first space; this
    puts it back where decoding the answer after the prompt's last tokens keeps it."""

    CONTEXT = 16  # prompt tokens decoded before the answer

    def __init__(self, tokenizer: TokenizerWrapper, prompt: Sequence[int]):
        self.decode = tokenizer.decode
        self.context = [int(t) for t in prompt[-self.CONTEXT :]]
        self.started = False

    def first(self, segment: str, tokens: Sequence[int]) -> str:
        """``segment`` as sent; the first non-empty one with the space the detokenizer trimmed."""
        if self.started or not segment:
            return segment
        self.started = True
        before = self.decode(self.context)
        after = self.decode(self.context + [int(t) for t in tokens])
        text = after[len(before) :] if after.startswith(before) else ""
        return " " + segment if text.startswith(" " + segment) and not text.startswith(segment) else segment
