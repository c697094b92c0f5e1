"""Fixtures for the multi-host tests (network namespaces); see harness/netns.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

# The tests compare with mlx-lm token for token: on MLX's own reference BLAS, whose results do not
# depend on a step's shape (meshnode.blas); nodes they start inherit it. MESHNODE_BLAS=auto runs
# the suite on OpenBLAS instead.
os.environ.setdefault("MESHNODE_BLAS", "reference")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `tests.*`, `harness.*` under plain `pytest`

from harness import netns  # noqa: E402

# Seconds of a test's call past which an unmarked one is listed: the slow rule's 2 s (pyproject.toml)
# and half again, since a test near 2 s comes and goes with the machine's load.
LISTED = 3.0

_unmarked_over: list[tuple[float, str]] = []  # (seconds, node id) of unmarked calls over LISTED

# Seconds each module took in a whole run (scripts/suite_durations.py writes it): the slowest run first.
DURATIONS: dict[str, float] = json.loads((Path(__file__).resolve().parent / "durations.json").read_text())


def pytest_collection_modifyitems(config, items):
    # Slowest modules first, each in its own order (a stable sort): parallel workers (scripts/test.sh)
    # take whole modules, and the longest ones start at once instead of meeting the end alone.
    items.sort(key=lambda item: -DURATIONS.get(item.nodeid.split("::")[0], 0.0))
    marked = [item for item in items if item.get_closest_marker("netns")]
    if marked and (reason := netns.available()):
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_runtest_logreport(report):
    # A module's fixtures are set up once, by whichever of its tests comes first: not counted.
    if report.when == "call" and report.duration > LISTED and not {"slow", "netns"} & set(report.keywords):
        _unmarked_over.append((report.duration, report.nodeid))


def _cpu_seconds() -> float:
    """CPU this process and its reaped children (nodes, servers, clients: theirs too) have used."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


_cpu_mark = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # Each phase's report carries the CPU used since the last one: a node is counted when the
    # phase that stops it reaps it (a module's fixtures, in its last test's teardown).
    global _cpu_mark
    outcome = yield
    now = _cpu_seconds()
    outcome.get_result().user_properties.append(("cpu_s", now - _cpu_mark))
    _cpu_mark = now


def pytest_terminal_summary(terminalreporter):
    """Lists the unmarked tests over LISTED: the fast loop (``-m "not slow"``) stays fast while they
    are marked. Then where the run's time and CPU went, by module: the suite is CPU-bound on two
    cores, so CPU is what a faster suite must cut."""
    if _unmarked_over:
        terminalreporter.section(f"unmarked tests over {LISTED:g} s: mark them @pytest.mark.slow")
        for seconds, nodeid in sorted(_unmarked_over, reverse=True):
            terminalreporter.write_line(f"{seconds:6.2f}s {nodeid}")
    wall: dict[str, float] = {}
    cpu: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for r in reports:
            if not isinstance(r, pytest.TestReport):
                continue
            module = r.nodeid.split("::")[0]
            wall[module] = wall.get(module, 0.0) + r.duration
            cpu[module] = cpu.get(module, 0.0) + dict(r.user_properties).get("cpu_s", 0.0)
    if cpu:
        terminalreporter.section("CPU by module (this process and the processes it reaped)")
        terminalreporter.write_line(f"{'cpu s':>8} {'wall s':>8}  module  (all: {sum(cpu.values()):.0f} s CPU)")
        for module in sorted(cpu, key=cpu.__getitem__, reverse=True)[:25]:
            terminalreporter.write_line(f"{cpu[module]:8.1f} {wall[module]:8.1f}  {module}")


@pytest.fixture
def netns_mesh_factory():
    """``make(n, prefix=None) -> Mesh``; every mesh made is removed after the test."""
    meshes: list[netns.Mesh] = []

    def make(n: int, prefix: str | None = None) -> netns.Mesh:
        if not meshes:
            netns.prepare()
        mesh = netns.Mesh(n, prefix)
        meshes.append(mesh)
        return mesh

    try:
        yield make
    finally:
        for mesh in reversed(meshes):
            mesh.close()


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory) -> Path:
    """A folder shared by every worker of this run (pytest-xdist), for what a run makes once."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    shared.mkdir(exist_ok=True)
    return shared


@pytest.fixture(scope="session")
def taught(run_dir) -> Path:
    """The taught tool-calling agent (tests/agent_model.py), taught once per run; read-only."""
    from tests.agent_model import taught_agent_once

    return taught_agent_once(run_dir)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real model's GGUF file (tests/realmodel.py), or a skip that says why it cannot be had."""
    from tests.realmodel import smollm2

    return smollm2()


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf, run_dir) -> tuple[str, Path]:
    """(model id, folder) of the real model converted as a node converts it, once per run."""
    from tests.realmodel import converted

    return converted(smollm2_gguf, run_dir / "smollm2")


@pytest.fixture(scope="session")
def smollm2_float32(smollm2, run_dir) -> Path:
    """The real model's weights dequantized to float32 (an mlx-lm folder), once per run: on OpenBLAS
    (``MESHNODE_BLAS=auto``) it computes many times faster than the Q4_1 file on this CPU, for tests
    that hold a node to an API's shapes rather than to mlx-lm's tokens."""
    from tests.realmodel import variant_once

    return variant_once(smollm2[1], run_dir, dtype="float32")
