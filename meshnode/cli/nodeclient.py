"""Asking a running node from the command line: where its HTTP API is, and one JSON call.

Standard library only, so these commands start fast.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from meshnode.config import ConfigError, load_settings

DEFAULT_STATUS_URL = "http://127.0.0.1:8470"


def fetch_json(url: str, timeout: float, api_key: str | None, body: Any = None) -> tuple[int, Any]:
    """(HTTP status, parsed JSON body or None); raises URLError/OSError when nothing answered."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Accept": "application/json", "Content-Type": "application/json"}
    )
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            code, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        code, raw = exc.code, exc.read()
    try:
        return code, json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return code, None


def service_config() -> Path | None:
    """The installed service's config file: per-user first, then the system's; None when there is none."""
    from meshnode import service

    for system in (False, True):
        try:
            path = service.layout(service.host_platform(), system=system).config_file
            if path.is_file() and os.access(path, os.R_OK):
                return path
        except (OSError, KeyError, ValueError):
            continue
    return None


def default_status_url(config: Path | None = None) -> tuple[str, str | None]:
    """(URL, api key) from ``config``, else $MESHNODE_CONFIG, else the installed service's config file."""
    if config is None and not os.environ.get("MESHNODE_CONFIG"):
        config = service_config()
    try:
        settings = load_settings(config)
    except ConfigError:
        return DEFAULT_STATUS_URL, os.environ.get("MESHNODE_API_KEY") or None
    host = settings.host
    if host in ("0.0.0.0", "::", "", "*"):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    port = settings.http_port or 8470
    return f"http://{host}:{port}", settings.api_key
