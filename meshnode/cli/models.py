"""``meshnode models``: what a running node offers (several models on one mesh).

``add`` and ``remove`` change what the node offers, kept across restarts. Standard library only.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
from typing import Any

from meshnode.cli.nodeclient import default_status_url, fetch_json

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def add_parser(sub: argparse._SubParsersAction[Any]) -> None:  # of the caller's parser class
    models = sub.add_parser(
        "models",
        help="list the mesh's models, or add or remove one this node offers",
        description="Several models on one mesh: `list` shows every model it serves and its state (ready, "
        "loading, on demand, does not fit); `add M` makes this node offer model M (a model folder, "
        "a GGUF file, ollama:NAME[:TAG] or a Hugging Face id) and `remove M` stops offering it. "
        "The change is kept across restarts.",
    )
    models.add_argument("action", choices=("list", "add", "remove"))
    models.add_argument(
        "model", nargs="?", help="the model (add: a folder, a GGUF file, ollama:NAME[:TAG] or an id; remove: its id)"
    )
    models.add_argument("--url", help="the node's HTTP address (default: from the node's config)")
    models.add_argument("--config", metavar="FILE", help="the node's config file, for its port and API key")
    models.add_argument(
        "--api-key", metavar="KEY", help="Bearer key if the node needs one (default: $MESHNODE_API_KEY)"
    )
    models.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds to wait (add may fetch the model's files from peers; default 600)",
    )
    models.set_defaults(handler=cmd_models)


def cmd_models(args: argparse.Namespace) -> int:
    from pathlib import Path

    if args.action != "list" and not args.model:
        print(f"meshnode models {args.action}: name the model", file=sys.stderr)
        return EXIT_USAGE
    default_url, default_key = default_status_url(Path(args.config) if args.config else None)
    base = (args.url or default_url).rstrip("/")
    if "://" not in base:
        base = "http://" + base
    key = args.api_key or default_key
    try:
        if args.action == "list":
            code, data = fetch_json(base + "/v1/mesh", args.timeout, key)
        else:
            code, data = fetch_json(base + "/v1/admin/models", args.timeout, key, {args.action: args.model})
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"meshnode models: cannot reach a node at {base}: {getattr(exc, 'reason', exc)}", file=sys.stderr)
        return EXIT_USAGE
    if code != 200 or not isinstance(data, dict):
        detail = data.get("error", {}).get("message", "") if isinstance(data, dict) else ""
        print(f"meshnode models: HTTP {code}: {detail}", file=sys.stderr)
        return EXIT_FAIL
    if args.action == "list":
        print(format_models(data))
    else:
        print(
            f"{data['model']}: {'offered' if data['offered'] else 'no longer offered'} by this node "
            f"(it offers: {', '.join(data['offered_here']) or 'none'})"
        )
    return EXIT_OK


def format_models(mesh: dict[str, Any]) -> str:
    """One line per model of a node's /v1/mesh: its state and where its layers are."""
    lines = []
    for m in mesh.get("models", []):
        plan = m.get("plan") or {}
        where = (
            " | ".join(
                f"{s['start_layer']}-{s['end_layer'] - 1}@{'+'.join(s['nodes'])}" for s in plan.get("stages", [])
            )
            or plan.get("reason")
            or m.get("plan_error")
            or ""
        )
        lines.append(
            f"{m['model']:<28} {m.get('state', '?'):<13} {'offered here' if m.get('offered_here') else '':<13}{where}"
        )
    return "\n".join(lines) or "no models"
