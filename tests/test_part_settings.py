"""Each part's typed settings (meshnode/control/settings.py, meshnode/serving/settings.py) carry
the node's options of the same names, as Settings holds them."""

from __future__ import annotations

import dataclasses

from meshnode.config import Settings
from meshnode.control.settings import ControlSettings, PeerSettings, PlanSettings
from meshnode.serving.settings import PlacementSettings, ServingSettings

# every option these parts read, set away from its default so that a swapped field shows
SETTINGS = Settings(
    heartbeat_interval=0.7,
    failure_timeout=3.5,
    keep_alive={"*": 12.0, "m": 3.0},
    peers=("10.0.0.2:8471",),
    mdns=False,
    authenticate=False,
    stall_timeout=61.0,
    link_probe_interval=29.0,
    strategy="pipeline",
    rebalance_dwell=6.0,
    max_context=2048,
    kv_requests=3,
    kv_bits=8,
    prefill_step_size=256,
    pipelined_prefill=False,
    max_step_ms=250.0,
    batching=False,
    lockstep=True,
    speculative="prompt_lookup",
    draft_max=5,
    prompt_cache=False,
    max_tokens_limit=1000,
    inject_latency_us=50.0,
    failover_deadline=31.0,
    load_timeout=601.0,
    group_ready_timeout=301.0,
    cache_dir="/tmp/meshnode-cache-test",
)


OPTIONS = {f.name for f in dataclasses.fields(Settings)}


def _same_names(part) -> None:
    """Every field named as an option holds that option's value; the others (a part's nested
    settings, a resolved path, what a test harness injects) are not options."""
    for f in dataclasses.fields(part):
        if f.name in OPTIONS and f.name != "cache_dir":
            assert getattr(part, f.name) == getattr(SETTINGS, f.name), f.name


def test_the_control_planes_settings_are_the_options_of_those_names():
    for cls in (ControlSettings, PeerSettings, PlanSettings):
        _same_names(cls.of(SETTINGS))


def test_the_served_models_settings_are_the_options_of_those_names():
    serving = ServingSettings.of(SETTINGS)
    _same_names(serving)
    _same_names(serving.placement)
    assert serving.placement == PlacementSettings.of(SETTINGS)
    assert serving.cache_dir == serving.resolved_cache_dir() == SETTINGS.resolved_cache_dir()
