"""The per-layer compute figure: measured once on the real model, then cached."""

from __future__ import annotations

import json

import pytest

from meshnode.data import compute
from meshnode.modelbuild import build_model


def test_layer_seconds_is_measured_once_and_cached(tmp_path, monkeypatch):
    model = build_model(tmp_path / "llama", "llama", num_layers=4, hidden_size=128, dtype="float32")
    first = compute.layer_seconds(model, 4, tmp_path / "state")
    assert 0 < first < 1.0
    assert list(json.loads((tmp_path / "state" / "compute.json").read_text()).values()) == [first]

    def boom(*args):
        raise AssertionError("measured again")

    monkeypatch.setattr(compute, "measure_layer_seconds", boom)
    assert compute.layer_seconds(model, 4, tmp_path / "state") == first
    # Another model (another config) is another entry.
    other = build_model(tmp_path / "other", "llama", num_layers=2, hidden_size=64, dtype="float32")
    monkeypatch.undo()
    assert compute.layer_seconds(other, 2, tmp_path / "state") > 0
    assert len(json.loads((tmp_path / "state" / "compute.json").read_text())) == 2


def test_a_corrupt_cache_is_remeasured(tmp_path):
    model = build_model(tmp_path / "llama", "llama", num_layers=2, hidden_size=64, dtype="float32")
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "compute.json").write_text("[not json")
    assert compute.layer_seconds(model, 2, tmp_path / "state") > 0
