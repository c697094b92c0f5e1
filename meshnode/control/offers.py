"""Models offered or withdrawn at run time, kept in the state folder so a restart offers the same."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from meshnode.durable import write_atomically

log = logging.getLogger(__name__)

FILE = "models.json"


@dataclass(frozen=True)
class Offers:
    added: tuple[str, ...] = ()  # folders or ids beside the configured ones
    withdrawn: tuple[str, ...] = ()  # model ids

    def offered(self, configured: tuple[str | None, ...]) -> tuple[str | None, ...]:
        """The configured models, then the added ones."""
        return tuple(dict.fromkeys((*configured, *self.added)))

    def add(self, spec: str, model_id: str) -> Offers:
        added = self.added if spec in self.added else (*self.added, spec)
        return Offers(added, tuple(m for m in self.withdrawn if m != model_id))

    def remove(self, model_id: str, spec: str | None = None) -> Offers:
        added = tuple(a for a in self.added if a not in (model_id, spec))
        return Offers(added, self.withdrawn if model_id in self.withdrawn else (*self.withdrawn, model_id))


def read_offers(state_dir: Path) -> Offers:
    path = state_dir / FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return Offers(tuple(str(m) for m in data.get("added", ())), tuple(str(m) for m in data.get("withdrawn", ())))
    except FileNotFoundError:
        return Offers()
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        log.warning("ignoring %s (unreadable: %s): offering the configured models", path, exc)
        return Offers()


def write_offers(state_dir: Path, offers: Offers) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(
        state_dir / FILE,
        json.dumps({"added": list(offers.added), "withdrawn": list(offers.withdrawn)}, indent=2) + "\n",
    )
