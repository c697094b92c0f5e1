"""The answer-shaping fields across a real 2-stage mesh (issue 12): a request made at the node that
is not the head travels to the head in a GenerateRequest (penalties, logit_bias, logprobs, a
structured-output grammar) and its tokens come back with their logprobs. Every surface (the
``openai``, ``ollama`` and ``anthropic`` packages) asks the node that relays; the greedy answer
with the logits processors equals mlx-lm's generate_step with the same processors on the whole
model, and a sampled structured answer follows its schema."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from harness.cluster import HTTP, Cluster, in_ns
from harness.netns import netns_mesh
from meshnode.model.build import build_model
from meshnode.weights.profile import profile_model

MESSAGES = [{"role": "user", "content": "Tell me about the sea and the rivers that run to it."}]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}

CLIENTS = r"""
import json, sys
import anthropic, ollama
from openai import OpenAI
base, model, messages, schema = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
c = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
shaped = c.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0, logprobs=True,
                                   top_logprobs=2, presence_penalty=0.8, frequency_penalty=0.4,
                                   logit_bias={"40": 3.0}, extra_body={"repetition_penalty": 1.3})
structured = [c.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=1.0, seed=s,
                                        response_format={"type": "json_schema",
                                                         "json_schema": {"name": "x", "schema": schema}}
                                        ).choices[0].message.content for s in (1, 2)]
plain = c.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
olla = ollama.Client(host=base).chat(model=model, messages=messages, stream=False,
                                    options={"temperature": 0, "num_predict": 8})
claude = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0).messages.create(
    model=model, max_tokens=8, messages=messages, extra_body={"temperature": 0})
print(json.dumps({
    "shaped": shaped.choices[0].message.content,
    "logprobs": [[e.token, e.logprob, [t.token for t in e.top_logprobs]] for e in shaped.choices[0].logprobs.content],
    "structured": structured, "plain": plain.choices[0].message.content,
    "ollama": olla.message.content, "anthropic": claude.content[0].text,
}))
"""


@pytest.mark.netns
@pytest.mark.timeout(400)
def test_a_relayed_request_keeps_its_sampling_logprobs_and_grammar(tmp_path):
    model = build_model(
        tmp_path / "llama-4bit",
        "llama",
        num_layers=4,
        hidden_size=64,
        intermediate_size=128,
        dtype="bfloat16",
        quantize="4bit",
    )
    total = profile_model(model).total_bytes(1024)
    with netns_mesh(2) as mesh:
        cluster = Cluster(mesh, model, tmp_path, max_context=1024)
        for h in cluster.hosts:  # neither holds it alone: two stages
            cluster.start(h, int(total * 0.6), env={"MESHNODE_STRATEGY": "pipeline"})
        views = cluster.wait(lambda: cluster.converged(cluster.hosts, 2, stages=2), 90, "convergence")
        assert len(views[0]["plan"]["stages"]) == 2, views[0]["plan"]
        head = cluster.host(views[0]["plan"]["stages"][-1]["nodes"][0])
        other = next(h for h in cluster.hosts if h is not head)
        got = in_ns(
            cluster.client,
            CLIENTS,
            f"http://{other.ip}:{HTTP}",
            model.name,
            json.dumps(MESSAGES),
            json.dumps(SCHEMA),
            timeout=300,
        )

    m, tok = load(str(model))
    prompt = mx.array(tok.apply_chat_template(MESSAGES, add_generation_prompt=True))
    processors = make_logits_processors(
        logit_bias={40: 3.0}, repetition_penalty=1.3, presence_penalty=0.8, frequency_penalty=0.4
    )
    ref = []
    for token, logprobs in generate_step(prompt, m, max_tokens=16, logits_processors=processors):
        if token in tok.eos_token_ids:
            break
        ref.append((int(token), logprobs))
    assert got["shaped"] == tok.decode([t for t, _ in ref])
    assert [e[0] for e in got["logprobs"]] == [tok.decode([t]) for t, _ in ref]
    for (_, logprob, top), (token, logprobs) in zip(got["logprobs"], ref):
        assert logprob == pytest.approx(logprobs[token].item(), abs=0.05) and len(top) == 2
    for answer in got["structured"]:
        parsed = json.loads(answer)
        assert set(parsed) == {"ok", "n"} and parsed["n"] in (1, 2, 3)
    # Every surface relays the same greedy answer.
    assert got["plain"] == got["ollama"] == got["anthropic"]
    greedy = []
    for token, _ in generate_step(prompt, m, max_tokens=8):
        if token in tok.eos_token_ids:
            break
        greedy.append(int(token))
    assert got["plain"] == tok.decode(greedy)
