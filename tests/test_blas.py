"""meshnode.blas: OpenBLAS under MLX's CPU matmuls on Linux (``MESHNODE_BLAS``).

The suite itself runs on MLX's own reference BLAS (tests/conftest.py); these tests start processes
on OpenBLAS and prove, with the dynamic linker's own record, which library MLX's matmuls bind to.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cluster import wait_until
from meshnode import blas
from meshnode.model.build import model_dir_for
from tests.helpers import meshnode_run

ROOT = Path(__file__).resolve().parent.parent
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="MLX's Linux CPU wheel is what links a reference BLAS")
pytestmark = pytest.mark.timeout(180)

# meshnode first (it loads the BLAS), then MLX: a float32 matmul, printed with the library in use.
PROBE = r"""
import json
import meshnode
from meshnode import blas
import mlx.core as mx
import numpy as np
mx.random.seed(0)
w, x = mx.random.normal((256, 192)), mx.random.normal((24, 192))
got = np.array(x @ w.T)
exact = np.array(x, dtype=np.float64) @ np.array(w, dtype=np.float64).T
from meshnode.config import Settings
from meshnode.serving.lockstep import lockstep_wanted
print(json.dumps({"in_use": blas.in_use(), "error": float(np.abs(got - exact).max()),
                  "lockstep_wanted": lockstep_wanted(Settings().lockstep)}))
"""


def _env(setting: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != blas.ENV}
    if setting is not None:
        env[blas.ENV] = setting
    return {**env, "PYTHONPATH": str(ROOT)}


def _probe(setting: str | None) -> tuple[dict, str]:
    """PROBE in a fresh process with ``MESHNODE_BLAS=setting`` (None: unset); (its figures, the
    dynamic linker's bindings of cblas_sgemm)."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        env={**_env(setting), "LD_DEBUG": "bindings"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    bindings = "\n".join(line for line in out.stderr.splitlines() if "`cblas_sgemm'" in line)
    return json.loads(out.stdout.strip().splitlines()[-1]), bindings


def test_choose():
    found = lambda: "libopenblas.so.0"  # noqa: E731
    assert blas.choose("auto", "linux", found) == "libopenblas.so.0"
    assert blas.choose("", "linux", found) == "libopenblas.so.0"  # unset or empty: auto
    assert blas.choose(" Auto ", "linux", found) == "libopenblas.so.0"
    assert blas.choose("auto", "linux", lambda: None) is None  # none on this system: MLX's own
    assert blas.choose("reference", "linux", found) is None
    assert blas.choose("auto", "darwin", found) is None  # Accelerate is under MLX there
    assert blas.choose("/opt/blis/lib/libblis.so", "linux", found) == "/opt/blis/lib/libblis.so"
    with pytest.raises(blas.BlasError, match="auto, reference, or the path"):
        blas.choose("openblas", "linux", found)


@pytest.mark.slow
@linux_only
def test_by_default_mlx_multiplies_with_openblas_and_reference_keeps_its_own():
    auto, bound = _probe(None)
    assert auto["in_use"].startswith("OpenBLAS"), (
        "no OpenBLAS on this machine: install it as the README's set-up does (apt-get install libopenblas0-pthread)"
    )
    assert re.search(r"libmlx\.so .* to \S*openblas\S* \[\d+\]: normal symbol `cblas_sgemm'", bound), bound
    assert auto["error"] < 1e-4  # and it multiplies correctly
    assert auto["lockstep_wanted"]  # lockstep = "auto": batched rows are cheap here

    ref, bound = _probe("reference")
    assert ref["in_use"] == "MLX's own BLAS"
    assert re.search(r"libmlx\.so .* to \S*libblas\S* \[\d+\]: normal symbol `cblas_sgemm'", bound), bound
    assert "openblas" not in bound
    assert ref["error"] < 1e-4
    assert not ref["lockstep_wanted"]  # a batch costs what its rows do: steps in turn


def test_the_lockstep_setting():
    from meshnode.config import Settings, load_settings
    from meshnode.serving.lockstep import lockstep_wanted

    assert Settings().lockstep == "auto"
    assert load_settings(None, env={"MESHNODE_LOCKSTEP": "true"}).lockstep is True
    assert load_settings(None, env={"MESHNODE_LOCKSTEP": "off"}).lockstep is False
    assert load_settings(None, env={"MESHNODE_LOCKSTEP": " Auto"}).lockstep == "auto"
    with pytest.raises(Exception, match="expected auto, true or false"):
        load_settings(None, env={"MESHNODE_LOCKSTEP": "sometimes"})
    assert lockstep_wanted(True) and not lockstep_wanted(False)
    assert not lockstep_wanted("auto")  # this process: the suite's reference BLAS (conftest)


@pytest.mark.slow
@linux_only
def test_a_setting_that_names_no_library_is_an_error_the_node_logs_and_it_serves_on(tmp_path):
    model = model_dir_for(tmp_path / "models", "llama", num_layers=2, hidden_size=64, dtype="float32")
    with meshnode_run(
        tmp_path, env=_env("/nowhere/libnothing.so"), model=model, http_port=0, grpc_port=0, budget="1GiB"
    ) as (_, port, log):
        text = log.read_text()
        assert "CPU matmuls: MLX's own BLAS" in text, text
        assert "MESHNODE_BLAS='/nowhere/libnothing.so' could not be loaded" in text
        wait_until(lambda: _healthy(f"http://127.0.0.1:{port}", "MLX's own BLAS"), 60, "the node to serve")


# mlx-lm's greedy answers in a process of its own on the given BLAS (meshnode imported first).
MLX_ANSWERS = r"""
import json, sys
import meshnode
from meshnode import blas
from mlx_lm import generate, load
model, tokenizer = load(sys.argv[1])
answers = [generate(model, tokenizer, tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                                    add_generation_prompt=True),
                    max_tokens=int(sys.argv[3]))
           for p in json.loads(sys.argv[2])]
print(json.dumps({"in_use": blas.in_use(), "answers": answers}))
"""

# The same chats through the openai package, one streamed.
CLIENT = r"""
import json, sys
from openai import OpenAI
c = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0, timeout=120)
out = []
for i, p in enumerate(json.loads(sys.argv[3])):
    ask = dict(model=sys.argv[2], messages=[{"role": "user", "content": p}], max_tokens=int(sys.argv[4]), temperature=0)
    if i % 2:
        out.append("".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **ask)
                           if ch.choices))
    else:
        out.append(c.chat.completions.create(**ask).choices[0].message.content)
print(json.dumps(out))
"""

PROMPTS = [
    "Tell me about the sea.",
    "Write a poem about lighthouses and the keepers who tend them at night.",
    "word " * 120,
]
CASES = {
    "llama-f32": ("llama", {"dtype": "float32", "hidden_size": 256}),
    "qwen3-f32": ("qwen3", {"dtype": "float32", "hidden_size": 128}),
    "llama-bf16": ("llama", {"dtype": "bfloat16", "hidden_size": 128}),
    "qwen3-4bit": ("qwen3", {"dtype": "bfloat16", "hidden_size": 128, "quantize": "4bit"}),
}


@pytest.mark.slow
@linux_only
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_node_on_openblas_answers_as_mlx_lm_does_on_it(case, tmp_path_factory, tmp_path):
    """A real ``meshnode run`` on OpenBLAS (the default here) serves chats through the openai package
    with mlx-lm's greedy answers on the same library: one request on one node multiplies the same
    shapes as mlx-lm, so even OpenBLAS's shape-dependent rounding agrees."""
    family, kw = CASES[case]
    model = model_dir_for(tmp_path_factory.getbasetemp() / "models", family, num_layers=4, **kw)
    tokens = 24
    ref = subprocess.run(
        [sys.executable, "-c", MLX_ANSWERS, str(model), json.dumps(PROMPTS), str(tokens)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(None),
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = json.loads(ref.stdout.strip().splitlines()[-1])
    assert want["in_use"].startswith("OpenBLAS")
    with meshnode_run(tmp_path, env=_env(None), model=model, http_port=0, grpc_port=0, budget="1GiB") as (_, port, log):
        assert "CPU matmuls: OpenBLAS" in log.read_text(), log.read_text()
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _healthy(url, "OpenBLAS"), 60, "the node to serve")
        got = subprocess.run(
            [sys.executable, "-c", CLIENT, url, model.name, json.dumps(PROMPTS), str(tokens)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert got.returncode == 0, got.stderr[-3000:]
        assert json.loads(got.stdout) == want["answers"]


def _healthy(url: str, blas_in_use: str) -> bool:
    """Whether the node at ``url`` serves, computing on a BLAS whose name starts ``blas_in_use``."""
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/v1/mesh", timeout=5) as r:
            view = json.load(r)
    except OSError:
        return False
    return bool(view.get("healthy")) and view.get("blas", "").startswith(blas_in_use)
