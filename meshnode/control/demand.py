"""Models loaded on demand: which idle model makes room, and when an idle one is unloaded
(Ollama's ``keep_alive``; 0: only for room). Pure."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from meshnode.serving.usage import Use


def total(uses: Iterable[Use]) -> Use:
    out = Use()
    for u in uses:
        out = Use(max(out.last_used, u.last_used), out.active + u.active, out.waiting + u.waiting)
    return out


def victim(loaded: Mapping[str, Use], loaded_at: Mapping[str, float]) -> str | None:
    """The least recently used idle model (an unused one from its load); None if all are busy."""
    idle = [(max(use.last_used, loaded_at.get(model, 0.0)), model) for model, use in loaded.items() if use.idle]
    return min(idle)[1] if idle else None


def expired(use: Use, keep_alive: float, loaded_at: float, now: float) -> bool:
    """Whether an idle model's keep-alive (seconds; 0: never) ran out."""
    return keep_alive > 0 and use.idle and now - max(use.last_used, loaded_at) > keep_alive


def keep_alive_of(setting: Mapping[str, float], model: str) -> float:
    """A model's own keep-alive, else ``"*"``'s, else 0."""
    return setting.get(model, setting.get("*", 0.0))
