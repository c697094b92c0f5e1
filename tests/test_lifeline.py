"""A killed node leaves nothing behind: its worker processes (a tensor group's member, the ring that
times a split layer) exit when it dies, also while they wait inside a collective that never forms."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from meshnode.model.build import build_model
from meshnode.model.compute import free_ports

pytestmark = pytest.mark.timeout(120)

# The parent: starts the child the way a node does (meshnode.model.lifeline.child_env), prints its
# pid, then waits to be killed.
PARENT = """
import subprocess, sys, time
from meshnode.model.lifeline import child_env
child = subprocess.Popen(sys.argv[2:], env=child_env(__import__('json').loads(sys.argv[1])),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.PIPE)
print(child.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited (reaped by init later)
        return f.read().split(") ", 1)[1][0] != "Z"


def _orphan_dies(child_argv: list[str], env: dict[str, str], settle: float) -> float:
    """Kill -9 a parent whose child is busy; seconds until the child is gone."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, json.dumps({**os.environ, **env}), *child_argv],
        stdout=subprocess.PIPE,
        text=True,
    )
    child = int(parent.stdout.readline())
    try:
        time.sleep(settle)  # the child is up, inside its ring set-up
        assert _alive(child), "the child ended before its parent was killed"
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        t0 = time.monotonic()
        while _alive(child) and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        return time.monotonic() - t0
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(
        tmp_path_factory.mktemp("lifeline") / "llama", "llama", num_layers=4, hidden_size=64, dtype="float32"
    )


@pytest.mark.slow
def test_a_ring_measurement_dies_with_its_node(model, tmp_path):
    """Rank 0 of the split-layer timing waits for a rank 1 that never comes (a hung ring)."""
    hostfile = tmp_path / "ring.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
    took = _orphan_dies(
        [sys.executable, "-m", "meshnode.model.compute", "--tensor-layers", str(model), "1", "2", "1"],
        {"MLX_RANK": "0", "MLX_HOSTFILE": str(hostfile)},
        settle=4,
    )
    assert took < 3, f"the ring process outlived its node by {took:.1f} s"


@pytest.mark.slow
def test_a_tensor_worker_dies_with_its_node(model, tmp_path):
    """A follower (rank 1) of a tensor group that never forms: its leader is not there."""
    hostfile = tmp_path / "ring.json"
    ring = free_ports(3)
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ring[:2]]))
    argv = [
        sys.executable,
        "-m",
        "meshnode.model.tensor_worker",
        "--model",
        str(model),
        "--start",
        "0",
        "--end",
        "4",
        "--backend",
        "ring",
        "--control",
        f"127.0.0.1:{ring[2]}",
    ]
    took = _orphan_dies(argv, {"MLX_RANK": "1", "MLX_HOSTFILE": str(hostfile)}, settle=4)
    assert took < 3, f"the tensor worker outlived its node by {took:.1f} s"


def test_a_child_whose_node_died_while_it_started_exits_at_once(tmp_path):
    """The node can die before the child asks for its parent's pid: the pid the node wrote into the
    environment is not the parent any more, and the child exits instead of watching init."""
    code = "import time; from meshnode.model.lifeline import die_with_parent; die_with_parent(); time.sleep(30)"
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "MESHNODE_PARENT_PID": "1"}, timeout=20)
    assert proc.returncode == 3
