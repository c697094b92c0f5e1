"""Issue 19 benchmark: the home lab as it is.

A simulated lab of up to ten hosts from the table in benchmarks/homelab_lab.py, each a network
namespace with its own memory budget, CPU quota and link (delay and jitter). Two parts:

- **Regret.** The mesh plans on its own (``auto``); then every alternative its plan lists (each
  other strategy's best plan, and the chosen strategy's runner-up) is forced with the
  ``plan_layout`` setting on a fresh lab, and each plan's inter-token times are measured from
  streamed greedy answers (checked equal to mlx-lm's). The regret is how much the chosen plan's
  p95 inter-token time is over the best measured (target: within 10 %).
- **The control plane** at 3, 6 and 10 nodes: time to a first plan, to a re-plan after a plan
  node is killed and after it rejoins, heartbeat (with their gossip) and all wire bytes per node
  per second while idle, and the planner's own time for that many nodes.

Isolation: this VM has two cores. Each node runs under a CFS quota of its host's share of one core
(1 ms slices, harness/cpulimit.py), which stands for its machine's speed; each starts with this
machine's compute figures (measured once, alone) divided by that share, as a slower Mac measures
of itself. Links are userspace relays at real-time priority (harness/jitter.py; no netem here).
Absolute figures are this VM's. Needs root.

    sudo .venv/bin/python -m benchmarks.homelab [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.homelab_lab import (  # noqa: E402
    LAB,
    REGRET_TARGET,
    Host,
    gaps,
    layout_of,
    node_id,
    percentile,
    period_us,
    planner_inputs,
    regret,
    scaled_figures,
    table,
    to_force,
)
from harness.cluster import HTTP, Cluster, mlx_reference, stage_nodes  # noqa: E402
from harness.cpulimit import cpu_limited  # noqa: E402
from harness.netns import netns_mesh  # noqa: E402
from meshnode.cli.dryrun import cluster_from_mesh  # noqa: E402
from meshnode.model.build import model_dir_for  # noqa: E402
from meshnode.model.compute import collective_overhead, seed_figures  # noqa: E402
from meshnode.planner import PlanError  # noqa: E402
from meshnode.planner import plan as make_plan  # noqa: E402
from meshnode.planner.pinned import pinned_plan  # noqa: E402
from meshnode.weights.profile import profile_model  # noqa: E402

MODEL = dict(num_layers=8, hidden_size=512, intermediate_size=1024, num_heads=8, num_kv_heads=4, dtype="float32")
CONTEXT = 512
MESSAGES = [{"role": "user", "content": "Tell me a story about the sea and the rivers."}]
PROBE_S = 5.0
ENV = {
    "MESHNODE_SPECULATIVE": "off",  # one token per step: the gaps are the plan's own
    "MESHNODE_LINK_PROBE_INTERVAL": str(PROBE_S),
    "MESHNODE_REBALANCE_DWELL": "3",
}
# Prints [time, text] for each content event of a streamed answer, ["error", what] for an error event.
STREAM = (
    "import json,sys,time,urllib.request\n"
    "req=urllib.request.Request(sys.argv[1],data=sys.argv[2].encode(),headers={'Content-Type':'application/json'})\n"
    "for line in urllib.request.urlopen(req,timeout=300):\n"
    "  line=line.strip()\n"
    "  if not line.startswith(b'data: {'): continue\n"
    "  event=json.loads(line[6:])\n"
    "  if 'error' in event: print(json.dumps(['error',event['error']]),flush=True)\n"
    "  for c in event.get('choices',()):\n"
    "    t=(c.get('delta') or {}).get('content')\n"
    "    if t: print(json.dumps([time.time(),t]),flush=True)\n"
)


@dataclass
class Lab:
    cluster: Cluster
    hosts: tuple[Host, ...]
    start: Callable[[Host], None]  # (re)start a host's node under its budget and quota

    def host(self, name: str):
        return self.cluster.host(name)


@contextlib.contextmanager
def lab(hosts: Sequence[Host], model: Path, figures: dict, tmp: Path, env: dict) -> Iterator[Lab]:
    """The first ``len(hosts)`` hosts of the table as namespaces with their links, each node under
    its quota; nodes are started by the caller (``Lab.start``), so it can time them."""
    total = profile_model(model).total_bytes(CONTEXT)
    with netns_mesh(0, "homelab") as mesh, contextlib.ExitStack() as limits:
        for h in hosts:
            mesh.add_host(h.name)
        cluster = Cluster(mesh, model, tmp, max_context=CONTEXT)
        spec = {node_id(h): h for h in hosts}
        for host in cluster.hosts:
            if spec[host.name].delay_ms:
                mesh.delay(host, spec[host.name].delay_ms, spec[host.name].jitter_ms, every_ms=10.0)

        def start(h: Host) -> None:
            state = tmp / node_id(h)
            state.mkdir(parents=True, exist_ok=True)
            (state / "compute.json").write_text(json.dumps(scaled_figures(figures, h.quota)))
            cluster.start(cluster.host(node_id(h)), int(total * h.budget), env=env)
            limits.enter_context(cpu_limited(cluster.procs[node_id(h)].pid, h.quota, period_us(h.quota)))

        yield Lab(cluster, tuple(hosts), start)


def converged(lab_: Lab, names: Sequence[str] | None = None) -> list[dict] | None:
    hosts = [lab_.host(n) for n in names] if names else lab_.cluster.hosts
    return lab_.cluster.converged(hosts, len(hosts))


def settle(lab_: Lab, quiet: float, timeout: float = 120.0) -> dict:
    """The plan once every node sees it and no new epoch came for ``quiet`` seconds (links measured
    and weighed: the coordinator re-weighs every probe interval, moving after two weighings)."""

    def measured():
        views = converged(lab_)
        peers = views and {n["node_id"]: {lk["peer"] for lk in n["links"]} for n in views[0]["nodes"]}
        return views if peers and all(len(p) >= len(peers) - 1 for p in peers.values()) else None

    view = lab_.cluster.wait(measured, 240, "the lab to converge with every link measured")[0]
    since, deadline = time.monotonic(), time.monotonic() + timeout
    while time.monotonic() - since < quiet and time.monotonic() < deadline:
        time.sleep(1.0)
        with contextlib.suppress(OSError):
            if (views := converged(lab_)) and views[0]["epoch"] != view["epoch"]:
                view, since = views[0], time.monotonic()
    return view


def stream(lab_: Lab, entry, tokens: int) -> tuple[list[float], str]:
    body = json.dumps(
        {"model": lab_.cluster.model.name, "messages": MESSAGES, "max_tokens": tokens, "temperature": 0, "stream": True}
    )
    cmd = [sys.executable, "-c", STREAM, f"http://{entry.ip}:{HTTP}/v1/chat/completions", body]
    out = subprocess.run(lab_.cluster.client.exec_args(cmd), capture_output=True, text=True, timeout=300, check=True)
    events = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    if errors := [what for t, what in events if t == "error"]:
        raise AssertionError(f"the stream ended in an error: {errors}")
    return [t for t, _ in events], "".join(text for _, text in events)


def measure(lab_: Lab, view: dict, reference: str, tokens: int, repeats: int) -> dict:
    """Inter-token times of the plan in ``view``, asked at its first stage's node."""
    entry = lab_.host(stage_nodes(view)[0])
    lab_.cluster.chat(entry, MESSAGES, 8, timeout=180)  # the first request loads and compiles
    pooled: list[float] = []
    t0, load = time.monotonic(), os.getloadavg()[0]
    for _ in range(repeats):
        times, text = stream(lab_, entry, tokens)
        assert text == reference, f"the answer differs from mlx-lm's: {text!r} vs {reference!r}"
        pooled += gaps(times)
        if time.monotonic() - t0 > 60:  # a plan this slow has shown its gaps
            break
    return {
        "layout": layout_of(view["plan"]),
        "strategy": view["plan"]["strategy"],
        "estimate_ms": view["plan"]["estimate_s"] * 1e3,
        "p50_ms": percentile(pooled, 50) * 1e3,
        "p95_ms": percentile(pooled, 95) * 1e3,
        "gaps": len(pooled),
        "entry": entry.name,
        "load_before": load,
        "load_after": os.getloadavg()[0],
    }


def byte_rates(lab_: Lab, names: Sequence[str], seconds: float = 5.0) -> dict:
    """Per node and second while idle: heartbeat bytes (sent + received, gossip included) and all
    bytes through its interface (heartbeats, mDNS, link probes); mean and most over the nodes."""

    def wire(name: str) -> int:
        dev = lab_.host(name).run(["cat", "/proc/net/dev"]).stdout
        fields = next(line for line in dev.splitlines() if line.strip().startswith("eth0:")).split(":")[1].split()
        return int(fields[0]) + int(fields[8])

    def beats(name: str) -> int:
        return sum(lab_.cluster.mesh_view(lab_.host(name))["heartbeat_bytes"].values())

    hb0, w0, t0 = {n: beats(n) for n in names}, {n: wire(n) for n in names}, time.monotonic()
    time.sleep(seconds)
    hb1, w1, took = {n: beats(n) for n in names}, {n: wire(n) for n in names}, time.monotonic() - t0
    hb = [(hb1[n] - hb0[n]) / took for n in names]
    w = [(w1[n] - w0[n]) / took for n in names]
    return {
        "heartbeat_Bps_mean": sum(hb) / len(hb),
        "heartbeat_Bps_max": max(hb),
        "wire_Bps_mean": sum(w) / len(w),
        "wire_Bps_max": max(w),
    }


def loss_and_join(lab_: Lab, view: dict) -> dict:
    """Kill the plan's first stage node; time the re-plan without it; restart it; time until every
    node lists it again, and until a plan uses it (None: the mesh kept the plan it had)."""
    names = [node_id(h) for h in lab_.hosts]
    victim = stage_nodes(view)[0]
    survivors = [n for n in names if n != victim]
    lab_.cluster.mesh.kill(lab_.cluster.procs[victim])
    t1 = time.monotonic()
    after = lab_.cluster.wait(
        lambda: (v := converged(lab_, survivors)) and victim not in stage_nodes(v[0]) and v,
        90,
        "a re-plan without the lost node",
    )[0]
    replan = time.monotonic() - t1
    lab_.start(next(h for h in lab_.hosts if node_id(h) == victim))
    t2 = time.monotonic()
    lab_.cluster.wait(lambda: converged(lab_), 120, "the rejoin")
    joined = time.monotonic() - t2
    used = None
    with contextlib.suppress(AssertionError):
        lab_.cluster.wait(
            lambda: (v := converged(lab_)) and victim in [m for s in v[0]["plan"]["stages"] for m in s["nodes"]], 30, ""
        )
        used = time.monotonic() - t2
    return {
        "victim": victim,
        "replan_after_loss_s": replan,
        "plan_after_loss": layout_of(after["plan"]),
        "rejoined_s": joined,
        "replanned_with_it_s": used,
    }


def planner_time(model: Path, hosts: Sequence[Host], figures: tuple[float, float], repeats: int = 5) -> dict:
    """The planner's own time for these hosts (as the table gives them, not measured), best and median."""
    profile = profile_model(model)
    layer_s, split_s = figures
    nodes, links = planner_inputs(
        hosts, profile.total_bytes(CONTEXT), layer_s, collective_overhead(layer_s, split_s) or 0.0
    )
    took = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        make_plan(profile, nodes, max_context=CONTEXT, links=links)
        took.append(time.perf_counter() - t0)
    return {"planner_ms_best": min(took) * 1e3, "planner_ms_median": percentile(took, 50) * 1e3}


def control_lab(n: int, model: Path, figures: dict, tmp: Path) -> dict:
    hosts = LAB[:n]
    with lab(hosts, model, figures, tmp / f"control{n}", ENV) as lab_:
        t0 = time.monotonic()
        for h in hosts:
            lab_.start(h)
        view = lab_.cluster.wait(lambda: converged(lab_), 240, f"{n} nodes on one plan")[0]
        first = time.monotonic() - t0
        view = settle(lab_, quiet=2 * PROBE_S)
        rates = byte_rates(lab_, [node_id(h) for h in hosts])
        return {
            "nodes": n,
            "first_plan_s": first,
            "plan": layout_of(view["plan"]),
            **rates,
            **loss_and_join(lab_, view),
        }


def regret_labs(
    n: int, model: Path, figures: dict, tmp: Path, reference: str, tokens: int, repeats: int, again: bool
) -> dict:
    """The served plan measured (with the control plane's figures of this lab), then each plan to
    force (``to_force``) on a fresh lab; ``again``: the served plan too, pinned, last (the noise)."""
    hosts, profile = LAB[:n], profile_model(model)
    with lab(hosts, model, figures, tmp / "auto", ENV) as lab_:
        t0 = time.monotonic()
        for h in hosts:
            lab_.start(h)
        lab_.cluster.wait(lambda: converged(lab_), 240, f"{n} nodes on one plan")
        first = time.monotonic() - t0
        view = settle(lab_, quiet=3 * PROBE_S)
        rates = byte_rates(lab_, [node_id(h) for h in hosts])
        nodes, links = cluster_from_mesh(view)  # what the coordinator weighs now: `meshnode plan`'s dry run
        now = make_plan(profile, nodes, max_context=CONTEXT, links=links).to_dict()
        chosen = measure(lab_, view, reference, tokens, repeats)
        plan_nodes = [m for st in view["plan"]["stages"] for m in st["nodes"]]
        chosen |= {
            "reason": view["plan"]["reason"],
            "estimate_now_ms": fresh_estimate(profile, nodes, links, chosen["layout"]),
            "planner_now": layout_of(now),
            "links": {
                f"{a}-{b}": {"rtt_ms": lk.rtt_s * 1e3, "jitter_ms": lk.jitter_s * 1e3, "p95_ms": lk.tail_rtt_s * 1e3}
                for (a, b), lk in links.items()
                if a in plan_nodes and b in plan_nodes
            },
        }
        complete = best_by_subsets(profile, nodes, links)
        chosen["every_subset"] = complete and {
            "layout": layout_of(complete),
            "estimate_ms": complete["estimate_s"] * 1e3,
        }
        plans = to_force(view["plan"], now, complete)
        for row in plans:
            row["estimate_now_ms"] = fresh_estimate(profile, nodes, links, row["layout"])
        control = {"nodes": n, "first_plan_s": first, "plan": chosen["layout"], **rates, **loss_and_join(lab_, view)}
    for i, row in enumerate(plans):
        try:
            row.update(forced(hosts, model, figures, tmp / f"alt{i}", row["layout"], reference, tokens, repeats))
        except (AssertionError, OSError, subprocess.SubprocessError) as exc:  # one plan failing is a figure too
            row["error"] = str(exc)[-600:]
    out = {"chosen": chosen, "alternatives": plans, "control": control}
    if again:
        out["chosen_again"] = forced(hosts, model, figures, tmp / "again", chosen["layout"], reference, tokens, repeats)
    return out


def best_by_subsets(profile, nodes, links, most: int = 3) -> dict | None:
    """The planner's best plan over every subset of up to ``most`` nodes, by the same estimates: what
    a complete search would serve (the planner's own tries every subset only up to 5 nodes)."""
    best = None
    for k in range(1, most + 1):
        for subset in itertools.combinations(nodes, k):
            with contextlib.suppress(PlanError):
                got = make_plan(profile, list(subset), max_context=CONTEXT, links=links)
                best = got if best is None or got.estimate_s < best.estimate_s else best
    return best.to_dict() if best else None


def fresh_estimate(profile, nodes, links, layout: str) -> float | None:
    """A layout's estimate in ms per token by the figures measured now (None: it no longer fits)."""
    try:
        return pinned_plan(profile, nodes, layout, max_context=CONTEXT, links=links).estimate_s * 1e3
    except PlanError:
        return None


def forced(
    hosts: Sequence[Host], model: Path, figures: dict, tmp: Path, layout: str, reference: str, tokens: int, repeats: int
) -> dict:
    """One plan forced with ``plan_layout`` on a fresh lab, measured like the chosen one."""
    with lab(hosts, model, figures, tmp, {**ENV, "MESHNODE_PLAN_LAYOUT": layout}) as lab_:
        for h in hosts:
            lab_.start(h)
        view = lab_.cluster.wait(
            lambda: (v := converged(lab_)) and layout_of(v[0]["plan"]) == layout and v, 240, f"the plan {layout}"
        )[0]
        got = measure(lab_, view, reference, tokens, repeats)
        keep = ("p50_ms", "p95_ms", "gaps", "entry", "load_before", "load_after")
        return {k: got[k] for k in keep} | {"pinned_estimate_ms": got["estimate_ms"]}


def this_machine(model: Path, tmp: Path) -> tuple[dict, tuple[float, float]]:
    """This machine's compute figures for the model, measured once with nothing else of ours running."""
    layer_s, split_s = seed_figures(model, profile_model(model).num_layers, tmp / "seed", rounds=2, tensor=True)
    return json.loads((tmp / "seed" / "compute.json").read_text()), (layer_s, split_s)


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def report(out: dict) -> str:
    lines = [
        f"home lab, {out['regret_nodes']} hosts for the regret; this VM: 2 cores, each node under a CFS quota "
        "(its host's share of one core, 1 ms slices); figures are this VM's",
        table(
            ["host", "budget (of the model)", "CPU quota (of a core)", "link each way", "stands for"],
            [
                [h["name"], f"{h['budget']:.2f}", f"{h['quota']:.2f}", f"{h['delay_ms']:g} ± {h['jitter_ms']:g} ms"]
                + [h["stands_for"]]
                for h in out["lab"]
            ],
        ),
        f"this machine's figures at full speed: layer {out['layer_ms']:.3f} ms, "
        f"split two ways {out['split_ms']:.3f} ms",
        "",
    ]
    c = out["chosen"]
    head = ["plan", "strategy", "stages", "est. when planned", "est. now", "p50 ms", "p95 ms", "load"]
    rows = [
        ["**served**", c["strategy"], c["layout"], ms(c["estimate_ms"]), ms(c["estimate_now_ms"])]
        + [ms(c["p50_ms"]), ms(c["p95_ms"]), f"{c['load_before']:.1f}"]
    ]
    for a in out["alternatives"]:
        got = [ms(a["p50_ms"]), ms(a["p95_ms"]), f"{a['load_before']:.1f}"] if "p95_ms" in a else ["failed", "", ""]
        rows.append(
            [f"forced ({', '.join(a['sources'])})", a["strategy"], a["layout"]]
            + [ms(a.get("listed_estimate_ms")), ms(a["estimate_now_ms"]), *got]
        )
    if again := out.get("chosen_again"):
        rows.append(["served, pinned, last", c["strategy"], c["layout"], "", ms(again["pinned_estimate_ms"])])
        rows[-1] += [ms(again["p50_ms"]), ms(again["p95_ms"]), f"{again['load_before']:.1f}"]
    lines += [table(head, rows), ""]
    verdict = "within" if out["regret"] <= REGRET_TARGET else "OVER"
    lines += [
        f"regret: {out['regret'] * 100:.1f} % ({verdict} the {REGRET_TARGET * 100:.0f} % target) over "
        f"{sum('p95_ms' in a for a in out['alternatives'])} forced plans"
        + (
            f"; {out['regret_again'] * 100:.1f} % by the served plan measured again last"
            if out["regret_again"] is not None
            else ""
        ),
        f"served: {c['reason']}",
        f"the planner now, with the links measured: {c['planner_now']}",
        "the planner over every subset of up to 3 nodes: "
        + (
            f"{c['every_subset']['layout']} ({c['every_subset']['estimate_ms']:.1f} ms est.)"
            if c["every_subset"]
            else "-"
        ),
        "links of the served plan: "
        + "; ".join(f"{k} {v['rtt_ms']:.2f} ms (p95 {v['p95_ms']:.2f})" for k, v in sorted(c["links"].items())),
        "",
    ]
    errors = [f"{a['layout']}: {a['error']}" for a in out["alternatives"] if "error" in a]
    lines += [f"failed: {e}" for e in errors] + ([""] if errors else [])
    rows = [
        [
            k["nodes"],
            f"{k['first_plan_s']:.1f}",
            f"{k['replan_after_loss_s']:.1f}",
            f"{k['rejoined_s']:.1f}",
            "kept" if k["replanned_with_it_s"] is None else f"{k['replanned_with_it_s']:.1f}",
            f"{k['heartbeat_Bps_mean'] / 1e3:.1f} ({k['heartbeat_Bps_max'] / 1e3:.1f})",
            f"{k['wire_Bps_mean'] / 1e3:.1f} ({k['wire_Bps_max'] / 1e3:.1f})",
            f"{k['planner_ms_median']:.2f}",
        ]
        for k in out["control"]
    ]
    head = ["nodes", "first plan s", "re-plan after a loss s", "rejoined s", "a plan uses it again s"]
    head += ["heartbeats kB/s per node, mean (most)", "wire kB/s per node, mean (most)", "planner ms"]
    lines += [table(head, rows), f"wall time {out['wall_s'] / 60:.1f} min"]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick", action="store_true", help="6 hosts for the regret, 3 and 6 for the control plane, shorter answers"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "meshnode" / "bench")
    args = ap.parse_args()
    sizes, n = ((3, 6), 6) if args.quick else ((3, 6, 10), 10)
    tokens, repeats = (48, 1) if args.quick else (96, 2)
    model = model_dir_for(args.cache, "llama", **MODEL)
    reference = mlx_reference(model, MESSAGES, tokens)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="homelab-") as tmp_:
        tmp = Path(tmp_)
        figures, (layer_s, split_s) = this_machine(model, tmp)
        control = [control_lab(k, model, figures, tmp) for k in sizes if k != n]
        regret_run = regret_labs(n, model, figures, tmp, reference, tokens, repeats, again=not args.quick)
    control.append(regret_run["control"])
    for c in control:
        c.update(planner_time(model, LAB[: c["nodes"]], (layer_s, split_s)))
    chosen, alts, again = regret_run["chosen"], regret_run["alternatives"], regret_run.get("chosen_again")
    out = {
        "quick": args.quick,
        "regret_nodes": n,
        "tokens": tokens,
        "repeats": repeats,
        "lab": [asdict(h) for h in LAB],
        "layer_ms": layer_s * 1e3,
        "split_ms": split_s * 1e3,
        "chosen": chosen,
        "alternatives": alts,
        "chosen_again": again,
        "regret": regret(chosen["p95_ms"], [a["p95_ms"] for a in alts if "p95_ms" in a]),
        "regret_again": regret(again["p95_ms"], [a["p95_ms"] for a in alts if "p95_ms" in a]) if again else None,
        "control": sorted(control, key=lambda c: c["nodes"]),
        "wall_s": time.monotonic() - started,
    }
    text = report(out)
    print(text)
    name = "homelab_quick" if args.quick else "homelab"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(out, indent=1) + "\n")
    (args.out / f"{name}.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
