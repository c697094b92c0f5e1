"""Draw the headline figures of benchmarks/results/*.json as charts for the docs.

    .venv/bin/python -m benchmarks.charts [--results benchmarks/results] [--out docs/img]

Needs matplotlib (``pip install -e ".[bench]"``). Each chart reads one results file, as the
benchmark that made it wrote it (or as transcribed from its printed table, which the file says),
and is written as a PNG into ``--out``; docs/benchmarks.md shows them. Run it again after a
benchmark writes new figures, and commit the PNGs with the results.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BLUE, ORANGE, GREEN, GREY, RED = "#3b6ea8", "#e08a2c", "#4e9a5b", "#8c8c8c", "#b8433a"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {"font.size": 10, "axes.spines.top": False, "axes.spines.right": False, "axes.titlesize": 11, "figure.dpi": 110}
    )
    return plt


def _load(results: Path, name: str) -> dict:
    return json.loads((results / name).read_text())


def _label_bars(ax, bars, fmt: str = "{:.2f}", scale: float = 1.0) -> None:
    for bar in bars:
        h = bar.get_height()
        ax.annotate(
            fmt.format(h),
            (bar.get_x() + bar.get_width() / 2, h * scale),
            ha="center",
            va="bottom",
            fontsize=8,
            xytext=(0, 2),
            textcoords="offset points",
        )


def speculative(results: Path, out: Path) -> Path:
    """Speculative decoding on 2 stages: the mesh against plain mlx-lm, mlx-lm's own speculation
    and itself without speculation, at each controlled acceptance p; one panel per BLAS."""
    plt = _plt()
    runs = [
        ("OpenBLAS", _load(results, "speculative_openblas.json")),
        ("MLX's own reference BLAS", _load(results, "speculative_reference_blas.json")),
    ]
    ps = ["0.0", "0.5", "0.8", "1.0"]
    series = [
        ("mesh / plain mlx-lm", "mesh/plain", BLUE),
        ("mesh / mlx-lm's own speculation", "mesh/mlx-spec", ORANGE),
        ("mesh / mesh without speculation", "spec/nospec", GREEN),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    width = 0.26
    for ax, (title, run) in zip(axes, runs):
        med = run["medians"]
        for i, (label, key, colour) in enumerate(series):
            xs = [j + (i - 1) * width for j in range(len(ps))]
            values = [med[f"p={p} {key}"] for p in ps]
            # bars grow from 1x (as fast as what they are measured against), up or down
            ax.bar(xs, [v - 1 for v in values], width, bottom=1, label=label, color=colour)
            for x, v in zip(xs, values):
                ax.annotate(
                    f"{v:.2f}",
                    (x, max(v, 1.0)),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                    xytext=(0, 2),
                    textcoords="offset points",
                )
        ax.axhline(1.0, color=GREY, lw=1, ls="--")
        ax.set_yscale("log", base=2)
        ax.set_ylim(0.7, 10)
        ax.set_yticks([0.75, 1, 2, 4, 8], ["0.75x", "1x", "2x", "4x", "8x"])
        ax.set_xticks(range(len(ps)), [f"p = {p}" for p in ps])
        ax.set_xlabel("share of guesses that are right")
        ax.set_title(f"{title}: plain mlx-lm {med['mlx plain']:.1f} tok/s")
    axes[0].set_ylabel("speed ratio (log scale)")
    axes[0].legend(loc="upper left", fontsize=8, frameon=False)
    fig.suptitle("Speculative decoding on a 2-stage mesh (two CPU cores, 101M float32 llama)")
    fig.tight_layout()
    return _save(fig, out / "speculative.png")


def split_cost(results: Path, out: Path) -> Path:
    """What a 2-stage split adds to each decoded token (meshnode, the bare split, llama.cpp's RPC
    split), and where the mesh's token path outside compute goes."""
    plt = _plt()
    run = _load(results, "split_cost.json")
    added = run["added_ms"]
    seg = run["segments_ms"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [1, 1.4]})
    names = ["llama.cpp's RPC split", "meshnode, 2 stages", "bare split (floor)"]
    values = [added["llama.cpp rpc"], added["mesh"], added["bare split"]]
    bars = left.barh(names, values, color=[GREY, BLUE, GREEN])
    for bar, v in zip(bars, values):
        left.annotate(
            f"{v:.2f} ms",
            (v, bar.get_y() + bar.get_height() / 2),
            va="center",
            fontsize=9,
            xytext=(3, 0),
            textcoords="offset points",
        )
    left.invert_yaxis()
    left.set_xlabel("ms added per decoded token")
    left.set_xlim(0, max(values) * 1.35)
    left.set_title("What a split adds to each token")
    path = [
        (k, v)
        for k, v in seg.items()
        if k != "token"
        and "compute" not in k
        and "sampler" not in k
        and "wait for its own" not in k
        and "next step" not in k
    ]
    labels = [k for k, _ in path]
    values = [v for _, v in path]
    bars = right.barh(labels, values, color=BLUE)
    for bar, v in zip(bars, values):
        right.annotate(
            f"{v:.2f}",
            (v, bar.get_y() + bar.get_height() / 2),
            va="center",
            fontsize=8,
            xytext=(3, 0),
            textcoords="offset points",
        )
    right.invert_yaxis()
    right.tick_params(axis="y", labelsize=8)
    right.set_xlabel("ms per token")
    right.set_xlim(0, max(values) * 1.3)
    right.set_title(f"The mesh's token path beside compute: {run['split_only_ms']:.2f} ms", loc="right")
    fig.suptitle(
        f"benchmarks.split_cost: {run['parameters'] / 1e6:.0f}M float32 llama, one core per process, medians of rounds",
        fontsize=10,
    )
    fig.tight_layout()
    return _save(fig, out / "split_cost.png")


def tensor(results: Path, out: Path) -> Path:
    """Decode tokens/s of one node, a 2-node pipeline and a 2-node tensor group as the link's
    latency grows: the link, not the chips, decides."""
    plt = _plt()
    run = _load(results, "tensor_latencies.json")
    rows = run["rows"]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for key, label, colour, dy in (
        ("single", "one node", GREY, 5),
        ("pipeline", "pipeline, 2 nodes", BLUE, -12),
        ("tensor", "tensor group, 2 nodes", ORANGE, 5),
    ):
        ys = [r[key] for r in rows]
        ax.plot(xs, ys, marker="o", color=colour, label=label)
        for x, y in zip(xs, ys):
            ax.annotate(f"{y:.1f}", (x, y), fontsize=8, xytext=(5, dy), textcoords="offset points", color=colour)
    for x, r in zip(xs, rows):
        ax.annotate(f"planner: {r['planner_pick']}", (x, 1.0), ha="center", fontsize=8, color=GREY)
    ax.set_xticks(list(xs), [f"+{r['inject_us']:g} µs" if r["inject_us"] else "none" for r in rows])
    ax.set_xlim(-0.3, len(rows) - 0.6)
    ax.set_xlabel("latency added to every round trip between the nodes")
    ax.set_ylabel("decode tok/s")
    ax.set_ylim(0, max(r["tensor"] for r in rows) * 1.2)
    ax.legend(frameon=False, fontsize=9, loc="upper right")
    ax.set_title("Tensor parallelism pays only over a fast link (101M float32 llama, CPU)")
    fig.tight_layout()
    return _save(fig, out / "tensor_latency.png")


def suite(results: Path, out: Path) -> Path:
    """The suite's headline ratios: decode against mlx-lm by stages, time to first token with
    pipelined prefill, and concurrent streams on 2 stages."""
    plt = _plt()
    run = _load(results, "suite.json")
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    ax = axes[0]
    decode = run["decode"]
    labels = ["1 stage", "2 stages", "3 stages", "bare split"]
    values = [decode["1"]["ratio"], decode["2"]["ratio"], decode["3"]["ratio"], decode["2"]["bare_split"]["ratio"]]
    bars = ax.bar(labels, values, color=[BLUE, BLUE, BLUE, GREEN])
    _label_bars(ax, bars, "{:.3f}")
    ax.axhline(run["targets"]["decode_ratio_2"], color=RED, lw=1, ls="--")
    ax.set_ylim(0.8, 1.06)
    ax.set_ylabel("decode tok/s over mlx-lm's (axis from 0.8)")
    ax.set_title(f"Decode against one process\n(dashed: target {run['targets']['decode_ratio_2']} for 2 stages)")
    ax = axes[1]
    ttft = run["ttft"]
    groups = list(ttft)
    width = 0.26
    for i, (key, label, colour) in enumerate(
        (
            ("mlx_lm_s", "mlx-lm", GREY),
            ("sequential_s", "mesh, chunk by chunk", ORANGE),
            ("pipelined_s", "mesh, pipelined", BLUE),
        )
    ):
        xs = [j + (i - 1) * width for j in range(len(groups))]
        bars = ax.bar(xs, [ttft[g][key] for g in groups], width, label=label, color=colour)
        _label_bars(ax, bars, "{:.2f}")
    ax.set_xticks(range(len(groups)), [f"{g}-token prompt" for g in groups])
    ax.set_ylabel("time to first token, s")
    ax.set_ylim(0, max(v for g in groups for v in ttft[g].values()) * 1.15)
    ax.set_title("Time to first token, 2 stages\n(a smaller 5M llama)")
    ax.legend(frameon=False, fontsize=8, loc="upper left")
    ax = axes[2]
    agg = run["aggregate"]
    one = agg["1"]["aggregate_tps"]
    streams = list(agg)
    bars = ax.bar(
        [f"{n} stream{'s' if n != '1' else ''}" for n in streams],
        [agg[n]["aggregate_tps"] / one for n in streams],
        color=BLUE,
    )
    _label_bars(ax, bars, "{:.2f}x")
    ax.axhline(run["targets"]["aggregate_2_over_1"], color=RED, lw=1, ls="--")
    ax.set_ylabel("tokens/s over one stream's")
    ax.set_title(f"Concurrent streams, 2 stages\n(dashed: target {run['targets']['aggregate_2_over_1']} for 2 streams)")
    ax.set_ylim(0, 2.4)
    fig.suptitle("benchmarks.suite: real nodes on namespace hosts of one 2-core machine, MLX on CPU", fontsize=10)
    fig.tight_layout()
    return _save(fig, out / "suite.png")


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Software": None})
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


CHARTS = (speculative, split_cost, tensor, suite)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = ap.parse_args()
    for chart in CHARTS:
        print(chart(args.results, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
