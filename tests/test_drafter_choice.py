"""The drafter a placement speculates with (meshnode.serving.drafter_choice), and the setting that asks for it."""

from __future__ import annotations

import logging

import pytest

from meshnode.config import ConfigError, load_settings
from meshnode.serving.drafter_choice import MTPState, choose_drafter
from meshnode.serving.placements import speculation_for
from meshnode.serving.settings import PlacementSettings

pytestmark = pytest.mark.timeout(30)
READY = MTPState(present=True, whole=True, loaded="1 layer, float32")


def test_the_setting_takes_mtp_and_refuses_what_it_does_not_know():
    assert load_settings(None, env={}, flags={"speculative": "MTP"}).speculative == "mtp"
    with pytest.raises(ConfigError, match="mtp"):
        load_settings(None, env={}, flags={"speculative": "nextn"})


@pytest.mark.parametrize("mode", ["auto", "mtp"])
@pytest.mark.parametrize("batched", [False, True])
def test_auto_and_mtp_draft_with_the_models_head_where_one_node_runs_it_whole(mode, batched):
    choice = choose_drafter(mode, READY, batched=batched)
    assert (choice.kind, choice.describe()) == ("mtp", "mtp: the model's own head (1 layer, float32)")


@pytest.mark.parametrize(
    "state,why",
    [
        (MTPState(), "no MTP head"),
        (MTPState(present=True, loaded="1 layer, float32"), "the model is split"),
        (MTPState(present=True, whole=True, steps_batched=True, loaded="x"), "lockstep"),
        (MTPState(present=True, whole=True, error="NoMTPHead: none"), "did not load (NoMTPHead: none)"),
    ],
)
@pytest.mark.parametrize("mode", ["auto", "mtp"])
def test_without_a_head_that_can_draft_here_auto_and_mtp_take_what_auto_took_before(state, why, mode):
    alone, batched = choose_drafter(mode, state, batched=False), choose_drafter(mode, state, batched=True)
    assert alone.kind == "prompt_lookup" and why in alone.why
    assert batched.kind == "off" and why in batched.why and "requests batch" in batched.why


def test_the_named_drafters_do_not_look_at_the_head():
    assert choose_drafter("prompt_lookup", READY, batched=True).kind == "prompt_lookup"
    assert choose_drafter("off", READY, batched=False).kind == "off"
    assert choose_drafter("draft_model", READY, batched=False, draft="tiny").describe() == (
        "draft_model: the draft model tiny"
    )
    assert choose_drafter("draft_model", READY, batched=False).kind == "off"


def test_mtp_without_a_head_says_so_in_one_line_and_falls_back(caplog):
    settings = PlacementSettings.of(load_settings(None, env={}, flags={"speculative": "mtp"}))
    made: list[object] = []
    with caplog.at_level(logging.WARNING, logger="meshnode.serving.placements"):
        spec, choice = speculation_for(settings, None, mtp=MTPState(), drafts=made.append)
    assert spec is not None and choice.kind == "prompt_lookup" and not made
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == 'speculative = "mtp": no MTP head; drafting with prompt_lookup instead'
    spec, choice = speculation_for(settings, None, mtp=READY, drafts=lambda m: (made.append(m), lambda t: None)[1])
    assert spec is not None and choice.kind == "mtp" and made == [None]
