"""Issue 1 benchmark: decode tokens/s of `meshnode run` over HTTP streaming vs mlx_lm.stream_generate.

Same ~100M-parameter float32 model, same prompt, same machine, same run. Prints both figures
and the ratio (target >= 0.95).

    .venv/bin/python benchmarks/decode.py [--tokens 64] [--lookup-rounds 10]

``--lookup-rounds N``: what prompt lookup (``speculative = "prompt_lookup"``) costs through one
node where it finds nothing to guess (random weights rarely repeat themselves): the node runs with
it, and N rounds each ask once without it and once with it, in turns (the node's test drafts file,
harness/drafts.py, switches it per request); prints the median of the rounds' ratios.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    bench_model_dir,
    free_port,
    http_decode_tps,
    mlx_lm_decode_tps,
    param_count,
    parse_args,
    start_node,
    stop,
    wait_healthy,
)
from harness.cluster import node_argv


def main() -> int:
    args = parse_args(__doc__, lambda ap: ap.add_argument("--lookup-rounds", type=int, default=0))
    path = bench_model_dir(args.cache)
    print(f"model: {path.name}, {param_count(path) / 1e6:.0f}M parameters, float32")
    ref = mlx_lm_decode_tps(path, args.tokens)
    print(f"mlx_lm.stream_generate (in process): {ref:.2f} tok/s")
    port = free_port()
    lookup: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        drafts = Path(tmp) / "drafts.json"
        drafts.write_text(json.dumps({"off": True}))
        env = {"MESHNODE_SPECULATIVE": "prompt_lookup"} if args.lookup_rounds else {}
        node = start_node(
            node_argv(
                path,
                host="127.0.0.1",
                http_port=port,
                grpc_port=0,
                mdns=False,
                state_dir=tmp,
                budget="8GiB",
                max_context=2048,
                drafts=drafts if args.lookup_rounds else None,
            ),
            env=env,
            log=Path(tmp) / "node.log",
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url)
            tps, n = http_decode_tps(url, path.name, args.tokens)
            for r in range(args.lookup_rounds):
                drafts.write_text(json.dumps({"off": True}))
                without = http_decode_tps(url, path.name, args.tokens, repeats=1)[0]
                drafts.write_text(json.dumps({"prompt_lookup": True}))
                lookup.append(http_decode_tps(url, path.name, args.tokens, repeats=1)[0] / without)
                print(f"round {r + 1}: prompt lookup / without {lookup[-1]:.3f}", flush=True)
        finally:
            stop(node)
    ratio = tps / ref
    print(f"meshnode run, HTTP streaming:        {tps:.2f} tok/s ({n} tokens)")
    print(f"ratio: {ratio:.3f} (target >= 0.95)")
    if lookup:
        print(
            f"prompt lookup through one node, where it finds nothing: {statistics.median(lookup):.3f}x without "
            f"(median of {len(lookup)} rounds, {min(lookup):.3f} to {max(lookup):.3f})"
        )
    print(
        json.dumps(
            {"mlx_lm_tps": ref, "meshnode_http_tps": tps, "ratio": ratio, "tokens": n, "lookup_over_without": lookup}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
