"""Who this node is (a stable node id) and which mesh it belongs to (a public cluster id)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import socket
import sys
import tempfile
from pathlib import Path

from meshnode.durable import fsync_dir
from meshnode.errors import MeshnodeError
from meshnode.ids import NodeId

__all__ = ["IdentityError", "NODE_ID_FILE", "OPEN_CLUSTER", "cluster_id", "load_or_create_node_id", "new_node_id"]

log = logging.getLogger(__name__)

NODE_ID_FILE = "node_id"
OPEN_CLUSTER = "open"
_CLUSTER_ID_INFO = b"meshnode cluster id v1"
VALID_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")  # also fits one DNS label (mDNS)


class IdentityError(MeshnodeError, OSError):
    """The node id could not be read or stored (e.g. the state folder is not writable)."""


def _host_label() -> str:
    name = socket.gethostname() or "host"
    name = name.split(".")[0].lower()
    name = re.sub(r"[^a-z0-9-]+", "-", name).strip("-")
    return (name[:24].strip("-")) or "host"


def new_node_id() -> str:
    """A fresh, readable id such as ``mac-studio-3fa9c1`` or ``linux-nuc-07be42``."""
    prefix = "mac" if sys.platform == "darwin" else "linux" if sys.platform.startswith("linux") else "node"
    return f"{prefix}-{_host_label()}-{secrets.token_hex(3)}"


def _read_id(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        log.warning("cannot read node id from %s (%s); making a new one", path, exc)
        return None
    if VALID_ID.match(text):
        return text
    log.warning("node id file %s holds an invalid id; making a new one", path)
    return None


def load_or_create_node_id(state_dir: Path, configured: str | None) -> NodeId:
    """The node id: ``configured``, else the one stored in ``state_dir/node_id``, else a new one
    stored there atomically (racing processes agree on one)."""
    if configured:
        if not VALID_ID.match(configured):
            raise ValueError(f"invalid node id {configured!r}")
        return NodeId(configured)
    state_dir = Path(state_dir).expanduser()
    path = state_dir / NODE_ID_FILE
    existing = _read_id(path)
    if existing is not None:
        return NodeId(existing)
    node_id = new_node_id()
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".node_id.", dir=state_dir)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(node_id + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o644)
            try:
                os.link(tmp, path)  # atomic, and fails if another process got there first
            except FileExistsError:
                winner = _read_id(path)
                if winner is not None:
                    return NodeId(winner)
                os.replace(tmp, path)  # an invalid or unreadable file: replace it
            except OSError:
                # file systems without hard links: fall back to an atomic rename
                os.replace(tmp, path)
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        fsync_dir(state_dir)
    except OSError as exc:
        raise IdentityError(
            f"cannot store the node id in {path}: {exc.strerror or exc} "
            "(set state_dir / MESHNODE_STATE_DIR to a writable folder, or give --node-id)"
        ) from exc
    log.info("new node id %s (stored in %s)", node_id, path)
    return NodeId(node_id)


def cluster_id(cluster_key: str | None) -> str:
    """The mesh's public id, announced over mDNS: 16 hex characters of an HMAC of the key (a weak
    key can be guessed offline from it). No key: ``"open"``."""
    if not cluster_key:
        return OPEN_CLUSTER
    return hmac.new(cluster_key.encode("utf-8"), _CLUSTER_ID_INFO, hashlib.sha256).hexdigest()[:16]
