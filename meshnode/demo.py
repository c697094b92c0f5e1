"""The built-in demo model: served when no model is configured, so the whole path works offline.

A small llama with random weights from a fixed seed and a locally trained tokenizer with a chat
template. The build is deterministic, so every machine builds byte-identical weights and a mesh
of demo nodes agrees on the model without downloading anything.
"""

from __future__ import annotations

import os
from pathlib import Path

from meshnode.modelbuild import model_dir_for

DEMO_MODEL_ID = "meshnode-demo"
DEMO_ARGS = dict(num_layers=8, hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=4,
                 vocab_size=1024, dtype="float32", seed=1234)


def default_models_dir() -> Path:
    if os.environ.get("MESHNODE_CACHE_DIR"):
        return Path(os.environ["MESHNODE_CACHE_DIR"]) / "models"
    from meshnode.config import default_cache_dir

    return default_cache_dir() / "models"


def ensure_demo_model(models_dir: Path | None = None) -> Path:
    """The demo model's directory, built (once, atomically) if missing."""
    return model_dir_for(models_dir or default_models_dir(), "llama", **DEMO_ARGS)
