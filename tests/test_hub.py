"""Models from the Hugging Face Hub, offline: a loopback stand-in for the Hub (tests/hubstandin.py)
serves model folders to huggingface_hub (``HF_ENDPOINT``), and a node started with a Hub id
downloads only the small files, profiles the model from the weight files' headers (HTTP ranges),
then downloads only the weight files holding its layers, resuming a cut-off download.

The node's Hub path runs in a subprocess per step (huggingface_hub reads ``HF_ENDPOINT`` and
``HF_HOME`` when it is imported), as a node does: :func:`meshnode.weights.modelsource.resolve_model`, then
:meth:`meshnode.weights.sourcing.LayerSource.folder` with no peer.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

from meshnode.model.build import build_model
from meshnode.weights.manifest import build_manifest, tensors_for_layers
from meshnode.weights.profile import profile_model
from tests.hubstandin import HubStandIn, hub_env

ROOT = Path(__file__).resolve().parents[1]
REPO = "owner/tiny-llama"

# One step of a node's Hub path: ("meta",) resolves the model; ("layers", s, e) also gets a folder
# holding layers [s, e) from LayerSource with no peer. Prints one JSON line.
_STEP = r"""
import asyncio, json, logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from meshnode.weights.profile import profile_model
from meshnode.weights.sourcing import LayerSource
from meshnode.weights.store import ModelStore
from meshnode.weights.modelsource import resolve_model

args = json.loads(sys.argv[1])
cache = Path(args["cache"])
model_id, path = resolve_model(args["model"], cache)
profile = profile_model(path, model_id)
out = {"meta": str(path), "profile": profile.to_dict()}
if args.get("layers"):
    start, end = args["layers"]
    progress = []
    source = LayerSource(model_id, path, cache / "peer-models", ModelStore(cache / "peer-models"), profile.num_layers)
    folder = asyncio.run(source.folder(start, end, [], on_progress=lambda d, n: progress.append((d, n))))
    out.update(folder=str(folder), progress=progress)
print(json.dumps(out))
"""


def hub_step(endpoint: str, home: Path, **args) -> dict:
    env = {**os.environ, **hub_env(endpoint, home / "hf"), "TMPDIR": os.environ.get("TMPDIR", "/tmp")}
    r = subprocess.run(
        [sys.executable, "-c", _STEP, json.dumps({"model": REPO, "cache": str(home / "cache"), **args})],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return {**json.loads(r.stdout.strip().splitlines()[-1]), "log": r.stderr}


def weight_blobs(home: Path) -> dict[str, int]:
    """sha256 -> size of every file bigger than 100 kB on ``home``'s disk (weight files: config and
    tokenizer files are smaller), in its meshnode cache and its Hugging Face cache; not its prompt
    cache, whose entries grow with the layers a stage holds."""
    out = {}
    for blob in [*(home / "cache").rglob("*"), *(home / "hf").rglob("*")]:
        if "prompt-cache" in blob.parts:
            continue
        if blob.is_file() and not blob.is_symlink() and blob.stat().st_size > 100_000:
            out[sha256(blob)] = blob.stat().st_size
    return out


def stage_files(model: Path, start: int, end: int) -> set[str]:
    """The weight files of the whole model that hold a tensor a stage [start, end) needs."""
    m = build_manifest(model, REPO)
    return {p for p, _ in tensors_for_layers(m, start, end, profile_model(model).num_layers)}


def test_weight_blobs_leave_out_the_prompt_cache(tmp_path):
    """A stage of five layers of the tiny llama writes a prompt-cache entry over 100 kB (seen in CI
    when a busy machine's compute figures moved the split): it is not a downloaded weight file."""
    (tmp_path / "cache" / "hub-blobs").mkdir(parents=True)
    (tmp_path / "cache" / "prompt-cache" / "m" / "k").mkdir(parents=True)
    (tmp_path / "cache" / "hub-blobs" / "w").write_bytes(b"w" * 200_000)
    (tmp_path / "cache" / "prompt-cache" / "m" / "k" / "layers-0-5.safetensors").write_bytes(b"k" * 200_000)
    assert list(weight_blobs(tmp_path)) == [sha256(tmp_path / "cache" / "hub-blobs" / "w")]


def adopted_stages(log: str, node: str) -> list[tuple[int, int]]:
    """Every stage ``node`` was given, in the order of the epochs its log says it adopted: a mesh
    forming under load may publish a plan and then, the same second, another one."""
    stages = []
    for line in log.splitlines():
        if " adopted (from " in line:
            for start, end, nodes in re.findall(r"\[(\d+),(\d+)\)@([\w+-]+)", line.split("): ", 1)[1]):
                if node in nodes.split("+") and (int(start), int(end)) not in stages:
                    stages.append((int(start), int(end)))
    return stages


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """6 layers in 7 weight files of ~1 MB (layers straddle files)."""
    return build_model(
        tmp_path_factory.mktemp("hub") / "tiny-llama",
        "llama",
        num_layers=6,
        hidden_size=128,
        intermediate_size=512,
        dtype="float32",
        seed=11,
        max_file_size_mb=1,
    )


def _shard_out(folder: Path, start: int, end: int, x: mx.array) -> mx.array:
    from meshnode.model.shard import Shard

    shard = Shard(folder, start, end)
    out = shard.forward(x, shard.make_cache())
    mx.eval(out)
    return out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_small_files_first_then_only_a_stage_files(model, tmp_path):
    whole_weights = sorted(p.name for p in model.glob("model*.safetensors"))
    assert len(whole_weights) >= 5
    sizes = {p.name: p.stat().st_size for p in model.glob("*")}
    with HubStandIn({REPO: model}) as hub:
        # Start-up: small files whole, weight files only as header ranges; profile = the local one.
        meta = hub_step(hub.endpoint, tmp_path / "a")
        for name in whole_weights:
            gets = hub.gets("/" + name)
            assert gets and all(r.range and r.range.startswith("bytes=0-") for r in gets), gets
            assert sum(r.sent for r in gets) <= 64 * 1024 < sizes[name]
        assert weight_blobs(tmp_path / "a") == {}
        expected = profile_model(model, REPO).to_dict()
        assert meta["profile"] == expected
        meta_dir = Path(meta["meta"])
        assert not list(meta_dir.glob("*.safetensors"))
        assert (meta_dir / "tokenizer.json").is_file() and (meta_dir / "meshnode-partial.json").is_file()

        # A middle stage: exactly the files holding layers 2..3; a last stage: plus norm and head.
        for home, (start, end) in ((tmp_path / "a", (2, 4)), (tmp_path / "b", (4, 6))):
            n_before = len(hub.requests)
            got = hub_step(hub.endpoint, home, layers=[start, end])
            want = stage_files(model, start, end)
            assert 0 < len(want) < len(whole_weights)
            full = {
                r.path.rsplit("/", 1)[1]
                for r in hub.requests[n_before:]
                if r.method == "GET" and "/resolve/" in r.path and r.range is None and r.path.endswith(".safetensors")
            }
            assert full == want, (start, end, full, want)
            assert sorted(weight_blobs(home).values()) == sorted(sizes[f] for f in want)
            folder = Path(got["folder"])
            assert {p.name for p in folder.glob("*.safetensors")} == want
            for f in want:
                assert sha256(folder / f) == sha256(model / f)
            total = sum(sizes[f] for f in want)
            assert got["progress"] and got["progress"][-1] == [total, total]
            assert all(d <= n == total for d, n in got["progress"])
            assert "downloading layers" in got["log"]
            marker = json.loads((folder / "meshnode-partial.json").read_text())
            assert (marker["start"], marker["end"], marker["model_id"]) == (start, end, REPO)

    # The partial folders load through Shard and compute what the whole model computes.
    x = mx.random.normal((1, 5, 128), key=mx.random.key(3)).astype(mx.float32)
    for start, end, home in ((2, 4, "a"), (4, 6, "b")):
        folder = next((tmp_path / home / "cache" / "peer-models").glob(f"*-{start}-{end}"))
        ours, ref = _shard_out(folder, start, end, x), _shard_out(model, start, end, x)
        assert ours.shape == ref.shape
        assert mx.array_equal(ours, ref).item(), (start, end)


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    """Two layers of ~27 MB, one file each: bigger than huggingface_hub's 10 MB read chunk, so a
    body cut off halfway leaves whole chunks on disk to resume after."""
    return build_model(
        tmp_path_factory.mktemp("hub-big") / "big-llama",
        "llama",
        num_layers=2,
        hidden_size=512,
        intermediate_size=4096,
        num_heads=8,
        num_kv_heads=4,
        dtype="float32",
        seed=12,
        max_file_size_mb=30,
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cut_off_download_resumes(big_model, tmp_path):
    want = stage_files(big_model, 1, 2)
    target = max(want, key=lambda f: (big_model / f).stat().st_size)
    size = (big_model / target).stat().st_size
    assert size > 20 * 2**20
    with HubStandIn({REPO: big_model}) as hub:
        hub.cut_once.add(target)
        t0 = time.monotonic()
        got = hub_step(hub.endpoint, tmp_path, layers=[1, 2])
        took = time.monotonic() - t0
        gets = [r for r in hub.gets("/" + target) if not (r.range or "").startswith("bytes=0-65535")]
    assert [r.status for r in gets][:1] == [-1], gets  # the first body was cut off ...
    assert 0 < gets[0].sent < size
    resumed = gets[1]  # ... and the next request asked for the rest only
    assert resumed.range and resumed.range.startswith("bytes=") and int(resumed.range[6:].split("-")[0]) > 0, gets
    assert resumed.status == 206
    assert size <= sum(r.sent for r in gets) < size + 2**20  # at most the read chunk in flight twice
    folder = Path(got["folder"])
    assert sha256(folder / target) == sha256(big_model / target)
    assert "resum" in got["log"].lower()
    assert not list((tmp_path / "cache").rglob("*.part"))

    # A node killed mid-download leaves the bytes it got; restarted, it asks for the rest only.
    home = tmp_path / "restarted"
    blobs = home / "cache" / "hub-blobs"
    blobs.mkdir(parents=True)
    half = (big_model / target).read_bytes()[: size // 2]
    (blobs / f"{sha256(big_model / target)}.part").write_bytes(half)
    with HubStandIn({REPO: big_model}) as hub:
        got = hub_step(hub.endpoint, home, layers=[1, 2])
        gets = [r for r in hub.gets("/" + target) if not (r.range or "").startswith("bytes=0-65535")]
    assert [(r.range, r.status, r.sent) for r in gets] == [(f"bytes={len(half)}-", 206, size - len(half))]
    assert sha256(Path(got["folder"]) / target) == sha256(big_model / target)
    print(f"cut-off download of {size / 2**20:.1f} MiB resumed; step took {took:.1f} s")


# ---------------------------------------------------------------------------------------------
# Real nodes on namespace hosts, the stand-in on the mesh's client host.

MESSAGES = [{"role": "user", "content": "Tell me a story about the sea."}]
MAX_TOKENS = 40
HUB_PORT = 8900


@pytest.mark.netns
@pytest.mark.timeout(240)
def test_two_hosts_each_download_only_their_stage(model, tmp_path):
    from harness.cluster import Cluster, mlx_reference
    from harness.netns import netns_mesh

    reference = mlx_reference(model, MESSAGES, MAX_TOKENS)
    total = profile_model(model).total_bytes(512)
    all_files = {p.name for p in model.glob("model*.safetensors")}
    with netns_mesh(2) as mesh:
        cluster = Cluster(mesh, model, tmp_path)
        hub_log = tmp_path / "hub.jsonl"
        standin = cluster.client.popen(
            [
                sys.executable,
                "-m",
                "tests.hubstandin",
                "--host",
                cluster.client.ip,
                "--port",
                str(HUB_PORT),
                "--log",
                str(hub_log),
                f"{REPO}={model}",
            ],
            env={**os.environ},
            log_path=tmp_path / "hub.out",
            cwd=ROOT,
        )
        until = time.monotonic() + 30
        while "ready" not in ((tmp_path / "hub.out").read_text() if (tmp_path / "hub.out").exists() else ""):
            assert standin.poll() is None and time.monotonic() < until, (tmp_path / "hub.out").read_text()
            time.sleep(0.2)
        endpoint = f"http://{cluster.client.ip}:{HUB_PORT}"
        for h in cluster.hosts:
            # Two stages, pinned: "auto" may estimate a tensor pair faster from links measured on a busy
            # machine, and compute measured under load may move the split, after which a node keeps the
            # files of its earlier stage as a cache (so the figures below would be of two plans).
            stay = {"MESHNODE_STRATEGY": "pipeline", "MESHNODE_REBALANCE_DWELL": "600"}
            cluster.start(h, int(total * 0.6), model=REPO, env={**hub_env(endpoint, tmp_path / h.name / "hf"), **stay})
        views = cluster.wait(lambda: cluster.converged(cluster.hosts, 2, stages=2), 150, "convergence")
        stages = views[0]["plan"]["stages"]
        assert len(stages) == 2, views[0]["plan"]
        from harness.cluster import HTTP

        body = {"model": REPO, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}
        for h in cluster.hosts:  # either node serves it, through both stages
            status, _, out = cluster.fetch(f"http://{h.ip}:{HTTP}/v1/chat/completions", body, timeout=60)
            assert status == 200, out
            assert out["choices"][0]["message"]["content"] == reference
        assert cluster.mesh_view(cluster.hosts[0])["plan"]["stages"] == stages, "the plan moved during the test"
        requests = [json.loads(line) for line in hub_log.read_text().splitlines()]
        for h in cluster.hosts:
            stage = next(s for s in stages if h.name in s["nodes"])
            given = adopted_stages(cluster.log(h), h.name)
            assert given[-1] == (stage["start_layer"], stage["end_layer"]), given
            want = set().union(*(stage_files(model, start, end) for start, end in given))
            assert 0 < len(want) < len(all_files)
            # On its disk: the weight files of the stages it was given, nothing else.
            assert set(weight_blobs(tmp_path / h.name)) == {sha256(model / f) for f in want}, h.name
            # Over the wire: those files whole, the others' headers only.
            full = {
                r["path"].rsplit("/", 1)[1]
                for r in requests
                if r["remote"] == h.ip
                and r["method"] == "GET"
                and r["path"].endswith(".safetensors")
                and not (r["range"] or "").startswith("bytes=0-65535")
            }
            assert full == want, (h.name, full, want)
            assert "downloading layers" in cluster.log(h), cluster.log(h)[-3000:]
            me = next(n for n in cluster.mesh_view(h)["nodes"] if n["node_id"] == h.name)
            assert [stage["start_layer"], stage["end_layer"]] in me["holdings"][0]["layers"], me["holdings"]
