"""Models from peers on real nodes in network namespaces: only one host holds the model on
disk; the others start from its id alone, fetch its metadata and exactly their layers over
authenticated gRPC, and the mesh answers as mlx_lm.generate does."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from harness.cluster import Cluster, mlx_reference, read_stream
from harness.netns import netns_mesh
from meshnode.model.build import build_model
from meshnode.weights.profile import profile_model
from meshnode.weights.weightfiles import read_safetensors_header

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]

MESSAGES = [{"role": "user", "content": "Tell me a story about the sea."}]
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(
        tmp_path_factory.mktemp("transfer") / "llama",
        "llama",
        num_layers=9,
        hidden_size=128,
        intermediate_size=512,
        dtype="float32",
        seed=5,
    )


@pytest.fixture(scope="module")
def reference(model):
    return mlx_reference(model, MESSAGES, MAX_TOKENS)


def weights_on_disk(state: Path) -> int:
    return sum(f.stat().st_size for f in (state / "cache").rglob("*.safetensors"))


def stage_of(view, node):
    return next((s["start_layer"], s["end_layer"]) for s in view["plan"]["stages"] if node in s["nodes"])


def test_three_hosts_one_holds_the_model(model, reference, tmp_path):
    total = profile_model(model).total_bytes(512)
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    with netns_mesh(3) as mesh:
        cluster = Cluster(mesh, model, tmp_path)
        holder, *others = cluster.hosts
        pipeline = {"MESHNODE_STRATEGY": "pipeline"}  # three stages is the premise; "auto" may pick hybrid
        cluster.start(holder, int(total * 0.4), env=pipeline)
        for h in others:
            cluster.start(h, int(total * 0.4), model=model.name, env=pipeline)
        views = cluster.wait(lambda: cluster.converged(cluster.hosts, 3), 120, "convergence")
        view = views[0]
        assert len(view["plan"]["stages"]) == 3, view["plan"]
        text = cluster.chat(cluster.host(view["plan"]["stages"][-1]["nodes"][0]), MESSAGES, MAX_TOKENS)
        assert text == reference
        for h in others:
            start, end = stage_of(view, h.name)
            on_disk = weights_on_disk(tmp_path / h.name)
            assert 0 < on_disk < 0.75 * weights, (h.name, on_disk, weights)
            me = next(n for n in cluster.mesh_view(h)["nodes"] if n["node_id"] == h.name)
            assert [start, end] in me["holdings"][0]["layers"], me["holdings"]
            assert me["holdings"][0]["complete"] is False
        holder_view = next(n for n in view["nodes"] if n["node_id"] == holder.name)
        assert holder_view["holdings"][0]["complete"] is True
        log = cluster.log(others[0])
        assert "fetched layers" in log


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    """~100 MB of float32 weights, so that a throttled transfer takes seconds."""
    return build_model(
        tmp_path_factory.mktemp("transfer-big") / "llama",
        "llama",
        num_layers=8,
        hidden_size=512,
        intermediate_size=1536,
        num_heads=8,
        num_kv_heads=4,
        dtype="float32",
        seed=6,
    )


def _fetching(cluster, host):
    """h's fetch progress once some tensors are in (verified and journaled) and many are not."""
    p = cluster.mesh_view(host)["progress"]
    return p if p and p["task"].startswith("fetching") and 0.2 * p["total"] < p["done"] < 0.7 * p["total"] else None


def _two_sources_one_fetcher(mesh, cluster, total):
    """a and b hold the model; c (largest budget) does not; the plan is {a, c}: c fetches from a
    and b at once. Both sources send at 80 Mbit/s, so the transfer lasts seconds. Returns once c
    is fetching."""
    a, b, c = cluster.hosts
    for h in (a, b):
        mesh.shape(h, rate="80mbit", burst="256kbit")
    cluster.start(a, int(total * 0.3))
    cluster.start(b, int(total * 0.3))
    cluster.start(c, int(total * 0.75), model=cluster.model.name)
    cluster.wait(lambda: _fetching(cluster, c), 90, "c fetching its layers")
    return a, b, c


def test_source_killed_mid_transfer_completes_from_the_other(big_model, tmp_path):
    total = profile_model(big_model).total_bytes(512)
    with netns_mesh(3) as mesh:
        cluster = Cluster(mesh, big_model, tmp_path)
        a, b, c = _two_sources_one_fetcher(mesh, cluster, total)
        mesh.kill(cluster.procs[b.name])
        views = cluster.wait(lambda: cluster.converged([a, c], 2), 120, "a and c serving")
        assert {s["nodes"][0] for s in views[0]["plan"]["stages"]} == {a.name, c.name}
        log = cluster.log(c)
        assert "fetched layers" in log, cluster.logs()
        start, end = stage_of(views[0], c.name)
        assert f"layers [{start}, {end})" in log
        text = cluster.chat(a if views[0]["plan"]["stages"][-1]["nodes"][0] == a.name else c, MESSAGES, 8)
        assert isinstance(text, str)


def test_restarted_node_resumes_its_transfer(big_model, tmp_path):
    total = profile_model(big_model).total_bytes(512)
    with netns_mesh(3) as mesh:
        cluster = Cluster(mesh, big_model, tmp_path)
        a, b, c = _two_sources_one_fetcher(mesh, cluster, total)
        mesh.kill(cluster.procs[c.name])
        partial = list((tmp_path / c.name / "cache" / "peer-models").glob("*.partial"))
        assert partial, "no partial folder left to resume from"
        cluster.log_path(c).rename(tmp_path / c.name / "first.log")
        cluster.start(c, int(total * 0.75), model=big_model.name)
        cluster.wait(lambda: cluster.converged([a, b, c], 3), 120, "the mesh serving again")
        log = cluster.log(c)
        here = [
            float(line.split(" MiB already here")[0].rsplit(", ", 1)[-1])
            for line in log.splitlines()
            if "MiB already here" in line
        ]
        assert here and here[0] > 0, log[-3000:]  # the first fetch of the new process starts from the old one's
        assert "fetched layers" in log


def _corrupt_layers(model_dir: Path, layers: range) -> int:
    """Flip one byte of every tensor of ``layers`` in place, keeping size and mtime, so the cached
    manifest still vouches for the old bytes (bit rot after hashing): the peer serves bad data."""
    from meshnode.weights.manifest import build_manifest
    from meshnode.weights.weightfiles import read_safetensors_header, weight_files

    build_manifest(model_dir, model_dir.name)  # cached now, with the good digests
    flipped = 0
    for wf in weight_files(model_dir):
        st = wf.stat()
        with open(wf, "rb") as f:
            base = 8 + int.from_bytes(f.read(8), "little")
        with open(wf, "r+b") as f:
            for name, info in read_safetensors_header(wf).items():
                if any(f"layers.{i}." in name for i in layers):
                    f.seek(base + int(info["data_offsets"][0]) + 5)
                    byte = f.read(1)
                    f.seek(-1, 1)
                    f.write(bytes([byte[0] ^ 0xFF]))
                    flipped += 1
        os.utime(wf, ns=(st.st_atime_ns, st.st_mtime_ns))
    return flipped


def test_corrupted_tensor_detected_refetched_elsewhere_logged(big_model, tmp_path):
    from mlx_lm import generate, load

    copy = tmp_path / "copy" / big_model.name
    shutil.copytree(big_model, copy)
    assert _corrupt_layers(copy, range(0, 8)) > 0
    m, tok = load(str(big_model))
    expected = generate(m, tok, prompt=tok.apply_chat_template(MESSAGES, add_generation_prompt=True), max_tokens=8)
    del m
    total = profile_model(big_model).total_bytes(512)
    with netns_mesh(3) as mesh:
        cluster = Cluster(mesh, big_model, tmp_path)
        a, b, c = cluster.hosts
        cluster.start(a, int(total * 0.3))
        cluster.start(b, int(total * 0.3), model=str(copy))  # same id and digest, bad bytes
        cluster.start(c, int(total * 0.75), model=big_model.name)
        views = cluster.wait(lambda: cluster.converged([a, b, c], 3), 120, "the mesh serving")
        log = cluster.log(c)
        bad = [line for line in log.splitlines() if f"peer {b.name}" in line and "sha256 mismatch" in line]
        assert bad and "refetching elsewhere" in bad[0], cluster.logs()
        head = cluster.host(views[0]["plan"]["stages"][-1]["nodes"][0])
        assert cluster.chat(head, MESSAGES, 8) == expected  # only verified bytes were loaded


FAILOVER_TOKENS = 240
LONG = [{"role": "user", "content": "Tell me a very long story about the sea and the rivers."}]


def test_failover_to_layers_it_lacks_fetches_them_and_generation_continues(tmp_path):
    from mlx_lm import generate, load

    model = build_model(
        tmp_path / "models" / "llama",
        "llama",
        num_layers=8,
        hidden_size=128,
        intermediate_size=256,
        dtype="float32",
        seed=3,
    )  # a long answer (as in test_faults)
    m, tok = load(str(model))
    reference = generate(
        m, tok, prompt=tok.apply_chat_template(LONG, add_generation_prompt=True), max_tokens=FAILOVER_TOKENS
    )
    assert len(reference) > 100
    total = profile_model(model).total_bytes(512)
    with netns_mesh(3) as mesh:
        cluster = Cluster(mesh, model, tmp_path)
        a, b, c = cluster.hosts
        # c holds nothing and joins a serving mesh that does not rebalance (dwell): it is not in the
        # plan until a node of it dies. (Started together, the planner may prefer c: a node without
        # the weights cannot time a layer, and the default speed it is assumed may beat what a and
        # b measured on shared cores.)
        # Two pipeline stages are the premise: "auto" may pair a and b into one tensor group when their
        # measured link and layer times favour it, leaving no first stage to kill.
        stay = {"MESHNODE_REBALANCE_DWELL": "600", "MESHNODE_STRATEGY": "pipeline"}
        cluster.start(a, int(total * 0.55), env=stay)
        cluster.start(b, int(total * 0.55), env=stay)
        cluster.wait(lambda: cluster.converged([a, b], 2), 120, "a and b serving")
        cluster.start(c, int(total * 0.55), model=model.name, env=stay)
        views = cluster.wait(lambda: cluster.converged([a, b, c], 3), 120, "the mesh serving")
        stages = views[0]["plan"]["stages"]
        assert len(stages) == 2, stages
        first, head = [s["nodes"][0] for s in stages]
        assert c.name not in (first, head)
        text, faulted = read_stream(
            cluster.stream(cluster.host(head), LONG, FAILOVER_TOKENS), fault=lambda: mesh.kill(cluster.procs[first])
        )
        assert faulted
        assert text == reference, cluster.logs()
        after = cluster.mesh_view(cluster.host(head))
        # c has a part in the new plan: a pipeline stage, or a member of a tensor group
        assert c.name in [n for s in after["plan"]["stages"] for n in s["nodes"]]
        assert "fetched layers" in cluster.log(c)


@pytest.mark.parametrize("quantize,dtype", [("4bit", "bfloat16"), (None, "bfloat16")])
def test_a_middle_stage_fetched_from_a_peer_runs_quantized_and_bf16(quantize, dtype, tmp_path):
    """The node holding only middle layers has no embedding on disk: its activation dtype comes
    from the whole model's manifest (bf16 here, also for 4-bit weights with bf16 scales), so the
    activations between stages are not refused and the mesh answers like mlx-lm."""
    model = build_model(
        tmp_path / f"llama-{quantize or dtype}",
        "llama",
        num_layers=6,
        hidden_size=128,
        intermediate_size=256,
        dtype=dtype,
        quantize=quantize,
        seed=5,
    )
    reference = mlx_reference(model, MESSAGES, 24)
    total = profile_model(model).total_bytes(512)
    with netns_mesh(4) as mesh:
        cluster = Cluster(mesh, model, tmp_path)
        holder, *others = cluster.hosts
        # The holder only supplies the weights (its budget holds no stage); the three others, each
        # with 0.4 of the model's footprint, are the plan's three stages and fetch their layers.
        # A pipeline is asked for: llama also splits into tensor groups, and with measured links the
        # planner may pair two nodes into a hybrid stage, leaving no middle stage.
        pipeline = {"MESHNODE_STRATEGY": "pipeline"}
        cluster.start(holder, int(total * 0.05), env=pipeline)
        for h in others:
            cluster.start(h, int(total * 0.4), model=model.name, env=pipeline)
        view = cluster.wait(lambda: cluster.converged(cluster.hosts, 4), 120, "convergence")[0]
        stages = [(s["start_layer"], s["end_layer"], s["nodes"][0]) for s in view["plan"]["stages"]]
        assert len(stages) == 3 and holder.name not in {n for _, _, n in stages}, stages
        middle = stages[1][2]
        held = list((tmp_path / middle / "cache").rglob("*.safetensors"))
        assert held, "the middle stage's node fetched nothing"
        names = {k for f in held for k in read_safetensors_header(f)}
        assert names and not any("embed_tokens" in k or "lm_head" in k for k in names), sorted(names)
        for h in cluster.hosts:
            assert cluster.chat(h, MESSAGES, 24) == reference, cluster.logs()
