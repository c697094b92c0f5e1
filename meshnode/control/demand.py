"""Models loaded on demand: which model makes room for which, and when an idle one is unloaded.

A mesh's models (meshnode.control.lanes) may not all fit at once. A model that does not fit is
*unloaded* (planner.plans.UNLOADED) until a request asks for it; the coordinator then unloads the
least recently used idle model to make room. As with Ollama's ``keep_alive``, a model idle past its
keep-alive is unloaded anyway (0: only when room is needed). Nodes announce their request counts
in heartbeats (:class:`meshnode.serving.usage.Use`); the coordinator adds them up. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from meshnode.serving.usage import Use


def total(uses: Iterable[Use]) -> Use:
    out = Use()
    for u in uses:
        out = Use(max(out.last_used, u.last_used), out.active + u.active, out.waiting + u.waiting)
    return out


def victim(loaded: Mapping[str, Use], loaded_at: Mapping[str, float]) -> str | None:
    """The least recently used idle loaded model (unused ones count from their load); None if all are busy."""
    idle = [(max(use.last_used, loaded_at.get(model, 0.0)), model) for model, use in loaded.items() if use.idle]
    return min(idle)[1] if idle else None


def expired(use: Use, keep_alive: float, loaded_at: float, now: float) -> bool:
    """An idle loaded model whose keep-alive ran out (``keep_alive`` seconds; 0: never)."""
    return keep_alive > 0 and use.idle and now - max(use.last_used, loaded_at) > keep_alive


def keep_alive_of(setting: Mapping[str, float], model: str) -> float:
    """A model's keep-alive from the ``keep_alive`` setting: its own entry, else ``"*"``'s, else 0."""
    return setting.get(model, setting.get("*", 0.0))
