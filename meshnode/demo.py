"""The built-in demo model: served when no model is configured, so the whole path works offline.

A small random-weight llama with a locally trained tokenizer: gibberish, but it exercises the
whole path without a download. Every machine builds byte-identical files, so demo nodes agree on
the model without exchanging it. Bump :data:`DEMO_VERSION` whenever ``DEMO_ARGS`` or the build
changes, so an old cached build is never taken for the new one.
"""

from __future__ import annotations

import os
from pathlib import Path

from meshnode.model.build import build_once

DEMO_MODEL_ID = "meshnode-demo"
DEMO_VERSION = 1
DEMO_ARGS = dict(num_layers=8, hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=4,
                 vocab_size=1024, dtype="float32", seed=1234)


def default_models_dir() -> Path:
    """``$MESHNODE_CACHE_DIR/models`` if set, else ``models`` under the platform cache directory."""
    if os.environ.get("MESHNODE_CACHE_DIR"):
        return Path(os.environ["MESHNODE_CACHE_DIR"]).expanduser() / "models"
    from meshnode.config import default_cache_dir

    return default_cache_dir() / "models"


def ensure_demo_model(models_dir: Path | None = None) -> Path:
    """The demo model's directory, ``<models_dir>/meshnode-demo-v<N>``, built once (atomically) if missing."""
    root = Path(models_dir) if models_dir is not None else default_models_dir()
    return build_once(root / f"{DEMO_MODEL_ID}-v{DEMO_VERSION}", "llama", **DEMO_ARGS)
