"""Earlier builds of meshnode, from this repository's own history, to run beside this one."""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def missing(commit: str) -> str | None:
    """Why ``commit`` cannot be checked out here (None if it can): not a git checkout, or a
    shallow clone without it."""
    try:
        found = subprocess.run(
            ["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True, timeout=20
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"git is not usable: {exc}"
    return None if found.returncode == 0 else f"commit {commit} is not in this clone's history (a shallow clone?)"


def checkout(commit: str, dest: Path) -> Path:
    """The source tree of ``commit`` in ``dest`` (git archive: no .git, so it calls itself by its
    release alone, as an installed package does)."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest.parent / f"{dest.name}.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "--output", str(archive), commit], check=True, timeout=60)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    archive.unlink()
    return dest
