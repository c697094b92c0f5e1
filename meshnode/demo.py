"""The demo model, served when none is configured: a small random-weight llama built byte-identical
on every machine, so all works offline. Bump :data:`DEMO_VERSION` when ``DEMO_ARGS`` or the build changes."""

from __future__ import annotations

import os
from pathlib import Path

from meshnode.model.build import build_once

DEMO_MODEL_ID = "meshnode-demo"
DEMO_VERSION = 1
DEMO_ARGS = dict(
    num_layers=8,
    hidden_size=256,
    intermediate_size=512,
    num_heads=8,
    num_kv_heads=4,
    vocab_size=1024,
    dtype="float32",
    seed=1234,
)


def default_models_dir() -> Path:
    """``$MESHNODE_CACHE_DIR/models`` if set, else ``models`` in the platform cache directory."""
    if os.environ.get("MESHNODE_CACHE_DIR"):
        return Path(os.environ["MESHNODE_CACHE_DIR"]).expanduser() / "models"
    from meshnode.config import default_cache_dir

    return default_cache_dir() / "models"


def ensure_demo_model(models_dir: Path | None = None) -> Path:
    """The demo model's directory, built once (atomically) if missing."""
    root = Path(models_dir) if models_dir is not None else default_models_dir()
    return build_once(root / f"{DEMO_MODEL_ID}-v{DEMO_VERSION}", "llama", **DEMO_ARGS)
