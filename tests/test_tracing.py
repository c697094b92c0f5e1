"""meshnode.tracing (timestamps on the token path) and benchmarks.split_cost's cutting of a token into segments."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks.split_cost import CYCLE, segments
from meshnode import tracing

ROOT = Path(__file__).resolve().parent.parent


def test_marks_are_written_per_process_and_read_back_in_time_order(tmp_path):
    code = "from meshnode import tracing\ntracing.mark('b.first'); tracing.mark('b.second')\n"
    for _ in range(2):  # two processes, each its own file, read back together
        subprocess.run(
            [sys.executable, "-c", code],
            check=True,
            cwd=ROOT,
            timeout=60,
            env={**os.environ, tracing.ENV: str(tmp_path), "PYTHONPATH": str(ROOT)},
        )
    traces = tracing.read(tmp_path)
    assert len(traces) == 2
    for rows in traces.values():
        assert [name for _, name, _ in rows] == ["b.first", "b.second"]
        assert rows[0][0] <= rows[1][0]
        name, tid = rows[0][2].rsplit("/", 1)
        assert name == "MainThread" and int(tid) > 0


def test_off_by_default_writes_nothing(tmp_path):
    code = "from meshnode import tracing\ntracing.mark('x')\nprint(tracing._events)\n"
    env = {k: v for k, v in os.environ.items() if k != tracing.ENV}
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        cwd=ROOT,
        timeout=60,
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(ROOT)},
    )
    assert out.stdout.strip() == "None"
    assert not list(tmp_path.iterdir())


def _cycle(start_ns: int, step_ns: list[int]) -> list[tuple[int, str]]:
    """One token's events (CYCLE after its first), each ``step_ns`` after the one before."""
    out, t = [], start_ns
    for (name, _), dt in zip(CYCLE[1:], step_ns):
        t += dt
        out.append((t, name))
    return out


def test_segments_cut_each_token_and_leave_out_outliers():
    steps = list(range(1_000, 1_000 * len(CYCLE), 1_000))  # 1, 2, ... µs
    head, stage = [(0, "head.evaluated", "g")], []
    t = 0
    for k in range(5):
        stretch = 10 if k == 2 else 1  # the third token is a hiccup: left out
        for ns, name in _cycle(t, [s * stretch for s in steps]):
            (stage if name.startswith("stage.") else head).append((ns, name, "g"))
            t = ns
    head.append((t + 50, "api.written", "loop"))  # other events do not disturb the cut
    parts = segments({1: head, 2: stage})
    assert len(parts["token"]) == 4
    assert parts["token"][0] == sum(steps) / 1e9
    names = [what for _, what in CYCLE[1:]]
    assert [parts[n][0] for n in names] == [s / 1e9 for s in steps]


def test_a_token_missing_an_event_is_not_counted():
    cycle = _cycle(0, [1000] * (len(CYCLE) - 1))
    without_stage = [(ns, n, "g") for ns, n in cycle if not n.startswith("stage.")]
    assert segments({1: [(0, "head.evaluated", "g")] + without_stage}) == {}
