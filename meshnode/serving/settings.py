"""A served model's options as typed objects, built from :class:`meshnode.config.Settings`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshnode.config import LockstepSetting, Settings, Speculative
    from meshnode.serving.drafting import DrafterFactory


@dataclass(frozen=True)
class PlacementSettings:
    """What a generation run on this node reads."""

    prefill_step_size: int
    pipelined_prefill: bool
    max_step_ms: float
    batching: bool
    lockstep: LockstepSetting
    speculative: Speculative
    draft_max: int
    # A test harness's drafter factory replacing the options' own (None: the options').
    drafters: Callable[[DrafterFactory], DrafterFactory] | None = None

    @property
    def may_use_mtp(self) -> bool:
        """Whether speculation may draft with a model's MTP head (its memory is then planned)."""
        return self.speculative not in ("off", "prompt_lookup", "draft_model")

    @classmethod
    def of(cls, s: Settings) -> PlacementSettings:
        return cls(
            prefill_step_size=s.prefill_step_size,
            pipelined_prefill=s.pipelined_prefill,
            max_step_ms=s.max_step_ms,
            batching=s.batching,
            lockstep=s.lockstep,
            speculative=s.speculative,
            draft_max=s.draft_max,
        )


@dataclass(frozen=True)
class ServingSettings:
    """What a served model, its loading and placements read."""

    cache_dir: Path
    max_context: int
    kv_requests: int
    prompt_cache: bool
    prompt_cache_disk: int
    max_tokens_limit: int
    inject_latency_us: float
    heartbeat_interval: float
    failure_timeout: float
    failover_deadline: float
    load_timeout: float
    group_ready_timeout: float
    placement: PlacementSettings

    @classmethod
    def of(cls, s: Settings) -> ServingSettings:
        return cls(
            cache_dir=s.resolved_cache_dir(),
            max_context=s.max_context,
            kv_requests=s.kv_requests,
            prompt_cache=s.prompt_cache,
            prompt_cache_disk=s.prompt_cache_disk,
            max_tokens_limit=s.max_tokens_limit,
            inject_latency_us=s.inject_latency_us,
            heartbeat_interval=s.heartbeat_interval,
            failure_timeout=s.failure_timeout,
            failover_deadline=s.failover_deadline,
            load_timeout=s.load_timeout,
            group_ready_timeout=s.group_ready_timeout,
            placement=PlacementSettings.of(s),
        )

    def resolved_cache_dir(self) -> Path:
        """Where models are cached."""
        return self.cache_dir
