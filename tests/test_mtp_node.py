"""A node that holds a whole model with an MTP head drafts with it (speculative = "auto"): the head
read from each layout the loader takes, served through the HTTP API, greedy answers equal to mlx-lm's
on the backbone, and /metrics counting drafts and confirmations per draft position.

The head is made to draft well: the backbone has one layer with unit-RMS embedding rows, and the
head's block is a copy of it fed the next token's embedding alone, so it predicts about what the
backbone would one position on (its context lacks the first token)."""

from __future__ import annotations

import json
import re
import shutil

import mlx.core as mx
import pytest
import requests
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate_step

from meshnode.cli.status import format_status
from meshnode.model.build import build_model
from meshnode.model.mtp import MTPHead, shared_from
from meshnode.model.mtp_load import save_qwen
from tests.ggufwrite import write_gguf
from tests.helpers import running_node

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
N = 32
PROMPT = "The quick brown fox jumps over the lazy dog, and then"


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    path = build_model(tmp_path_factory.mktemp("mtpnode") / "llama", "llama", num_layers=1, dtype="float32")
    file = path / "model.safetensors"
    weights = dict(mx.load(str(file)))
    e = weights["model.embed_tokens.weight"]
    weights["model.embed_tokens.weight"] = e / mx.sqrt(mx.mean(e * e, axis=-1, keepdims=True))
    mx.save_safetensors(str(file), weights, metadata={"format": "mlx"})
    model, tokenizer = mlx_load(str(path))
    prompt = tokenizer.encode(PROMPT)
    want = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=N)]
    return path, model, prompt, want


def _head(model) -> MTPHead:
    """Backbone layer 0 run on the next token's embedding; the backbone's final norm."""
    head = MTPHead(model.args, shared_from(model))
    d = model.args.hidden_size
    params = {f"block.{k}": v for k, v in tree_flatten(model.model.layers[0].parameters())}
    params |= {"eh_proj.weight": mx.concatenate([mx.eye(d), mx.zeros((d, d))], axis=1)}
    params |= {"enorm.weight": mx.ones((d,)), "hnorm.weight": mx.ones((d,)), "norm.weight": model.model.norm.weight}
    head.load_weights(list(params.items()), strict=True)
    mx.eval(head.parameters())
    return head


def _layout(kind, backbone, out):
    """The model served: a folder with the head beside mlx-lm's files, or a GGUF with nextn blocks."""
    path, model, _, _ = backbone
    head = _head(model)
    if kind == "gguf":
        return write_gguf(path, out / "tiny.gguf", mtp=head)
    folder = out / kind
    shutil.copytree(path, folder)
    if kind == "qwen":  # mtp.* in a file mlx-lm does not load
        save_qwen(head, folder / "mtp.safetensors")
        return folder
    # DeepSeek-V3 extra layer model.layers.{n}, beside the weights mlx-lm's llama loads strictly
    config = json.loads((folder / "config.json").read_text())
    n = config["num_hidden_layers"]
    names = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "norm": "shared_head.norm"}
    extra = {}
    for name, a in tree_flatten(head.parameters()):
        module, _, rest = name.partition(".")
        extra[f"model.layers.{n}." + (rest if module == "block" else f"{names[module]}.{rest}")] = a
    mx.save_safetensors(str(folder / "mtp.safetensors"), extra)
    (folder / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    return folder


def _counters(base: str, name: str) -> dict[str, float]:
    text = requests.get(f"{base}/metrics", timeout=30).text
    return {m[0]: float(m[1]) for m in re.findall(rf'^{name}_total{{position="(\d+)"}} (\S+)$', text, re.M)}


@pytest.mark.parametrize("kind", ["qwen", "deepseek", "gguf"])
def test_greedy_answers_are_mlx_lms_and_the_head_drafts(kind, backbone, tmp_path):
    _, _, prompt, want = backbone
    model = _layout(kind, backbone, tmp_path)
    with running_node(model, tmp_path, max_context=1024, draft_max=4) as (node, base):
        served = node.models[node.model_id]
        assert served.files.loaded_profile.mtp_bytes > 0  # the planner counts the head it loads
        reply = requests.post(
            f"{base}/v1/completions",
            json={"model": node.model_id, "prompt": prompt, "max_tokens": N, "temperature": 0},
            timeout=120,
        ).json()
        assert served.placement(None).drafter.kind == "mtp", served.placement(None).drafter
        mesh = requests.get(f"{base}/v1/mesh", timeout=30).json()
        drafted = _counters(base, "meshnode_speculative_position_drafted")
        accepted = _counters(base, "meshnode_speculative_position_accepted")
    got = reply["choices"][0]["text"]
    tokenizer = mlx_load(str(backbone[0]))[1]
    assert got == tokenizer.decode(want)
    assert drafted.get("1", 0) > 0 and accepted.get("1", 0) > 0, (drafted, accepted)
    assert all(accepted.get(p, 0) <= drafted[p] for p in drafted)
    said = "mtp: the model's own head (1 layer, float32)"
    assert mesh["drafter"] == mesh["models"][0]["drafter"] == said
    assert f"drafter      {said}" in format_status(mesh).splitlines()


def test_a_model_without_a_head_under_mtp_drafts_as_auto_would_and_says_why(backbone, tmp_path, caplog):
    path, _, prompt, want = backbone
    with running_node(path, tmp_path, max_context=1024, speculative="mtp", batching=False) as (node, base):
        reply = requests.post(
            f"{base}/v1/completions",
            json={"model": node.model_id, "prompt": prompt, "max_tokens": N, "temperature": 0},
            timeout=120,
        ).json()
        mesh = requests.get(f"{base}/v1/mesh", timeout=30).json()
    assert reply["choices"][0]["text"] == mlx_load(str(path))[1].decode(want)
    assert mesh["models"][0]["drafter"] == "prompt_lookup: no MTP head"
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith('speculative = "mtp"')]
    assert said == ['speculative = "mtp": no MTP head; drafting with prompt_lookup instead'], said
