"""What this build is, and which peers it can talk to.

``describe()`` is the release and, where meshnode runs from a git checkout, the commit: two builds
of one release apart in history tell apart in ``/v1/mesh``, ``meshnode status`` and the log.
``PROTOCOL`` numbers the wire contract (protos/mesh.proto and the data port's frames); a peer
speaking one outside ``OLDEST_PROTOCOL..PROTOCOL`` is refused, with both named.
"""

from __future__ import annotations

import functools
from pathlib import Path

from meshnode import __version__

PROTOCOL = 1
# Builds from before protocols were announced send 0; their wire is protocol 1's.
OLDEST_PROTOCOL = 0


@functools.cache
def commit() -> str:
    """The checkout's commit, abbreviated ("" outside a git checkout)."""
    return checkout_commit(Path(__file__).resolve().parent.parent)


def checkout_commit(root: Path) -> str:
    """The commit checked out at ``root``, abbreviated, read from its git folder without running git
    (a clone, a worktree, a detached head; "" where there is none)."""
    git = root / ".git"
    try:
        if git.is_file():  # a worktree or submodule: "gitdir: <path>"
            git = (git.parent / git.read_text().strip().removeprefix("gitdir: ")).resolve()
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head[:9]
        ref = head[5:]
        if (git / "commondir").is_file():  # a worktree's branches live in the main repository's folder
            git = (git / (git / "commondir").read_text().strip()).resolve()
        loose = git / ref
        if loose.exists():
            return loose.read_text().strip()[:9]
        for line in (git / "packed-refs").read_text().splitlines():
            sha, _, name = line.partition(" ")
            if name == ref:
                return sha[:9]
    except OSError:
        pass
    return ""


def describe() -> str:
    """``0.1.0+g2869ad1c0``: the release, and the commit where known."""
    return f"{__version__}+g{commit()}" if commit() else __version__


def incompatible(node_id: str, version: str, protocol: int) -> str:
    """Why this node cannot talk to a peer that speaks ``protocol`` ("" if it can)."""
    if OLDEST_PROTOCOL <= protocol <= PROTOCOL:
        return ""
    return (
        f"{node_id} (meshnode {version or '?'}) speaks wire protocol {protocol}; this node (meshnode "
        f"{describe()}) speaks {OLDEST_PROTOCOL} to {PROTOCOL}: run one release on every node"
    )
