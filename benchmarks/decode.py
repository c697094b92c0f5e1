"""Issue 1 benchmark: decode tokens/s of `meshnode run` over HTTP streaming vs mlx_lm.stream_generate.

Same ~100M-parameter float32 model, same prompt, same machine, same run. Prints both figures
and the ratio (target >= 0.95).

    .venv/bin/python benchmarks/decode.py [--tokens 64]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (bench_model_dir, parse_args, free_port, http_decode_tps, mlx_lm_decode_tps, param_count,
                               start_node, stop, wait_healthy)
from harness.cluster import node_argv


def main() -> int:
    args = parse_args(__doc__)
    path = bench_model_dir(args.cache)
    print(f"model: {path.name}, {param_count(path) / 1e6:.0f}M parameters, float32")
    ref = mlx_lm_decode_tps(path, args.tokens)
    print(f"mlx_lm.stream_generate (in process): {ref:.2f} tok/s")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        node = start_node(node_argv(path, host="127.0.0.1", http_port=port, grpc_port=0, mdns=False, state_dir=tmp,
                                    budget="8GiB", max_context=2048), log=Path(tmp) / "node.log")
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url)
            tps, n = http_decode_tps(url, path.name, args.tokens)
        finally:
            stop(node)
    ratio = tps / ref
    print(f"meshnode run, HTTP streaming:        {tps:.2f} tok/s ({n} tokens)")
    print(f"ratio: {ratio:.3f} (target >= 0.95)")
    print(json.dumps({"mlx_lm_tps": ref, "meshnode_http_tps": tps, "ratio": ratio, "tokens": n}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
