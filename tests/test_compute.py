"""The per-layer compute figure: measured once on the real model, then cached."""

from __future__ import annotations

import json
import subprocess

import pytest

from meshnode.model import compute
from meshnode.model.build import build_model


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


@pytest.mark.slow
def test_a_two_way_split_layer_is_timed_for_real_and_cached(tmp_path, monkeypatch):
    model = build_model(tmp_path / "llama", "llama", num_layers=4, hidden_size=128, dtype="float32")
    whole = compute.layer_seconds(model, 4, tmp_path / "state")
    split = compute.tensor_layer_seconds(model, 4, tmp_path / "state")
    assert 0 < split < 1.0  # two real processes sharing the layers over an mx.distributed ring
    assert compute.collective_overhead(whole, split) > 0
    monkeypatch.setattr(compute, "measure_tensor_layer_seconds", lambda *a: pytest.fail("measured again"))
    assert compute.tensor_layer_seconds(model, 4, tmp_path / "state") == split
    assert len(json.loads((tmp_path / "state" / "compute.json").read_text())) == 2


def test_collective_overhead_is_what_the_split_adds_beyond_half():
    assert compute.collective_overhead(0.010, 0.0056) == pytest.approx(0.0003)
    assert compute.collective_overhead(0.010, 0.004) == pytest.approx(1e-6)  # never zero or negative
    assert compute.collective_overhead(0.0, 0.004) == 0.0 and compute.collective_overhead(0.01, 0.0) == 0.0


@pytest.mark.slow
def test_seeded_figures_are_what_a_node_then_reads(tmp_path, monkeypatch):
    model = build_model(tmp_path / "llama", "llama", num_layers=4, hidden_size=128, dtype="float32")
    one, two = compute.seed_figures(model, 4, tmp_path / "seed", rounds=2)
    assert 0 < one < 1.0 and 0 < two < 1.0
    monkeypatch.setattr(compute, "measure_layer_seconds", lambda *a: pytest.fail("measured again"))
    monkeypatch.setattr(compute, "measure_tensor_layer_seconds", lambda *a: pytest.fail("measured again"))
    assert compute.layer_seconds(model, 4, tmp_path / "seed") == one
    assert compute.tensor_layer_seconds(model, 4, tmp_path / "seed") == two


def test_a_cancelled_ring_measurement_ends_its_processes(tmp_path):
    """A node that stops while it times a split layer must not leave the ring's processes running."""
    import threading
    import time

    model = build_model(tmp_path / "llama", "llama", num_layers=4, hidden_size=128, dtype="float32")
    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    t0 = time.monotonic()
    assert compute.measure_tensor_layer_seconds(model, 4, cancel=cancel) == 0.0
    assert time.monotonic() - t0 < 5
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    # This measurement's processes name this test's model (other nodes on the machine may be timing theirs).
    assert f"meshnode.model.compute --tensor-layers {model} " not in ps


def test_a_step_counts_the_cpu_it_used_not_the_wait_for_a_core():
    """A node timing its layers while others serve a load on the same cores waits for a core, and
    wall time alone would make it look far slower than it is (the planner, believing it, keeps a
    plan it should leave). On MLX's CPU backend a step counts the smaller of wall and process CPU time."""
    assert compute.step_seconds(0.0035, 0.0011, on_cpu=True) == 0.0011  # descheduled: the CPU it used
    assert compute.step_seconds(0.0010, 0.0013, on_cpu=True) == 0.0010  # alone, helper threads too: wall
    assert compute.step_seconds(0.0035, 0.0002, on_cpu=False) == 0.0035  # a GPU's step waits off the CPU
    assert compute.step_seconds(0.0035, 0.0, on_cpu=True) == 0.0035  # no CPU clock to read
