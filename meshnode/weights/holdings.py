"""What models a node holds on disk, in full or in part, as announced in heartbeats: stages are
placed where their layers are. Peer input is checked."""

from __future__ import annotations

from collections.abc import Sequence

from meshnode.proto import mesh_pb2

MAX_MODELS = 16
MAX_RANGES = 64
MAX_LAYERS = 100_000
MAX_ID = 256

Holding = tuple[str, bool, tuple[tuple[int, int], ...]]


def parse_range(text: str) -> tuple[int, int]:
    a, sep, b = text.partition("-")
    if not sep or not a.isdigit() or not b.isdigit():
        raise ValueError(f"bad layer range {text[:40]!r}")
    start, end = int(a), int(b)
    if not 0 <= start < end <= MAX_LAYERS:
        raise ValueError(f"bad layer range {text[:40]!r}")
    return start, end


def holdings_to_pb(holdings: tuple[Holding, ...]) -> list[mesh_pb2.ModelHolding]:
    return [mesh_pb2.ModelHolding(model_id=m, complete=c, layers=[f"{a}-{b}" for a, b in r]) for m, c, r in holdings]


def holdings_from_pb(items: Sequence[mesh_pb2.ModelHolding]) -> tuple[Holding, ...]:
    """A peer's holdings; raises ValueError on anything malformed or oversized."""
    if len(items) > MAX_MODELS:
        raise ValueError(f"{len(items)} model holdings announced (at most {MAX_MODELS})")
    out = []
    for h in items:
        if not h.model_id or len(h.model_id) > MAX_ID or len(h.layers) > MAX_RANGES:
            raise ValueError("malformed model holding")
        out.append((h.model_id, bool(h.complete), tuple(parse_range(r) for r in h.layers)))
    return tuple(out)


def holdings_to_json(holdings: tuple[Holding, ...]) -> list[dict[str, object]]:
    return [{"model": m, "complete": c, "layers": [[a, b] for a, b in r]} for m, c, r in holdings]


def layers_of(holdings: tuple[Holding, ...], model_id: str) -> frozenset[int]:
    """Indices of the layers of ``model_id`` these holdings cover."""
    return frozenset(i for m, _, r in holdings if m == model_id for a, b in r for i in range(a, b))
