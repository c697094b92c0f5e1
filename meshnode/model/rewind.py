"""Cutting a request's KV cache back after rejected drafts: a ``KVCache`` always, a
``RotatingKVCache`` until it wraps, a recurrent state never (:func:`rewind_limit`)."""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import RotatingKVCache, can_trim_prompt_cache, trim_prompt_cache

from meshnode.errors import MeshnodeError
from meshnode.model.prefixes import distinct


class CannotRewind(MeshnodeError, RuntimeError):
    """The cache cannot be cut back (a wrapped sliding window, a recurrent state)."""


def rewind_limit(template: list[Any]) -> tuple[int | None, str]:
    """(None, "") always; (n, "") while under n positions; (0, why) never."""
    limit = None
    for cache in distinct(template):
        for c in getattr(cache, "caches", None) or (cache,):  # a CacheList holds several
            if isinstance(c, RotatingKVCache):
                limit = c.max_size if limit is None else min(limit, c.max_size)
            elif not c.is_trimmable():
                return 0, f"its {type(c).__name__} (a recurrent state) cannot be cut back"
    return limit, ""


def rewind_owned(caches: list[Any], positions: int) -> None:
    """Drops the last ``positions`` of a shard's own layers' caches."""
    owned = distinct(caches)
    if not can_trim_prompt_cache(owned):
        kinds = sorted({type(c).__name__ for c in owned if not c.is_trimmable()})
        raise CannotRewind(f"the cache cannot be cut back ({', '.join(kinds)})")
    trim_prompt_cache(owned, positions)
