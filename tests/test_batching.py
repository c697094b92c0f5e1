"""Continuous batching on a node that holds the whole model (meshnode.serving.batching): concurrent
requests decode together in one mlx-lm BatchGenerator and each gets what it would get alone."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest
from mlx_lm import generate as mlx_generate
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate_step
from openai import OpenAI

from meshnode.model.build import build_model
from meshnode.model.scheduler import TokenScheduler
from meshnode.model.shard import Shard
from meshnode.serving.batching import BatchedSource
from meshnode.serving.local_stage import LocalStage
from meshnode.serving.sampling import SamplingParams
from tests.helpers import running_node

PROMPTS = [
    "Tell me a story about a cat.",
    "What is two plus two?",
    "Name three colours.",
    "Write a haiku about the sea, please, and make it rhyme.",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module", params=[("llama", None), ("qwen3_moe", None)], ids=lambda p: p[0])
def model_path(request, tmp_path_factory):
    family, quantize = request.param
    return build_model(
        tmp_path_factory.mktemp("batch") / family, family, num_layers=2, dtype="float32", quantize=quantize
    )


@pytest.fixture(scope="module")
def node(model_path, tmp_path_factory):
    with running_node(model_path, tmp_path_factory.mktemp("node"), max_context=1024) as (node, base):
        yield node, base


def _client(base) -> OpenAI:
    return OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(base, model, prompt, **kw) -> str:
    kw.setdefault("max_tokens", MAX_TOKENS)
    kw.setdefault("temperature", 0)
    out = _client(base).chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], **kw)
    return out.choices[0].message.content


def _stream(base, model, prompt, started: threading.Event | None = None, stop_after: int | None = None, **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    kw.setdefault("temperature", 0)
    stream = _client(base).chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], stream=True, **kw
    )
    text, pieces = "", 0
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                text += choice.delta.content
                pieces += 1
                if started is not None:
                    started.set()
        if stop_after is not None and pieces >= stop_after:
            stream.close()  # the client goes away mid-answer
            break
    return text


def _loops(node):
    return [
        p._source.loop
        for p in node.served._placements.values()
        if isinstance(getattr(p, "_source", None), BatchedSource)
    ]


def _wait(check, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _together(fn, args_list):
    with ThreadPoolExecutor(len(args_list)) as pool:
        return list(pool.map(lambda a: fn(*a), args_list))


@pytest.mark.slow
def test_concurrent_greedy_chats_answer_as_alone_and_as_mlx_lm(node, model_path):
    n, base = node
    alone = [_chat(base, n.model_id, p) for p in PROMPTS]
    (loop,) = _loops(n)
    loop.widest = 0
    together = _together(lambda p: _chat(base, n.model_id, p), [(p,) for p in PROMPTS])
    assert together == alone
    assert loop.widest >= 2  # they did decode in one batch
    streamed = _together(lambda p: _stream(base, n.model_id, p), [(p,) for p in PROMPTS])
    assert streamed == alone
    model, tokenizer = mlx_load(str(model_path))
    reference = [
        mlx_generate(
            model,
            tokenizer,
            prompt=tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True),
            max_tokens=MAX_TOKENS,
        )
        for p in PROMPTS
    ]
    assert alone == reference
    assert n.scheduler.arrivals.pending == 0  # each request counted until its generation took it


@pytest.mark.timeout(120)
def test_requests_that_arrive_together_are_prefilled_in_one_step(model_path):
    """Requests still on their way (their prompts being rendered) when the first reaches the loop
    are taken in with it: one insert, one prefill, every first token on the same step, so
    streams sent together end together and a next request's prefill falls between no one's
    tokens. Each answer is still mlx-lm's own."""
    model, tokenizer = mlx_load(str(model_path))
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS[:3]
    ]
    reference = [[int(t) for (t, _), _ in zip(generate_step(mx.array(p), model), range(12))] for p in prompts]
    scheduler = TokenScheduler("test-batch-arrivals")
    try:
        source = BatchedSource(scheduler, LocalStage(Shard(str(model_path), 0, 2)))
        loop = source.loop

        taken = False

        async def first_taken() -> None:
            # the first request is submitted and the loop has taken it, the others not yet submitted
            nonlocal taken
            deadline = time.monotonic() + 30
            while not taken:
                taken = scheduler.active == 1 and not loop.queued
                assert time.monotonic() < deadline, "the first request was never taken"
                await asyncio.sleep(0)

        async def answer(prompt, later: bool) -> list[int]:
            with scheduler.arrivals.arriving():  # it has reached the node
                if later:
                    await first_taken()
                return [int(t) async for t in source.tokens(prompt, SamplingParams(max_tokens=12))]

        async def together() -> list[list[int]]:
            # (the later ones arrive first, so they are on their way when the first is submitted)
            later = [asyncio.create_task(answer(p, True)) for p in prompts[1:]]
            first = asyncio.create_task(answer(prompts[0], False))
            return await asyncio.gather(first, *later)

        answers = asyncio.run(together())
        assert (loop.admissions, loop.admitted) == (1, 3)
        assert answers == reference
        assert scheduler.arrivals.pending == 0
    finally:
        scheduler.stop()


@pytest.mark.slow
def test_a_request_joins_while_others_decode(node):
    n, base = node
    long_kw = dict(max_tokens=96)
    # (streamed against streamed: a stream's last piece may hold an incomplete character differently)
    alone = [_stream(base, n.model_id, p, **long_kw) for p in PROMPTS[:2]] + [_chat(base, n.model_id, PROMPTS[2])]
    started = threading.Event()
    with ThreadPoolExecutor(3) as pool:
        first = [
            pool.submit(_stream, base, n.model_id, p, started if i == 0 else None, **long_kw)
            for i, p in enumerate(PROMPTS[:2])
        ]
        assert started.wait(60)
        late = pool.submit(_chat, base, n.model_id, PROMPTS[2])
        assert [f.result() for f in first] + [late.result()] == alone


@pytest.mark.slow
def test_a_cancelled_stream_leaves_the_others_correct(node):
    n, base = node
    alone = [_stream(base, n.model_id, p, max_tokens=64) for p in PROMPTS]
    out = _together(
        lambda p, stop: _stream(base, n.model_id, p, stop_after=stop, max_tokens=64),
        [(PROMPTS[0], 2), (PROMPTS[1], None), (PROMPTS[2], 3), (PROMPTS[3], None)],
    )
    assert out[1] == alone[1] and out[3] == alone[3]
    assert alone[0].startswith(out[0]) and alone[2].startswith(out[2])
    deadline = time.monotonic() + 10
    while any(loop.running for loop in _loops(n)):  # the cancelled ones left the batch
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert _stream(base, n.model_id, PROMPTS[1], max_tokens=64) == alone[1]  # and the node serves on


@pytest.mark.slow
def test_seeded_sampled_requests_reproduce_their_alone_output(node, model_path, tmp_path):
    n, base = node
    kws = [
        dict(temperature=0.9, seed=7),
        dict(temperature=1.2, seed=11, top_p=0.9),
        dict(temperature=0.7, seed=3, extra_body={"top_k": 20, "min_p": 0.05}),
        dict(temperature=0, frequency_penalty=0.5, logit_bias={"5": 3.0}),
    ]
    alone = [_chat(base, n.model_id, p, **kw) for p, kw in zip(PROMPTS, kws)]
    together = _together(lambda p, kw: _chat(base, n.model_id, p, **kw), list(zip(PROMPTS, kws)))
    assert together == alone
    # ... and what the unbatched path (a generation thread each) gives.
    with running_node(model_path, tmp_path, max_context=1024, batching=False) as (plain, plain_base):
        unbatched = [_chat(plain_base, plain.model_id, p, **kw) for p, kw in zip(PROMPTS, kws)]
        assert not _loops(plain)
    assert unbatched == alone


def test_logprobs_are_reported_per_token_in_a_batch(node):
    n, base = node

    def ask(prompt):
        out = _client(base).chat.completions.create(
            model=n.model_id,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=12,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
        )
        entries = out.choices[0].logprobs.content
        assert len(entries) == out.usage.completion_tokens
        return [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in entries]

    alone = [ask(p) for p in PROMPTS]
    together = _together(ask, [(p,) for p in PROMPTS])
    for a, b in zip(alone, together):
        assert [(t, top) for t, _, top in a] == [(t, top) for t, _, top in b]
        assert [lp for _, lp, _ in a] == pytest.approx([lp for _, lp, _ in b], abs=1e-4)
        assert all(top[0] == t for t, _, top in a)  # greedy: the most likely one


def test_a_next_turn_resumes_its_kept_prefix_in_the_batch(node, model_path):
    n, base = node
    store = n.served.prefixes
    model, tokenizer = mlx_load(str(model_path))
    messages = [{"role": "user", "content": PROMPTS[3] * 3}]
    c = _client(base)
    first = (
        c.chat.completions.create(model=n.model_id, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        .choices[0]
        .message.content
    )
    hits = store.hits
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": PROMPTS[1]}]
    # The next turn, beside another request decoding.
    with ThreadPoolExecutor(2) as pool:
        other = pool.submit(lambda: _chat(base, n.model_id, PROMPTS[0]))
        second = (
            c.chat.completions.create(model=n.model_id, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
            .choices[0]
            .message.content
        )
        assert other.result() == _chat(base, n.model_id, PROMPTS[0])
    assert store.hits > hits  # resumed from what the first turn kept
    assert second == mlx_generate(
        model,
        tokenizer,
        prompt=tokenizer.apply_chat_template(messages, add_generation_prompt=True),
        max_tokens=MAX_TOKENS,
    )


def test_a_kept_prefix_counts_its_positions_once(node):
    """When a generation ends its positions become a kept prefix, counted once: counted as in use
    and as kept at once, they would give up the previous turn's prefix for room that is there, and
    an agent's next task would prefill its whole system prompt again."""
    n, base = node
    store, layers = n.served.prefixes, (0, 2)
    capacity = store.capacity
    store.forget()
    try:
        # (The answer's last token can reach the client just before its prefix is kept: wait for it.)
        _chat(base, n.model_id, "Alpha: " + PROMPTS[0] * 4)
        _wait(lambda: store.keys(layers), "the first chat's prefix kept")
        first, kept = store.held(layers), store.keys(layers)
        store.capacity = 2 * first + 40  # room for two such prefixes, not for a third copy
        _chat(base, n.model_id, "Bravo: " + PROMPTS[0] * 4)
        _wait(lambda: store.keys(layers) != kept, "the second chat's prefix kept")
        second = store.held(layers) - (first if len(store.keys(layers)) == 2 else 0)
        assert abs(second - first) <= 40, (first, second)  # (the test's premise: prefixes of about one size)
        assert len(store.keys(layers)) == 2, (first, second, store.keys(layers))
    finally:
        store.capacity = capacity


def test_a_prefix_given_up_after_the_head_chose_it_resumes_from_another(node, model_path):
    """The head chose a kept prefix the store no longer holds (given up between the choice and the
    admission): the request resumes from the best one still kept instead of prefilling it all."""
    _resumes_from_another(node, model_path)


@pytest.mark.slow
def test_unbatched_a_prefix_given_up_after_the_head_chose_it_resumes_from_another(model_path, tmp_path):
    """The same on the unbatched path (a stage refuses the resume; the head asks again)."""
    with running_node(model_path, tmp_path, max_context=1024, batching=False) as node:
        _resumes_from_another(node, model_path)


def _resumes_from_another(node, model_path):
    n, base = node
    store, index = n.served.prefixes, n.served.prefix_index
    model, tokenizer = mlx_load(str(model_path))
    messages = [{"role": "user", "content": "Charlie: " + PROMPTS[2] * 4}]
    first = _chat(base, n.model_id, messages[0]["content"])
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": PROMPTS[1]}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    hits = store.hits
    gone = index.add(prompt[:-3])  # the index is ahead of the store: a longer match, held nowhere
    assert index.match(prompt)[0] == gone
    second = (
        _client(base)
        .chat.completions.create(model=n.model_id, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        .choices[0]
        .message.content
    )
    assert store.hits == hits + 1 and gone not in [k for k, _ in [index.match(prompt) or ("", 0)]]
    assert second == mlx_generate(model, tokenizer, prompt=prompt, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def speculating_node(model_path, tmp_path_factory):
    """A node that speculates with prompt lookup where its whole model batches (not the default)."""
    with running_node(model_path, tmp_path_factory.mktemp("node"), max_context=1024, speculative="prompt_lookup") as (
        node,
        base,
    ):
        yield node, base


@pytest.mark.slow
def test_a_long_prompt_joining_does_not_stall_the_decoders(node, monkeypatch):
    _joins_a_decoder_chunk_by_chunk(node, monkeypatch)


@pytest.mark.slow
def test_with_prompt_lookup_a_lone_request_that_cannot_speculate_still_batches_with_one_that_joins(
    speculating_node, monkeypatch
):
    """A lone request that can speculate decodes beside the batch; one that cannot (here a logit
    bias) must go into it, or the request that joins it takes turns with it and is prefilled at
    once, not a chunk per step between the decoder's tokens."""
    n, _ = speculating_node
    assert n.models[n.model_id].placement(None)._alone is not None  # lone requests speculate here
    _joins_a_decoder_chunk_by_chunk(speculating_node, monkeypatch)


def test_by_default_requests_that_batch_do_not_speculate(node):
    """speculative = "auto": where the whole model is here and its requests batch, a lone request
    does not speculate (it would decode beside the batch; one that joins would take turns with it)."""
    n, _ = node
    assert n.settings.speculative == "auto"
    assert n.models[n.model_id].placement(None)._alone is None


def _joins_a_decoder_chunk_by_chunk(node, monkeypatch):
    from mlx_lm.generate import PromptProcessingBatch

    from meshnode.serving.batching import DECODING_CHUNK

    n, base = node
    chunks: list[int] = []
    prompt = PromptProcessingBatch.prompt

    def recorded(self, tokens):
        chunks.extend(len(t) for t in tokens)
        return prompt(self, tokens)

    monkeypatch.setattr(PromptProcessingBatch, "prompt", recorded)
    long_prompt = " ".join(f"w{i % 97}" for i in range(180))  # several DECODING_CHUNKs of prompt
    times: list[float] = []
    started = threading.Event()

    # The decoder must still decode when the long prompt joins: it is kept from ending early (EOS).
    never_ends = {str(t): -100 for t in n.models[n.model_id].engine.tokenizer.eos_token_ids}

    def decoder():
        stream = _client(base).chat.completions.create(
            model=n.model_id,
            messages=[{"role": "user", "content": PROMPTS[0]}],
            max_tokens=400,
            temperature=0,
            stream=True,
            logit_bias=never_ends,
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                times.append(time.monotonic())
                started.set()

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(decoder)
        assert started.wait(60), running.exception()
        time.sleep(0.2)
        sent = time.monotonic()
        chunks.clear()
        joined = _client(base).chat.completions.create(
            model=n.model_id, messages=[{"role": "user", "content": long_prompt}], max_tokens=1, temperature=0
        )
        answered = time.monotonic()
        running.result()
    assert joined.usage.prompt_tokens > 3 * 128
    # It was prefilled a short chunk per step, a token for the decoder in between.
    assert len(chunks) >= 3 and max(chunks) <= DECODING_CHUNK, chunks
    # The decoder kept getting tokens while the long prompt was prefilled a chunk per step.
    assert sum(sent <= t <= answered for t in times) >= 3, (len(times), [round(t - sent, 3) for t in times])
