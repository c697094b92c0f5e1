"""Layers from Hugging Face: the small files first, weight headers over HTTP ranges, then only a stage's files."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshnode.proto import mesh_pb2
from meshnode.weights.manifest import (
    PARTIAL_MARKER,
    folder_name,
    manifest_to_dict,
    model_digest,
    num_layers_of,
    read_marker,
)
from meshnode.weights.transfer import DiskSpaceError, FetchError, free_bytes

log = logging.getLogger(__name__)

HUB_SOURCE = "hub"  # the marker's "source" of folders written here
_HUB_TRIES = 5  # per weight file, each resuming from the bytes on disk


def is_hub_id(model_id: str) -> bool:
    """Whether ``model_id`` reads as a Hugging Face repository id (owner/name)."""
    return (
        model_id.count("/") == 1
        and not model_id.startswith(("/", ".", "~"))
        and all(part and not part.startswith(".") for part in model_id.split("/"))
    )


# The files mlx-lm downloads for a model; weight files come per stage, the rest at start-up.
HUB_PATTERNS = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]


def _small_patterns() -> list[str]:
    return [p for p in HUB_PATTERNS if not p.endswith(".safetensors")]


def _remote_header(model_id: str, filename: str, revision: str) -> tuple[int, dict[str, Any]]:
    """(header length with prefix, JSON header) of a Hub safetensors file, by HTTP ranges."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    from meshnode.weights.weightfiles import decode_safetensors_header

    url = hf_hub_url(model_id, filename, revision=revision)
    headers = build_hf_headers()

    def get(first: int, last: int) -> bytes:
        r = get_session().get(
            url,
            headers={**headers, "Range": f"bytes={first}-{last}", "Accept-Encoding": "identity"},
            follow_redirects=True,
            timeout=30,
        )
        hf_raise_for_status(r)
        body = r.content
        if r.status_code == 200:  # the server ignored the range: cut the whole body down
            body = body[first : last + 1]
        return body

    return decode_safetensors_header(get(0, 64 * 1024 - 1), get, f"{model_id}/{filename}")


def _remote_entry(model_id: str, revision: str, path: str, size: int, sha256: str | None) -> mesh_pb2.FileEntry:
    """A weight file's manifest entry from its remote header; its tensors carry no digests yet."""
    header_length, header = _remote_header(model_id, path, revision)
    entry = mesh_pb2.FileEntry(path=path, size=size, sha256=sha256 or "", header_length=header_length)
    for name, info in sorted(header.items(), key=lambda kv: int(kv[1]["data_offsets"][0])):
        s, e = (int(x) for x in info["data_offsets"])
        if e < s or header_length + e > size:
            raise ValueError(f"{model_id}/{path}: tensor {name} lies outside the file")
        entry.tensors.append(
            mesh_pb2.TensorEntry(
                name=name,
                dtype=str(info["dtype"]),
                shape=[int(d) for d in info["shape"]],
                offset=header_length + s,
                length=e - s,
            )
        )
    return entry


def _link_folder(dest: Path, links: dict[str, Path], marker: dict[str, Any]) -> Path:
    """Write ``dest`` (symlinks ``rel -> target`` plus the marker) and publish it by one rename."""
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
    tmp.mkdir(parents=True)
    try:
        for rel, target in sorted(links.items()):
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.realpath(target), tmp / rel)
        (tmp / PARTIAL_MARKER).write_text(json.dumps(marker))
        old = None
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}-{time.monotonic_ns()}")
            os.replace(dest, old)
        os.replace(tmp, dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def hub_metadata(model_id: str, cache_root: Path, *, revision: str | None = None) -> Path:
    """A folder describing a Hub model without its weights: its small files and a marker with the
    whole manifest, read from headers over HTTP ranges. A complete cached snapshot is returned as is."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.hf_api import RepoFile

    from meshnode.weights.manifest import hash_file, list_files, loaded_weights

    snap = Path(snapshot_download(model_id, allow_patterns=_small_patterns(), revision=revision))
    commit = snap.name
    dest = Path(cache_root) / (folder_name(model_id, 0, 0)[:-4] + "-hub")
    try:
        old = read_marker(dest)
        if (
            old
            and old.get("source") == HUB_SOURCE
            and old.get("revision") == commit
            and all((dest / rel).is_file() for rel in old.get("links", ()))
        ):
            return dest
    except (OSError, ValueError):
        pass
    tree = [f for f in HfApi().list_repo_tree(model_id, revision=commit, recursive=True) if isinstance(f, RepoFile)]
    weights = sorted((f for f in tree if loaded_weights(f.path)), key=lambda f: f.path)
    if not weights:
        raise ValueError(f"{model_id}: no model*.safetensors weights on the Hub")
    if all((snap / f.path).is_file() for f in weights):
        log.info("%s: the whole model is already in the Hugging Face cache (%s)", model_id, snap)
        return snap
    small = [rel for rel in list_files(snap) if not rel.endswith(".safetensors")]
    config = json.loads((snap / "config.json").read_text())
    n_layers = num_layers_of(config)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(8, len(weights))) as pool:
        remote = list(
            pool.map(
                lambda f: _remote_entry(
                    model_id, commit, f.path, int(f.size), f.lfs.sha256 if f.lfs is not None else None
                ),
                weights,
            )
        )
    manifest = mesh_pb2.ModelManifest(model_id=model_id)
    entries = [hash_file(snap / rel, rel) for rel in small] + remote
    for e in sorted(entries, key=lambda e: e.path):
        manifest.files.append(e)
    manifest.digest = model_digest([(f.path, f.sha256) for f in manifest.files])
    log.info(
        "%s: profiled from config and %d weight headers (%.1f MiB of weights on the Hub, none downloaded)",
        model_id,
        len(remote),
        sum(e.size for e in remote) / 2**20,
    )
    marker = {
        "model_id": model_id,
        "digest": manifest.digest,
        "start": 0,
        "end": 0,
        "num_layers": n_layers,
        "source": HUB_SOURCE,
        "revision": commit,
        "links": small,
        "manifest": manifest_to_dict(manifest),
    }
    return _link_folder(dest, {rel: snap / rel for rel in small}, marker)


def hub_layers(
    model_id: str,
    start: int,
    end: int,
    cache_root: Path,
    *,
    metadata: Path | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Download only the Hub weight files a stage of layers [start, end) needs, and return a
    partial folder linking them whose marker lets peers fetch them from here. Every file is checked
    against the Hub's sha256 before use."""
    from meshnode.weights.manifest import hash_file, manifest_from_dict, tensors_for_layers

    cache_root = Path(cache_root)
    marker = None
    if metadata is not None:
        try:
            marker = read_marker(metadata)
        except (OSError, ValueError):
            marker = None
    if not marker or marker.get("source") != HUB_SOURCE or marker.get("model_id") != model_id:
        metadata = hub_metadata(model_id, cache_root)
        marker = read_marker(metadata)
        if marker is None:  # the whole model is in the Hugging Face cache already
            return metadata
    manifest = manifest_from_dict(marker["manifest"])
    n_layers, commit = int(marker["num_layers"]), str(marker["revision"])
    files = {f.path: f for f in manifest.files}
    needed = sorted({path for path, _ in tensors_for_layers(manifest, start, end, n_layers)})
    total = sum(files[p].size for p in needed)
    log.info(
        "downloading layers [%d, %d) of %s from Hugging Face: %d of %d weight files, %.1f MiB",
        start,
        end,
        model_id,
        len(needed),
        sum(1 for f in manifest.files if f.tensors),
        total / 2**20,
    )
    _check_hub_space(model_id, needed, files, cache_root.parent / "hub-blobs")
    done = 0
    local: dict[str, Path] = {}
    for path in needed:
        entry = files[path]
        base = done

        def report(in_file: int, base: int = base) -> None:
            if on_progress is not None:
                on_progress(base + in_file, total)

        local[path] = _download(
            model_id, path, commit, entry.size, entry.sha256, cache_root.parent / "hub-blobs", report
        )
        got = hash_file(local[path], path)  # also each tensor's digest, for peers fetching from here
        if (
            got.size != entry.size
            or (entry.sha256 and got.sha256 != entry.sha256)
            or [(t.name, t.offset, t.length) for t in got.tensors]
            != [(t.name, t.offset, t.length) for t in sorted(entry.tensors, key=lambda t: t.offset)]
        ):
            local[path].unlink(missing_ok=True)
            raise FetchError(f"{model_id}/{path} from Hugging Face does not match its sha256 or headers; removed it")
        entry.CopyFrom(got)
        done += entry.size
        if on_progress is not None:
            on_progress(done, total)
        log.info(
            "downloaded %s/%s (%.1f MiB, %d/%d files, %.1f of %.1f MiB)",
            model_id,
            path,
            entry.size / 2**20,
            needed.index(path) + 1,
            len(needed),
            done / 2**20,
            total / 2**20,
        )
    if not manifest.digest:
        manifest.digest = model_digest([(f.path, f.sha256) for f in manifest.files])
    links = {rel: metadata / rel for rel in marker.get("links", ())}
    links.update(local)
    out = {
        "model_id": model_id,
        "digest": manifest.digest,
        "start": start,
        "end": end,
        "num_layers": n_layers,
        "source": HUB_SOURCE,
        "revision": commit,
        "links": sorted(links),
        "manifest": manifest_to_dict(manifest),
    }
    dest = _link_folder(cache_root / folder_name(model_id, start, end), links, out)
    log.info("%s layers [%d, %d) ready in %s", model_id, start, end, dest)
    return dest


def _download(
    model_id: str, path: str, commit: str, size: int, sha256: str, blobs: Path, report: Callable[[int], None]
) -> Path:
    """``<blobs>/<sha256>``, via a ``.part`` kept when cut off so the next attempt asks only for the
    rest (huggingface_hub would drop it)."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    blobs.mkdir(parents=True, exist_ok=True)
    name = sha256 or hashlib.sha256(f"{model_id}@{commit}/{path}".encode()).hexdigest()
    final, part = blobs / name, blobs / f"{name}.part"
    if final.is_file() and final.stat().st_size == size:
        return final
    url = hf_hub_url(model_id, path, revision=commit)
    for attempt in range(1, _HUB_TRIES + 1):
        have = part.stat().st_size if part.is_file() else 0
        if have > size:
            part.unlink()
            have = 0
        if have < size:
            headers = {**build_hf_headers(), "Accept-Encoding": "identity"}
            if have:
                headers["Range"] = f"bytes={have}-"
                log.info("resuming %s/%s at %.1f of %.1f MiB", model_id, path, have / 2**20, size / 2**20)
            try:
                with get_session().stream("GET", url, headers=headers, follow_redirects=True, timeout=60) as r:
                    if r.status_code >= 400:
                        r.read()
                        hf_raise_for_status(r)
                    if have and r.status_code != 206:  # the server ignored the range: start over
                        have = 0
                    report(have)
                    with open(part, "ab" if have else "wb") as f:
                        for chunk in r.iter_bytes(1 << 20):
                            f.write(chunk)
                            have += len(chunk)
                            report(have)
            except HfHubHTTPError as exc:
                if exc.response is not None and exc.response.status_code in (401, 403, 404):
                    raise
                err: Exception | None = exc
            except Exception as exc:  # noqa: BLE001 - the client's cut connection or timeout: keep the part
                err = exc
            else:
                err = None
            if err is not None or part.stat().st_size != size:
                if attempt == _HUB_TRIES:
                    raise FetchError(f"downloading {model_id}/{path} failed {attempt} times: {err}")
                log.warning(
                    "downloading %s/%s stopped at %.1f of %.1f MiB (%s); resuming",
                    model_id,
                    path,
                    (part.stat().st_size if part.is_file() else 0) / 2**20,
                    size / 2**20,
                    err or "short body",
                )
                time.sleep(min(2 ** (attempt - 1), 10))
                continue
        os.replace(part, final)
        return final
    raise FetchError(f"downloading {model_id}/{path} failed")


def _check_hub_space(
    model_id: str, needed: list[str], files: dict[str, mesh_pb2.FileEntry], blobs: Path, reserve: int = 64 << 20
) -> None:
    """Raise DiskSpaceError when ``blobs``' disk cannot take the files still missing."""
    blobs = Path(blobs)
    need = 0
    for path in needed:
        entry = files[path]
        if entry.sha256 and (blobs / entry.sha256).is_file():
            continue
        part = blobs / f"{entry.sha256}.part"
        need += entry.size - (part.stat().st_size if entry.sha256 and part.is_file() else 0)
    free = free_bytes(blobs)
    if need + reserve > free:
        raise DiskSpaceError(
            f"downloading {len(needed)} weight files of {model_id} needs {need / 2**20:,.1f} MiB "
            f"(+{reserve / 2**20:,.0f} MiB reserve) in {blobs}, only {free / 2**20:,.1f} MiB free"
        )
