"""Where a node's model files come from: the built-in demo, a local directory, a GGUF file, or the Hub."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from meshnode.config import default_cache_dir
from meshnode.errors import MeshnodeError
from meshnode.weights.gguf_source import converted_id, is_gguf_spec, resolve_gguf

log = logging.getLogger(__name__)


class ModelNotFound(MeshnodeError, RuntimeError):
    """No model folder, GGUF file or Hugging Face repository by that name (or it cannot be read)."""


def resolve_model(
    spec: str | None, cache_dir: Path | None = None, progress: Callable[[str, int, int], None] | None = None
) -> tuple[str, Path]:
    """(model id, local directory) for a configured model; ``None``: the demo. A GGUF file is
    converted once into a cached folder; a Hub id gives metadata only (stages download weights later)."""
    if spec is None:
        from meshnode.demo import DEMO_MODEL_ID, ensure_demo_model

        return DEMO_MODEL_ID, ensure_demo_model(cache_dir / "models" if cache_dir else None)
    if is_gguf_spec(spec):
        from meshnode.weights.gguf_tensors import UnsupportedGGUF

        try:
            return resolve_gguf(spec, cache_dir if cache_dir is not None else default_cache_dir(), progress)
        except (FileNotFoundError, UnsupportedGGUF) as exc:
            raise ModelNotFound(f"model {spec!r}: {exc}") from exc
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} is not an mlx-lm model directory (no config.json)")
        return converted_id(path) or path.resolve().name, path.resolve()
    if spec.count("/") != 1 or spec.startswith(("/", ".", "~")):
        raise ModelNotFound(f"model {spec!r}: no such directory, and not a Hugging Face id (owner/name)")
    try:
        from meshnode.weights.hub import hub_metadata

        log.info("reading %s from Hugging Face: config, tokenizer and weight headers (weights follow per stage)", spec)
        root = (cache_dir if cache_dir is not None else default_cache_dir()) / "peer-models"
        return spec, hub_metadata(spec, root)
    except Exception as exc:  # offline, unknown repo, gated, ...
        raise ModelNotFound(f"could not read {spec!r} from Hugging Face: {exc}") from exc
