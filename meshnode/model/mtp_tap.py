"""The last layer's hidden states (the final norm's input), recorded for the request on each thread
that listens: an MTP head drafts from them (meshnode.serving.mtp_drafting). A pass on another thread
is not recorded.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from typing import Any

import mlx.core as mx
import mlx.nn as nn


class Captures:
    """One request's hidden states, oldest first: (B, L, D) lazy arrays, one per forward pass."""

    def __init__(self) -> None:
        self.taken: deque[mx.array] = deque()


class HiddenTap:
    """Records the input of ``model.model.norm`` (an mlx-lm llama-like model) for this thread's
    listener; the norm keeps its class's behaviour and parameters."""

    @classmethod
    def on(cls, model: nn.Module) -> HiddenTap:
        """The tap on ``model``'s final norm, installed once (each placement on a shard asks again)."""
        norm = model.model.norm
        tap = getattr(norm, "_meshnode_tap", None)
        return tap if isinstance(tap, HiddenTap) else cls(model)

    def __init__(self, model: nn.Module):
        self._local = threading.local()
        norm = model.model.norm
        object.__setattr__(norm, "_meshnode_tap", self)  # a plain attribute, not a parameter
        base = type(norm)
        tap = self

        class Tapped(base):  # type: ignore[misc, valid-type]  # the norm's own class, whichever it is
            def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
                tap.record(x)
                out: mx.array = base.__call__(self, x, *args, **kwargs)
                return out

        Tapped.__name__ = Tapped.__qualname__ = base.__name__
        norm.__class__ = Tapped

    def listen(self) -> Captures:
        """This thread's forward passes from now on, while the returned Captures lives."""
        captures = Captures()
        self._local.listener = weakref.ref(captures)
        return captures

    def record(self, hidden: mx.array) -> None:
        ref = getattr(self._local, "listener", None)
        captures = ref() if ref is not None else None
        if captures is not None:
            captures.taken.append(hidden)
