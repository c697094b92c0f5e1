"""Structured output: ``response_format`` as an llguidance grammar masking tokens that cannot continue
a valid answer. It travels as text, so a remote head constrains exactly what was checked."""

from __future__ import annotations

import json
import threading
import weakref
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import numpy as np

from meshnode.errors import MeshnodeError

if TYPE_CHECKING:
    from llguidance import LLTokenizer
    from mlx_lm.tokenizer_utils import TokenizerWrapper

# Any JSON object, as OpenAI's json_object asks for.
ANY_OBJECT: dict[str, Any] = {"type": "object"}

_lock = threading.Lock()
_tokenizers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def grammar_from_schema(schema: dict[str, Any]) -> str:
    """llguidance's grammar text for answers that are JSON documents valid under ``schema``."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})


def grammar_error(grammar: str, tokenizer: TokenizerWrapper) -> str:
    """Why ``grammar`` cannot constrain this tokenizer's answers ("" if it can)."""
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, _lltokenizer(tokenizer))
    return messages[0] if is_error else ""


def _lltokenizer(tokenizer: TokenizerWrapper) -> LLTokenizer:
    """llguidance's view of an mlx-lm TokenizerWrapper's tokenizer (cached per tokenizer)."""
    from llguidance.hf import from_tokenizer

    hf: Any = getattr(tokenizer, "_tokenizer", tokenizer)  # the Hugging Face tokenizer it wraps
    with _lock:
        built = _tokenizers.get(hf)
        if built is None:
            built = from_tokenizer(hf, eos_token=sorted(tokenizer.eos_token_ids))
            _tokenizers[hf] = built
        return built


class GrammarProcessor:
    """An mlx-lm logits processor letting through only tokens that keep the answer valid."""

    def __init__(self, grammar: str, tokenizer: TokenizerWrapper):
        from llguidance import LLMatcher

        self._matcher = LLMatcher(_lltokenizer(tokenizer), grammar, log_level=0)
        self._seen: int | None = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        matcher = self._matcher
        if self._seen is None:
            self._seen = tokens.shape[0]
        elif tokens.shape[0] > self._seen:
            new, self._seen = cast(list[int], tokens[self._seen :].tolist()), tokens.shape[0]
            for token in new:
                if matcher.is_stopped():  # only EOS may follow; generate_step runs a step past it,
                    break  # which the engine throws away
                matcher.consume_token(token)
        if matcher.is_error():
            raise GrammarError(f"structured output: {matcher.get_error()}")
        allowed = np.frombuffer(matcher.compute_logit_bias(), dtype=np.uint8)
        width = logits.shape[-1]
        mask = np.zeros(width, dtype=bool)
        n = min(width, allowed.shape[0])
        mask[:n] = allowed[:n] > 0
        return mx.where(mx.array(mask), logits, mx.array(-float("inf"), dtype=logits.dtype))


class GrammarError(MeshnodeError, RuntimeError):
    """The answer left its grammar."""
