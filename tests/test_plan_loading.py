"""Loading this node's part of plans that follow each other quickly (meshnode.serving.loading, on one
node's real ServedModel with a real model on its disk; no mesh: the plans name only this node)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from meshnode.config import Settings
from meshnode.metrics import NodeMetrics, Progress
from meshnode.model.build import build_model
from meshnode.model.scheduler import TokenScheduler
from meshnode.planner.plans import Plan, Stage
from meshnode.serving.served import ServedModel
from meshnode.serving.settings import ServingSettings
from tests.helpers import LoneMesh

pytestmark = pytest.mark.timeout(120)


async def _served(tmp_path, model) -> ServedModel:
    settings = Settings(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache", model=str(model))

    async def on_ready():
        return None

    served = ServedModel(
        ServingSettings.of(settings),
        "me",
        scheduler=TokenScheduler(),
        metrics=NodeMetrics(),
        progress=Progress(),
        mesh=LoneMesh(),
        auth=None,
        group_secret=b"",
        event=lambda *a, **k: None,
        on_ready=on_ready,
        model=str(model),
    )
    await served.load({})
    return served


def _plan(served, epoch: int, *, kv_bits: int = 0) -> Plan:
    return Plan(model=served.model_id, strategy="single", stages=(Stage(0, 4, ("me",)),), epoch=epoch, kv_bits=kv_bits)


async def _adopt_while_loading(served, first: Plan, second: Plan, caplog) -> None:
    """Adopt ``first``, then ``second`` while this node's shard for ``first`` is being built (as the
    adoption does: take, then apply_soon), and wait for the loads to settle."""
    served.take(first)
    served.apply_soon(first)
    while f"for epoch {first.epoch}" not in caplog.text:  # logged just before the shard is built
        await asyncio.sleep(0)
    served.take(second)
    served.apply_soon(second)
    while not served._apply_task.done():
        await asyncio.sleep(0.01)


async def test_a_newer_plan_for_the_same_part_keeps_the_load_in_flight(tmp_path, caplog):
    """Another node came or went while this one loaded, and the new plan gives this node the same
    layers: the load goes on and serves the new epoch, instead of being thrown away and started
    again. For a tensor group that is what keeps its ring: the other members may already have
    formed it with the worker this load started."""
    caplog.set_level(logging.INFO, logger="meshnode.serving.loading")
    served = await _served(tmp_path, build_model(tmp_path / "llama", "llama", num_layers=4))
    try:
        await _adopt_while_loading(served, _plan(served, 1), _plan(served, 2), caplog)
        assert served._apply_task.exception() is None
        assert served.ready_epoch == 2 and served.ready(served.plan)
        assert caplog.text.count("loading layers [0, 4)") == 1  # built once, for epoch 1, served for 2
        assert list(served.shards) == [(0, 4)]
    finally:
        served.close()


async def test_a_newer_plan_for_another_part_replaces_the_load_in_flight(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="meshnode.serving.loading")
    served = await _served(tmp_path, build_model(tmp_path / "llama", "llama", num_layers=4))
    try:
        # A quantized KV cache: a tensor group's workers would build other caches, so it starts anew.
        await _adopt_while_loading(served, _plan(served, 1), _plan(served, 2, kv_bits=8), caplog)
        assert served.ready_epoch == 2 and served.plan.kv_bits == 8
        assert "loading layers [0, 4) for epoch 2" in caplog.text  # the first load was cancelled
        assert served.shards[(0, 4)].kv_bits == 8
    finally:
        served.close()
