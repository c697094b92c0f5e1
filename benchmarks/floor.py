"""The floor for a 2-stage split on this machine: what two processes reach with nothing between them.

mlx-lm's own modules for the two halves of the bench model, in two processes, one TCP socket on
loopback between them, and nothing else (no meshnode, no protobuf, no step built ahead), measured
in turns with mlx-lm's whole model in one process (stream_generate), as the suite measures the mesh.
Whatever a 2-stage mesh loses to mlx-lm beyond what this loses is meshnode's own cost; what this
loses is the machine's (two processes, two halves of the compute, a wake-up each way).

    .venv/bin/python benchmarks/floor.py [--tokens 64] [--rounds 5] [--json out.json]

The head (this process) holds the second half of the layers, the final norm and the output
projection; a child process holds the embedding and the first half. Per token the head sends the
token id; the child runs its layers and answers with the activation and its own seconds; the head
runs the rest and takes the greedy token. Prints decode tokens/s of both per round, the median of
the rounds' ratios, and the transport per hop timed as meshnode times its own (half of each round
trip minus the child's seconds). Fails if the split's tokens differ from mlx-lm's (checked before
and after the rounds).

It also times one hop of a 3,072-byte message between two processes on loopback with nothing but
the socket calls in between, each sender having just spent 45 ms streaming 200 MB through its
caches (as a stage's matmuls stream its weights): the floor of a hop whose two ends compute on the
same CPUs.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import PROMPT, bench_model_dir  # noqa: E402
from meshnode.transport.listener import recv_exact  # noqa: E402

ASK = struct.Struct("<iI")  # op, positions; then positions int32 token ids
ANSWER = struct.Struct("<dI")  # the child's seconds, positions; then positions x hidden float32
RESET, FORWARD, QUIT = 0, 1, 2


def _recv(sock: socket.socket, n: int) -> bytearray:
    buf = recv_exact(sock, n)
    if buf is None:
        raise ConnectionError("the other process closed the socket")
    return buf


def _spawn(*args: str) -> tuple[subprocess.Popen, socket.socket]:
    """This script in a child process (``args`` pick its part), and the socket it connected back on."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.floor", "--port", str(server.getsockname()[1]), *args], cwd=ROOT
        )
        server.settimeout(300)
        sock, _ = server.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return proc, sock


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def halves(model):
    """(embedding, first half, second half, norm, output projection) of an mlx-lm llama-style model."""
    inner = model.model
    k = len(inner.layers) // 2
    head = (lambda h: inner.embed_tokens.as_linear(h)) if model.args.tie_word_embeddings else model.lm_head
    return inner.embed_tokens, inner.layers[:k], inner.layers[k:], inner.norm, head


def run_layers(layers, h: mx.array, cache: list) -> mx.array:
    from mlx_lm.models.base import create_attention_mask

    mask = create_attention_mask(h, cache[0])
    for layer, c in zip(layers, cache):
        h = layer(h, mask, cache=c)
    return h


def child(port: int, path: Path) -> None:
    """The first stage: embedding and the first half of the layers, served to the head on ``port``."""
    from mlx_lm import load
    from mlx_lm.models.cache import KVCache

    model, _ = load(str(path))
    embed, first, _, _, _ = halves(model)
    sock = _connect(port)
    cache = []
    while True:
        op, n = ASK.unpack(_recv(sock, ASK.size))
        if op == QUIT:
            return
        if op == RESET:
            cache = [KVCache() for _ in first]
            continue
        ids = np.frombuffer(_recv(sock, 4 * n), dtype=np.int32)
        started = time.perf_counter()
        h = run_layers(first, embed(mx.array(ids)[None]), cache)
        out = np.array(h.astype(mx.float32), copy=False)
        seconds = time.perf_counter() - started
        sock.sendall(ANSWER.pack(seconds, n) + out.tobytes())


class Split:
    """The head's side: the second half, norm and projection here, the first half in a child process."""

    def __init__(self, path: Path):
        from mlx_lm import load

        self.model, self.tokenizer = load(str(path))
        self.prompt = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPT}], add_generation_prompt=True
        )
        _, _, self.second, self.norm, self.project = halves(self.model)
        self.hidden = self.model.args.hidden_size
        self.proc, self.sock = _spawn("--child", "--model", str(path))
        self.transport: list[float] = []

    def reference(self, max_tokens: int) -> tuple[list[int], list[float]]:
        """mlx-lm's stream_generate on the whole model in this process: greedy tokens and their times."""
        from mlx_lm import stream_generate

        out = [
            (r.token, time.perf_counter())
            for r in stream_generate(self.model, self.tokenizer, self.prompt, max_tokens=max_tokens)
        ]
        return [t for t, _ in out], [s for _, s in out]

    def checked_tps(self, max_tokens: int) -> float:
        """The split's decode tokens/s, its tokens checked against mlx-lm's (ValueError if they differ)."""
        want, _ = self.reference(max_tokens)
        got, times = self.generate(self.prompt, max_tokens)
        n = min(len(want), len(got))  # stream_generate stops at an end-of-sequence token
        if got[:n] != want[:n]:
            raise ValueError(f"the split's tokens differ from mlx-lm's: {got[:n]} vs {want[:n]}")
        return tps(times[:n])

    def _hop(self, ids: list[int]) -> mx.array:
        sent = time.perf_counter()
        self.sock.sendall(ASK.pack(FORWARD, len(ids)) + np.asarray(ids, dtype=np.int32).tobytes())
        seconds, n = ANSWER.unpack(_recv(self.sock, ANSWER.size))
        data = _recv(self.sock, 4 * n * self.hidden)
        if n == 1:  # a decode step, as meshnode's meshnode_hop_transport_seconds counts them
            self.transport.append((time.perf_counter() - sent - seconds) / 2)
        return mx.array(np.frombuffer(data, dtype=np.float32).reshape(1, n, self.hidden))

    def generate(self, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """Greedy tokens and the time each was ready."""
        from mlx_lm.models.cache import KVCache

        self.sock.sendall(ASK.pack(RESET, 0))
        cache = [KVCache() for _ in self.second]
        tokens, times, ids = [], [], list(prompt)
        for _ in range(max_tokens):
            h = run_layers(self.second, self._hop(ids).astype(self.model.model.norm.weight.dtype), cache)
            logits = self.project(self.norm(h[:, -1:, :]))
            token = mx.argmax(logits[0, -1]).item()
            tokens.append(token)
            times.append(time.perf_counter())
            ids = [token]
        return tokens, times

    def transport_us(self) -> float:
        """Mean transport per decode hop so far, as meshnode_hop_transport_seconds counts it."""
        return statistics.mean(self.transport) * 1e6

    def close(self) -> None:
        try:
            self.sock.sendall(ASK.pack(QUIT, 0))
            self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.sock.close()


def _compute(seconds: float, big: np.ndarray) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        big.sum()  # 200 MB through the caches, as a stage's matmuls stream its weights


def hop_after_compute_us(hops: int = 60, seconds: float = 0.045) -> float:
    """Median one-way time (µs) of an activation-sized message between two processes on loopback,
    the sender having just streamed 200 MB through its caches for ``seconds``, as a pipeline stage
    has before every send. Both directions; nothing but the socket calls in between."""
    proc, sock = _spawn("--echo", "--hops", str(hops))
    big = np.ones(25_000_000)
    there, back = [], []
    try:
        for _ in range(hops):
            _compute(seconds, big)
            sent = time.perf_counter()
            sock.sendall(b"\0" * 3072)
            arrived, replied = struct.unpack("<dd", _recv(sock, 16 + 3072)[:16])
            back.append(time.perf_counter() - replied)
            there.append(arrived - sent)
        proc.wait(timeout=30)
    finally:
        sock.close()
        if proc.poll() is None:
            proc.kill()
    skip = hops // 10  # the first hops set up the connection and fault pages in
    return statistics.median(there[skip:] + back[skip:]) * 1e6


def _echo(port: int, hops: int, seconds: float = 0.045) -> None:
    big = np.ones(25_000_000)
    sock = _connect(port)
    for _ in range(hops):
        _recv(sock, 3072)
        arrived = time.perf_counter()
        _compute(seconds, big)
        sock.sendall(struct.pack("<dd", arrived, time.perf_counter()) + b"\0" * 3072)
    sock.close()


def tps(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0])


def measure(path: Path, tokens: int, rounds: int) -> dict:
    split = Split(path)
    try:
        split.checked_tps(8)  # kernels compiled, caches warm, tokens checked
        pairs = []
        for i in range(rounds):
            _, ref_times = split.reference(tokens)
            _, split_times = split.generate(split.prompt, tokens)
            pairs.append((tps(ref_times), tps(split_times)))
            print(
                f"round {i}: mlx-lm {pairs[-1][0]:.2f} tok/s, bare split {pairs[-1][1]:.2f} tok/s, "
                f"ratio {pairs[-1][1] / pairs[-1][0]:.3f}",
                flush=True,
            )
        split.checked_tps(tokens)
    finally:
        split.close()
    return {
        "tps": max(s for _, s in pairs),
        "mlx_lm_tps": max(r for r, _ in pairs),
        "ratio": statistics.median(s / r for r, s in pairs),
        "rounds": pairs,
        "transport_us_per_hop": split.transport_us(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "meshnode" / "bench")
    # the parts a child process runs (_spawn): the first stage, or the echo of hop_after_compute_us
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--echo", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hops", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.echo:
        _echo(args.port, args.hops)
        return 0
    if args.child:
        child(args.port, args.model)
        return 0
    try:
        result = measure(bench_model_dir(args.cache), args.tokens, args.rounds)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 1
    result["hop_after_compute_us"] = hop_after_compute_us()
    print(
        f"bare 2-process split: {result['tps']:.2f} tok/s (best round), mlx-lm {result['mlx_lm_tps']:.2f}; "
        f"median ratio {result['ratio']:.3f}; transport per hop {result['transport_us_per_hop']:.0f} µs; one way "
        f"on loopback right after 45 ms of compute through the caches {result['hop_after_compute_us']:.0f} µs"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
