"""The shard a stage runs, whichever process runs its layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import mlx.core as mx

    from meshnode.model.wire import Placeholder


@dataclass(frozen=True)
class ShardSpec:
    start: int
    end: int
    num_layers: int

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.num_layers


class LayerShard(Protocol):
    """What a stage runs: layers [start, end) of a model, here (:class:`Shard`) or in a tensor
    group's workers (:class:`meshnode.model.tensor.TensorShard`)."""

    spec: ShardSpec
    dtype: mx.Dtype  # of the activations it sends on
    hidden_size: int
    nbytes: int  # its weights' bytes on this node
    group_size: int  # ranks that split each layer (1: none)

    @property
    def start(self) -> int: ...

    @property
    def end(self) -> int: ...

    @property
    def rewind_limit(self) -> tuple[int | None, str]:
        """How far a request's cache can be cut back: (None, "") always, (n, "") under n positions, (0, why) never."""
        ...

    @property
    def keeps_prefixes(self) -> bool:
        """Whether a request's cache can be kept as a prefix for later requests."""
        ...

    def make_cache(self, owned: list[Any] | None = None) -> Any:
        """A fresh per-request cache; ``owned``: its own layers' caches, read back from disk."""
        ...

    def owned(self, cache: Any) -> list[Any] | None:
        """The caches of its own layers, in this process (None: its workers hold them)."""
        ...

    def disk_template(self) -> list[Any] | None:
        """Its own layers' cache templates, to read kept caches back from disk into (None: not kept on disk)."""
        ...

    def forward(self, x: mx.array, cache: Any, all_positions: bool = ...) -> mx.array: ...

    def build_ahead(self, cache: Any) -> tuple[Placeholder, mx.array] | None:
        """The next one-position step, built on a Placeholder before its input exists (None: unsupported)."""
        ...

    def rewind(self, cache: Any, positions: int) -> None:
        """Drops the last ``positions`` of ``cache``; raises :class:`meshnode.model.rewind.CannotRewind`."""
        ...
