"""A served model loaded on demand (several models on one mesh), on one node's ServedModel: what it
tells the coordinator and what a request meets. Pure bookkeeping; no model is loaded."""

from __future__ import annotations

import pytest

from meshnode.config import Settings
from meshnode.errors import ApiError
from meshnode.planner.plans import UNLOADED, Plan, Stage
from meshnode.serving.served import ServedModel
from meshnode.serving.settings import ServingSettings
from tests.helpers import LoneMesh


def _served(tmp_path) -> ServedModel:
    settings = Settings(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache")
    return ServedModel(
        ServingSettings.of(settings),
        "me",
        scheduler=None,
        metrics=None,
        progress=None,
        mesh=LoneMesh(),
        auth=None,
        group_secret=b"",
        event=lambda *a, **k: None,
        on_ready=lambda: None,
    )


def test_an_unloaded_model_is_on_demand_and_a_request_waits_instead_of_a_503(tmp_path):
    served = _served(tmp_path)
    served.engine = object()
    served.plan = Plan(model="m", strategy=UNLOADED, stages=(), epoch=3, reason="made room for another")
    assert served.on_demand() and not served.loaded()
    assert served.engine_for_request() is served.engine  # no 503: the engine's source waits for the load
    with pytest.raises(ApiError) as refused:  # the placement itself is not there to use
        served.placement(None)
    assert refused.value.status == 503 and "not loaded" in str(refused.value)


def test_a_generation_whose_model_was_unloaded_under_it_counts_as_waiting(tmp_path):
    """The coordinator saw the model idle (heartbeats lag a request that just started) and unloaded
    it: the node announces that generation as waiting, so the model is loaded again and the
    generation goes on by failover instead of running out its deadline."""
    served = _served(tmp_path)
    served.use.active = 1
    served.plan = Plan(model="m", strategy="single", stages=(Stage(0, 4, ("me",)),), epoch=2)
    assert served.use_now().waiting == 0  # loaded: active, not waiting
    served.plan = Plan(model="m", strategy=UNLOADED, stages=(), epoch=3)
    assert served.use_now().waiting == 1 and served.use_now().active == 1
