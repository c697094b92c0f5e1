"""Where a node's model files come from: the built-in demo, a local directory, or the Hub."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

# The files mlx-lm needs to build a model and its tokenizer (mirrors mlx-lm's own download).
HUB_PATTERNS = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]


class ModelNotFound(RuntimeError):
    pass


def resolve_model(spec: str | None, cache_dir: Path | None = None) -> tuple[str, Path]:
    """(model id, local directory) for a configured model; ``None`` means the demo model."""
    if spec is None:
        from meshnode.demo import DEMO_MODEL_ID, ensure_demo_model

        return DEMO_MODEL_ID, ensure_demo_model(cache_dir / "models" if cache_dir else None)
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} is not an mlx-lm model directory (no config.json)")
        return path.resolve().name, path.resolve()
    if spec.count("/") != 1 or spec.startswith(("/", ".", "~")):
        raise ModelNotFound(f"model {spec!r}: no such directory, and not a Hugging Face id (owner/name)")
    try:
        from huggingface_hub import snapshot_download

        log.info("downloading %s from Hugging Face", spec)
        return spec, Path(snapshot_download(spec, allow_patterns=HUB_PATTERNS))
    except Exception as exc:  # offline, unknown repo, gated, ...
        raise ModelNotFound(f"could not download {spec!r} from Hugging Face: {exc}") from exc
