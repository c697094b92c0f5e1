"""Models loaded on demand: which model makes room for which, and when an idle one is unloaded.

Several models on one mesh (meshnode.control.lanes) may not all fit at once. The coordinator
plans them in order, each into the memory the others leave; one that does not fit then is
*unloaded* (a plan with no stages, meshnode.control.planner.plans.UNLOADED) and loaded when a
request asks for it: the request waits, the coordinator unloads the least recently used model
that no request is using, and places the wanted one in the room freed. Like Ollama's
``keep_alive``, a model idle for longer than its keep-alive is unloaded even when no other model
needs the room (0: kept until room is needed).

Every node counts the requests that came to it for each model and announces the counts in its
heartbeats (:class:`meshnode.serving.usage.Use`); the coordinator adds them up. Pure: no clock, no I/O.
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
    """The model to unload to make room: the least recently used of the idle loaded ones (a model
    never used counts from when it was loaded; ties by model id); None if every one is in use."""
    idle = [(max(use.last_used, loaded_at.get(model, 0.0)), model) for model, use in loaded.items() if use.idle]
    return min(idle)[1] if idle else None


def expired(use: Use, keep_alive: float, loaded_at: float, now: float) -> bool:
    """An idle loaded model whose keep-alive ran out (``keep_alive`` seconds; 0: never)."""
    return keep_alive > 0 and use.idle and now - max(use.last_used, loaded_at) > keep_alive


def keep_alive_of(setting: Mapping[str, float], model: str) -> float:
    """A model's keep-alive from the ``keep_alive`` setting: its own entry, else ``"*"``'s, else 0."""
    return setting.get(model, setting.get("*", 0.0))
