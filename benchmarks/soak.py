"""Issues 10 and 19 soak: nothing lost while nodes die, freeze, drop off the network, restart,
slow down, sit on a jittery link and have their memory taken back.

Five `meshnode run` processes (``--hosts``) on namespace hosts serve one model that needs two of
them (each node's budget holds 60% of it): a random-weight llama, or the real SmolLM2-135M
(``--model smollm2``); three clients in their own namespace send requests for the whole run, each
to a node picked at random, greedy or seeded sampling, streamed or not. Meanwhile one fault at a
time hits a node picked at random (the coordinator a third of the time): kill -9 and a restart
1-4 s later as launchd or systemd would do it, SIGSTOP then SIGCONT, link down then up, a
partition of two nodes from the rest then healed, a restart (SIGTERM, start again), 10 % of one
core for 12-20 s (a cgroup CPU quota: its owner's build), a Wi-Fi-like link of 4 +- 4 ms for
8-15 s (harness/jitter.py), and its memory cgroup limited to what it uses plus 256 MiB for
5-10 s (a browser taking memory back). Nodes plan around slow nodes and watch their memory here,
as installed ones do; the last two kinds run where the cgroup controllers exist.

Every request ends as one of:
- identical: 200 and exactly the text of the reference (mlx_lm.generate for greedy requests; the
  same seeded request on the quiet mesh before any fault for sampled ones);
- explicit 503: a 503 with Retry-After, or a stream that ends with an error event, while the
  capacity was gone (what a client retries);
- node down: the connection to the node the client talked to was refused or dropped while that
  node was killed or restarting (docs/failover.md says so: a client's own node is its single point);
- lost (a connection dropped by a node that was not faulted, a stream cut short without an error
  event, or a wrong text), hung (no answer within 120 s), HTTP 500.
Lost, hung and 500 must be 0; the script exits 1 otherwise.

    sudo .venv/bin/python -m benchmarks.soak [--minutes 60] [--seed 1] [--hosts 6] [--model smollm2]
                                             [--out benchmarks/results]

tests/test_soak.py runs it for 5 minutes in CI.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness import cpulimit, memlimit  # noqa: E402
from harness.cluster import HTTP, Cluster, mlx_reference  # noqa: E402
from harness.netns import netns_mesh  # noqa: E402
from meshnode.model.build import build_model  # noqa: E402
from meshnode.model.compute import seed_figures  # noqa: E402
from meshnode.weights.profile import profile_model  # noqa: E402

HOSTS = 5
CLIENTS = 3
MESSAGES = [{"role": "user", "content": "Tell me a story about the sea and the rivers."}]
MAX_TOKENS = 24
SEEDS = (7, 20261125)  # the seeded-sampling requests
TIMEOUT = 120.0  # a request with no answer by then is hung
MIB = 2**20
SLOW = 0.1  # of one core, while a slowdown lasts
WIFI = (4.0, 4.0)  # ms each way, and its jitter, while a jitter fault lasts
HEADROOM = 256 * MIB  # what a squeezed node may still allocate: under its margin
# Slow-node planning and the memory watch on, with dwells short enough for a fault to reach them.
ENV = {
    "MESHNODE_SLOW_FACTOR": "3",
    "MESHNODE_SLOW_DWELL": "5",
    "MESHNODE_MEMORY_MARGIN": str(384 * MIB),
    "MESHNODE_MEMORY_DWELL": "5",
}
KINDS = ("kill", "freeze", "link", "partition", "restart", "slow", "jitter", "squeeze")

# One client: requests until the deadline, each to a random node; one JSON line per request:
# {"t0", "t1", "node", "kind", "stream", "outcome", "detail", "text"}.
CLIENT = r"""
import json, random, socket, sys, time, urllib.error, urllib.request
ips, model, until, seed, timeout = (json.loads(sys.argv[1]), sys.argv[2], float(sys.argv[3]), int(sys.argv[4]),
                                    float(sys.argv[5]))
kinds, max_tokens, messages = json.loads(sys.argv[6]), int(sys.argv[7]), json.loads(sys.argv[8])
rng = random.Random(seed)
while time.time() < until:
    node, ip = rng.choice(sorted(ips.items()))
    kind, stream = rng.choice(kinds), rng.random() < 0.5
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if kind != "greedy":
        body.update(temperature=0.9, top_p=0.95, seed=int(kind))
    req = urllib.request.Request("http://%s:%d/v1/chat/completions" % (ip, %(port)d), data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.time(); outcome, detail, text = None, None, ""
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            if not stream:
                text, outcome = json.loads(r.read())["choices"][0]["message"]["content"], "ok"
            else:
                outcome = "truncated"
                for line in r:
                    line = line.strip()
                    if line == b"data: [DONE]":
                        outcome = "ok" if outcome == "truncated" else outcome
                        break
                    if not line.startswith(b"data: "):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        outcome, detail = "error_event", event["error"].get("code")
                        continue
                    for choice in event["choices"]:
                        text += choice["delta"].get("content") or ""
    except urllib.error.HTTPError as e:
        outcome, detail = e.code, e.headers.get("Retry-After")
    except (socket.timeout, TimeoutError):
        outcome = "hung"
    except Exception as e:
        outcome, detail = "conn", repr(e)[:200]
    print(json.dumps({"t0": t0, "t1": time.time(), "node": node, "kind": kind, "stream": stream,
                      "outcome": outcome, "detail": detail, "text": text}), flush=True)
    time.sleep(rng.uniform(0.05, 0.5))
"""


def soak_model(name: str, tmp: Path) -> Path:
    """The model folder: a random-weight llama, or SmolLM2-135M converted as a node converts it."""
    if name == "smollm2":
        from tests.realmodel import converted, fetch_smollm2

        return converted(fetch_smollm2(), Path.home() / ".cache" / "meshnode" / "soak")[1]
    return build_model(
        tmp / "llama", "llama", num_layers=8, hidden_size=128, intermediate_size=256, dtype="float32", seed=3
    )


def fault_kinds() -> tuple[str, ...]:
    """The kinds this machine can inject: CPU quotas and memory limits need their cgroup controllers."""
    missing = {"slow": cpulimit.available(), "squeeze": memlimit.available()}
    return tuple(k for k in KINDS if missing.get(k) is None)


class Soak:
    def __init__(self, mesh, tmp: Path, rng: random.Random, model: str = "llama"):
        self.mesh, self.tmp, self.rng = mesh, tmp, rng
        self.model = soak_model(model, tmp)
        seed = tmp / "seed"
        seed.mkdir()
        seed_figures(self.model, profile_model(self.model).num_layers, seed, rounds=1)
        self.budget = int(profile_model(self.model).total_bytes(512) * 0.6)
        for h in mesh.hosts:  # a node reads its own memory cgroup's limit, as on a real machine
            h.machine_sysfs = True
        self.cluster = Cluster(mesh, self.model, tmp, seed=seed)
        for h in self.cluster.hosts:
            self.start(h)
        self.kinds = fault_kinds()
        self.faults: list[dict] = []  # {"kind", "node", "t0", "t1"}

    def start(self, host) -> None:
        self.cluster.start(host, self.budget, env=ENV)

    def converge(self, timeout: float = 90) -> dict:
        hosts = self.cluster.hosts
        return self.cluster.wait(lambda: self.cluster.converged(hosts, len(hosts)), timeout, "the mesh settles")[0]

    def coordinator(self) -> str | None:
        for h in self.rng.sample(self.cluster.hosts, len(self.cluster.hosts)):
            try:
                return self.cluster.mesh_view(h)["coordinator"]
            except OSError:
                continue
        return None

    def references(self) -> dict[str, str]:
        refs = {"greedy": mlx_reference(self.model, MESSAGES, MAX_TOKENS)}
        host = self.cluster.hosts[0]
        for s in SEEDS:
            body = {
                "model": self.model.name,
                "messages": MESSAGES,
                "max_tokens": MAX_TOKENS,
                "temperature": 0.9,
                "top_p": 0.95,
                "seed": s,
            }
            status, _, out = self.cluster.fetch(f"http://{host.ip}:{HTTP}/v1/chat/completions", body, timeout=60)
            assert status == 200, out
            refs[str(s)] = out["choices"][0]["message"]["content"]
        return refs

    def clients(self, seconds: float) -> list:
        ips = {h.name: h.ip for h in self.cluster.hosts}
        kinds = ["greedy", "greedy", *map(str, SEEDS)]
        until = time.time() + seconds
        code = CLIENT.replace("%(port)d", str(HTTP))
        return [
            subprocess.Popen(
                self.cluster.client.exec_args(
                    [
                        sys.executable,
                        "-c",
                        code,
                        json.dumps(ips),
                        self.model.name,
                        str(until),
                        str(self.rng.randrange(2**31)),
                        str(TIMEOUT),
                        json.dumps(kinds),
                        str(MAX_TOKENS),
                        json.dumps(MESSAGES),
                    ]
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(CLIENTS)
        ]

    def fault(self) -> None:
        """One fault on one node (the coordinator a third of the time), undone after a while."""
        rng, cluster, mesh = self.rng, self.cluster, self.mesh
        kind = rng.choice(self.kinds)
        coordinator = self.coordinator() if rng.random() < 1 / 3 else None
        victim = cluster.host(coordinator) if coordinator else rng.choice(cluster.hosts)
        record = {"kind": kind, "node": victim.name, "t0": time.time()}
        hold = rng.uniform(1, 4)
        if kind == "kill":
            mesh.kill(cluster.procs[victim.name])
            time.sleep(hold)
            self.start(victim)  # the service manager restarts it
            record["listening"] = self.listening(victim)
        elif kind == "restart":
            mesh.stop(cluster.procs[victim.name])
            self.start(victim)
            record["listening"] = self.listening(victim)
        elif kind == "slow":
            with cpulimit.cpu_limited(cluster.procs[victim.name].pid, SLOW):
                time.sleep(rng.uniform(12, 20))
        elif kind == "jitter":
            mesh.delay(victim, *WIFI)
            time.sleep(rng.uniform(8, 15))
            mesh.undelay(victim)
        elif kind == "squeeze":
            proc = cluster.procs[victim.name]
            with memlimit.memory_cgroup(proc.pid) as cgroup:
                cgroup.squeeze(HEADROOM)
                time.sleep(rng.uniform(5, 10))
                record["oom_kills"] = cgroup.oom_kills()
                cgroup.lift()
        elif kind == "freeze":
            mesh.freeze(cluster.procs[victim.name])
            time.sleep(hold)
            mesh.thaw(cluster.procs[victim.name])
        elif kind == "link":
            victim.link_down()
            time.sleep(hold)
            victim.link_up()
        else:  # two nodes (the victim and one more) from the other three
            pair = [victim, rng.choice([h for h in cluster.hosts if h is not victim])]
            rest = [h for h in cluster.hosts if h not in pair]
            record["node"] = "+".join(h.name for h in pair)
            for side, other in ((pair, rest), (rest, pair)):
                for h in side:
                    h.cut_off([o.ip for o in other])
            time.sleep(rng.uniform(3, 8))
            for h in cluster.hosts:
                h.rejoin()
        record["t1"] = time.time()
        self.faults.append(record)

    def listening(self, host, timeout: float = 60) -> float:
        """When the restarted node's HTTP port answers again (any status)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.cluster.fetch(f"http://{host.ip}:{HTTP}/health", timeout=2)
                break
            except (OSError, ValueError):
                time.sleep(0.2)
        return time.time()

    def node_down(self, r: dict) -> bool:
        """Whether the request's own node was killed or restarting while it ran: from the fault
        until the restarted node listened again."""
        return any(
            f["kind"] in ("kill", "restart")
            and f["node"] == r["node"]
            and f["t0"] - 1 <= r["t1"]
            and r["t0"] <= f["listening"] + 1
            for f in self.faults
        )


def classify(results: list[dict], refs: dict[str, str], soak: Soak) -> dict:
    counts = {
        "requests": len(results),
        "identical": 0,
        "explicit_503": 0,
        "node_down": 0,
        "lost": 0,
        "hung": 0,
        "http_500": 0,
        "oom_kills": sum(f.get("oom_kills", 0) for f in soak.faults),
    }
    bad = []
    for r in results:
        out = r["outcome"]
        if out == "ok" and r["text"] == refs[r["kind"]]:
            counts["identical"] += 1
        elif out == 503 or (
            out == "error_event" and r["detail"] in ("placement_lost", "mesh_unavailable", "insufficient_capacity")
        ):
            counts["explicit_503"] += 1
        elif out == "hung":
            counts["hung"] += 1
            bad.append(r)
        elif isinstance(out, int) and out >= 500:
            counts["http_500"] += 1
            bad.append(r)
        elif out in ("conn", "truncated") and soak.node_down(r):
            counts["node_down"] += 1
        else:
            counts["lost"] += 1
            bad.append(r)
    return {**counts, "bad": bad[:10]}


def soak(
    minutes: float, seed: int, log=print, *, hosts: int = HOSTS, model: str = "llama", keep_logs: Path | None = None
) -> dict:
    """Run the soak; its report (counts, faults, the first bad requests). ``keep_logs``: a folder
    that gets every node's whole log and the clients' request lines."""
    rng = random.Random(seed)
    seconds = minutes * 60
    with tempfile.TemporaryDirectory(prefix="meshnode-soak-") as tmp, netns_mesh(hosts, "soak") as mesh:
        run = Soak(mesh, Path(tmp), rng, model)
        start_view = run.converge(180)
        refs = run.references()
        log(
            f"{hosts} hosts, {run.model.name}, plan {[s['nodes'] for s in start_view['plan']['stages']]}, "
            f"{CLIENTS} clients, {minutes:g} min, seed {seed}, faults {', '.join(run.kinds)}"
        )
        started = time.time()
        clients = run.clients(seconds)
        while time.time() < started + seconds - 10:
            time.sleep(rng.uniform(3, 8))
            if time.time() >= started + seconds - 10:
                break
            run.fault()
            f = run.faults[-1]
            log(f"{f['t0'] - started:7.1f} s  {f['kind']:9s} {f['node']}")
        results = []
        for c in clients:
            out, err = c.communicate(timeout=TIMEOUT + 60)
            results += [json.loads(line) for line in out.splitlines() if line.strip()]
            if c.returncode:
                log(err[-2000:])
        final = run.converge(180)
        if keep_logs is not None:
            keep_logs.mkdir(parents=True, exist_ok=True)
            for h in run.cluster.hosts:
                if run.cluster.log_path(h).exists():
                    shutil.copy(run.cluster.log_path(h), keep_logs / f"{h.name}.log")
            (keep_logs / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
        report = classify(results, refs, run)
        report.update(
            minutes=minutes,
            seed=seed,
            hosts=hosts,
            model=run.model.name,
            faults=len(run.faults),
            fault_kinds={k: sum(f["kind"] == k for f in run.faults) for k in KINDS},
            epochs=[start_view["epoch"], final["epoch"]],
        )
        line = ", ".join(
            f"{k} {report[k]}"
            for k in ("requests", "identical", "explicit_503", "node_down", "lost", "hung", "http_500", "oom_kills")
        )
        log(f"soak: {line}; {report['faults']} faults {report['fault_kinds']}; epochs {report['epochs']}")
        for r in report["bad"]:
            log(f"  bad: {json.dumps(r)}")
        if report["bad"]:
            report["logs"] = run.cluster.logs()[-30000:]
        return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--hosts", type=int, default=HOSTS)
    ap.add_argument("--model", choices=("llama", "smollm2"), default="llama", help="random weights, or the real model")
    ap.add_argument("--out", type=Path, default=None, help="write soak.json, and the nodes' logs under logs/, here")
    args = ap.parse_args()
    report = soak(
        args.minutes,
        args.seed,
        log=lambda line: print(line, flush=True),
        hosts=args.hosts,
        model=args.model,
        keep_logs=args.out / "logs" if args.out else None,
    )
    if report.get("logs"):
        print(report["logs"])
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "soak.json").write_text(json.dumps(report, indent=1))
    clean = report["lost"] == report["hung"] == report["http_500"] == report["oom_kills"] == 0
    return 0 if clean and report["identical"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
