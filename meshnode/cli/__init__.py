"""The ``meshnode`` command: ``run``, ``status``, ``plan``, ``install``, ``uninstall``.

Imports stay light here (no mlx, grpc or aiohttp at module level) so that ``meshnode --help`` and
``meshnode status`` start fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TextIO

from meshnode.cli import models as models_cli
from meshnode.cli.dryrun import cluster_from_mesh, format_plan, load_cluster
from meshnode.cli.nodeclient import DEFAULT_STATUS_URL, default_status_url, fetch_json
from meshnode.cli.status import format_status, status_exit_code
from meshnode.config import ConfigError, Settings, load_settings
from meshnode.version import PROTOCOL, describe

if TYPE_CHECKING:
    from meshnode import service

__all__ = ["build_parser", "main", "setup_logging", "format_status", "status_exit_code"]

log = logging.getLogger("meshnode")

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
LOG_DATEFMT = "%Y-%m-%d %H:%M:%S"


# --------------------------------------------------------------------------- parser


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's usage errors: exit 2 with a short message
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="meshnode",
        description="Run one large language model across the machines of a home lab.",
    )
    parser.add_argument("--version", action="version", version=f"meshnode {describe()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    run = sub.add_parser(
        "run",
        help="run a node (serves the API and joins the mesh)",
        description=(
            "Run a node. Settings come from defaults < --config FILE < MESHNODE_* environment < these "
            "flags; see configs/default.toml for every setting."
        ),
    )
    run.add_argument("--config", metavar="FILE", type=Path, help="TOML config file (default: $MESHNODE_CONFIG)")
    run.add_argument(
        "--model",
        metavar="M",
        action="append",
        help="local mlx-lm model directory, GGUF file, ollama:NAME[:TAG] or Hugging Face id "
        "(default: demo); repeatable: the first is `model`, the others `models` (several "
        "models on one mesh)",
    )
    run.add_argument("--host", metavar="ADDR", help="bind address for HTTP and gRPC (default 0.0.0.0)")
    run.add_argument("--http-port", metavar="N", help="HTTP API port (default 8470)")
    run.add_argument("--grpc-port", metavar="N", help="gRPC port for peers (default 8471)")
    run.add_argument("--node-id", metavar="ID", help="this node's id (default: generated once and kept)")
    run.add_argument(
        "--cluster-key",
        metavar="KEY",
        help="shared secret of the mesh (prefer MESHNODE_CLUSTER_KEY: flags are visible in ps)",
    )
    run.add_argument(
        "--memory-budget", metavar="SIZE", help="memory to offer, e.g. 16GiB (default: a fraction of free)"
    )
    run.add_argument(
        "--peer",
        metavar="HOST:PORT",
        action="append",
        dest="peers",
        help="a static peer's gRPC address (repeatable; replaces peers from the config file and environment)",
    )
    run.add_argument(
        "--encrypt",
        action="store_const",
        const=True,
        dest="encrypt",
        help="encrypt gRPC between nodes (mutual TLS from the cluster key, so it needs one)",
    )
    run.add_argument("--no-mdns", action="store_const", const=False, dest="mdns", help="do not use mDNS")
    run.add_argument(
        "--strategy",
        choices=("auto", "single", "pipeline", "tensor", "hybrid"),
        help="how the coordinator splits the model (default auto: the least estimated time per token)",
    )
    run.add_argument(
        "--max-context",
        metavar="N",
        help="tokens of context per request (default 0: the model's own, lowered only as far as memory requires)",
    )
    run.add_argument("--kv-requests", metavar="N", help="requests at once whose KV cache a plan reserves (default 2)")
    run.add_argument("--kv-bits", metavar="N", help="quantize the KV cache to 4 or 8 bits (default 0: off)")
    run.add_argument(
        "--speculative",
        choices=("auto", "off", "prompt-lookup", "draft-model"),
        help="guess tokens ahead and check them in one pass (default auto: prompt lookup where the model is split)",
    )
    run.add_argument(
        "--draft-model", metavar="M", help="a small model with the served model's tokenizer, for draft-model"
    )
    run.add_argument("--draft-max", metavar="N", help="the most tokens guessed per pass (default 8)")
    run.add_argument("--state-dir", metavar="DIR", help="folder for the node's state (node id)")
    run.add_argument("--cache-dir", metavar="DIR", help="folder for cached models")
    run.add_argument("--log-level", metavar="L", help="DEBUG, INFO, WARNING, ERROR or CRITICAL (default INFO)")
    run.set_defaults(handler=cmd_run)

    status = sub.add_parser(
        "status",
        help="show a running node's view of the mesh",
        description=(
            "Ask a node for GET /v1/mesh and summarise it: this node, its peers, the coordinator, the plan, "
            "the measured links and its health. Exit status: 0 healthy (serving, and every peer that mDNS "
            "announces answers), 1 answered but not healthy (or refused), 2 no node answered."
        ),
    )
    status.add_argument(
        "--url", help=f"the node's HTTP address (default: from the node's config, else {DEFAULT_STATUS_URL})"
    )
    status.add_argument(
        "--config",
        metavar="FILE",
        type=Path,
        help="the node's config file, for its port and API key (default: $MESHNODE_CONFIG, "
        "else the installed service's)",
    )
    status.add_argument("--json", action="store_true", help="print the raw JSON")
    status.add_argument("--timeout", type=float, default=3.0, metavar="S", help="seconds to wait (default 3)")
    status.add_argument(
        "--api-key", metavar="KEY", help="Bearer key if the node needs one (default: $MESHNODE_API_KEY)"
    )
    status.set_defaults(handler=cmd_status)

    plan = sub.add_parser(
        "plan",
        help="dry run: how a model would be placed on the mesh, the alternatives and why",
        description="Plan a model on the live mesh (--url) or on a cluster described in a TOML file (--cluster, "
        "see configs/example-cluster.toml) without changing anything: the chosen plan, the "
        "alternatives with estimated tokens/s and memory per node, and why.",
    )
    plan.add_argument("--model", required=True, metavar="DIR", help="the model directory (config.json + safetensors)")
    where = plan.add_mutually_exclusive_group()
    where.add_argument("--cluster", metavar="FILE.toml", help="a described cluster: [[node]] and [[link]] tables")
    where.add_argument("--url", help=f"a live node whose /v1/mesh lists the nodes (default {DEFAULT_STATUS_URL})")
    plan.add_argument("--strategy", choices=("single", "pipeline", "tensor", "hybrid"), help="force a strategy")
    plan.add_argument(
        "--max-context",
        type=int,
        default=0,
        metavar="N",
        help="tokens of context (default 0: the model's own, lowered only as far as memory requires)",
    )
    plan.add_argument(
        "--kv-requests",
        type=int,
        default=2,
        metavar="N",
        help="requests at once whose KV cache each stage holds (default 2, as a node)",
    )
    plan.add_argument(
        "--kv-bits",
        type=int,
        default=0,
        choices=(0, 4, 8),
        metavar="N",
        help="quantize the KV cache to 4 or 8 bits (default 0: off)",
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--timeout", type=float, default=3.0, metavar="S", help="seconds to wait for --url")
    plan.set_defaults(handler=cmd_plan)
    install = sub.add_parser(
        "install",
        help="install meshnode as a launchd (macOS) or systemd (Linux) service and start it",
        description=(
            "Write the service (a per-user LaunchAgent / systemd user unit; --system: a LaunchDaemon / "
            "system unit) running `meshnode run --config FILE`, create FILE with a new cluster key unless "
            "it exists (the key is printed once; on the next machines, give the first one's key in "
            "MESHNODE_CLUSTER_KEY instead), and start the service at once and at every boot."
        ),
    )
    uninstall = sub.add_parser(
        "uninstall",
        help="stop and remove the meshnode service",
        description="Stop the service and remove the files install wrote; the config (with the cluster key) "
        "and the logs stay unless --purge.",
    )
    for service_cmd, handler in ((install, cmd_install), (uninstall, cmd_uninstall)):
        service_cmd.add_argument(
            "--system",
            action="store_true",
            help="a system service (LaunchDaemon / system unit; needs root), not a per-user one",
        )
        service_cmd.add_argument("--dry-run", action="store_true", help="print every file and command, change nothing")
        service_cmd.add_argument(
            "--platform", choices=("macos", "linux"), help="the platform to show with --dry-run (default: this one)"
        )
        service_cmd.add_argument("--root", type=Path, default=Path("/"), help=argparse.SUPPRESS)  # tests
        service_cmd.add_argument("--home", type=Path, help=argparse.SUPPRESS)  # tests
        service_cmd.set_defaults(handler=handler)
    install.add_argument(
        "--executable", metavar="PATH", type=Path, help="the meshnode program the service runs (default: this one)"
    )
    uninstall.add_argument("--purge", action="store_true", help="also remove the config (cluster key) and the logs")
    models_cli.add_parser(sub)
    return parser


# --------------------------------------------------------------------------- logging


class _SecretFilter(logging.Filter):
    """Replaces the literal text of secrets in every log record (code never logs them: belt and braces)."""

    def __init__(self, secrets: Sequence[str]):
        super().__init__()
        self.secrets = [s for s in secrets if s and len(s) >= 4]

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secrets:
            message = record.getMessage()
            cleaned = message
            for secret in self.secrets:
                cleaned = cleaned.replace(secret, "<redacted>")
            if cleaned != message:
                record.msg, record.args = cleaned, None
        return True


def setup_logging(settings: Settings, stream: TextIO | None = None) -> None:
    """Root logging: ``time level logger: message`` on stderr, at settings.log_level."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATEFMT))
    handler.addFilter(_SecretFilter([settings.cluster_key or "", settings.api_key or ""]))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(settings.log_level)
    if settings.log_level != "DEBUG":
        for noisy in ("asyncio", "aiohttp.access", "zeroconf", "urllib3", "filelock", "huggingface_hub"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


# --------------------------------------------------------------------------- run


_RUN_FLAGS = (
    "model",
    "host",
    "http_port",
    "grpc_port",
    "node_id",
    "cluster_key",
    "memory_budget",
    "peers",
    "mdns",
    "encrypt",
    "strategy",
    "max_context",
    "kv_requests",
    "kv_bits",
    "speculative",
    "draft_model",
    "draft_max",
    "state_dir",
    "cache_dir",
    "log_level",
)


def settings_from_args(args: argparse.Namespace, env: dict[str, str] | None = None) -> Settings:
    flags = {name: getattr(args, name, None) for name in _RUN_FLAGS}
    if isinstance(flags["model"], list):  # --model repeated: the first, then the others offered
        flags["model"], more = flags["model"][0], flags["model"][1:]
        flags["models"] = more or None
    return load_settings(args.config, env=env, flags=flags)


def cmd_run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)  # ConfigError is handled in main()
    setup_logging(settings)
    log.info("meshnode %s (wire protocol %d) starting", describe(), PROTOCOL)
    log.debug("settings: %s", json.dumps(settings.redacted(), sort_keys=True))
    from meshnode.node import run_node  # lazy: pulls in mlx, grpc, aiohttp

    try:
        return int(run_node(settings) or 0)
    except KeyboardInterrupt:
        return 130
    except OSError as exc:
        # e.g. a port in use, or a state folder that is not writable: a message, not a traceback
        log.debug("start-up failed", exc_info=True)
        log.error("%s", exc)
        return EXIT_FAIL


# --------------------------------------------------------------------------- status


def cmd_status(args: argparse.Namespace) -> int:
    default_url, default_key = default_status_url(args.config)
    base = (args.url or default_url).rstrip("/")
    if "://" not in base:
        base = "http://" + base
    api_key = args.api_key or default_key
    url = base + "/v1/mesh"
    try:
        code, data = fetch_json(url, args.timeout, api_key)
    except (urllib.error.URLError, OSError, ValueError) as exc:  # ValueError: a malformed URL
        reason = getattr(exc, "reason", exc)
        print(f"meshnode status: cannot reach a node at {base}: {reason}", file=sys.stderr)
        print("Is `meshnode run` running there? (use --url to ask another address)", file=sys.stderr)
        return EXIT_USAGE
    if code == 401:
        print(f"meshnode status: {base} wants an API key (give --api-key or set MESHNODE_API_KEY)", file=sys.stderr)
        return EXIT_FAIL
    if code != 200 or not isinstance(data, dict):
        detail = ""
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            detail = f": {data['error'].get('message', '')}"
        what = f"HTTP {code}" if code != 200 else "something that is not a JSON object"
        print(f"meshnode status: {url} answered {what}{detail}", file=sys.stderr)
        return EXIT_FAIL
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print(format_status(data))
    return status_exit_code(data)


# --------------------------------------------------------------------------- plan


def cmd_plan(args: argparse.Namespace) -> int:
    from meshnode.planner import PlanError
    from meshnode.planner import plan as make_plan
    from meshnode.planner.context import plan_longest_context
    from meshnode.weights.profile import profile_model

    try:
        profile = profile_model(Path(args.model))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"meshnode plan: cannot read the model at {args.model}: {exc}", file=sys.stderr)
        return EXIT_FAIL
    try:
        if args.cluster:
            nodes, links = load_cluster(Path(args.cluster))
        else:
            url, key = (args.url, os.environ.get("MESHNODE_API_KEY") or None) if args.url else default_status_url()
            code, data = fetch_json(url.rstrip("/") + "/v1/mesh", args.timeout, key)
            if code != 200 or not isinstance(data, dict):
                print(f"meshnode plan: {url} answered HTTP {code} without a mesh", file=sys.stderr)
                return EXIT_FAIL
            nodes, links = cluster_from_mesh(data)
    except (urllib.error.URLError, OSError) as exc:
        print(f"meshnode plan: cannot reach the node: {exc}", file=sys.stderr)
        return EXIT_FAIL
    except ValueError as exc:
        print(f"meshnode plan: {exc}", file=sys.stderr)
        return EXIT_FAIL
    try:
        result = plan_longest_context(
            lambda ctx: make_plan(
                profile,
                nodes,
                max_context=ctx,
                strategy=args.strategy,
                links=links,
                requests=args.kv_requests,
                kv_bits=args.kv_bits,
            ),
            profile.trained_context,
            args.max_context,
        )
    except PlanError as exc:
        if args.json:
            print(json.dumps({"model": profile.name, "error": exc.reasons}, indent=2))
        else:
            print(f"no plan for {profile.name} on {len(nodes)} node(s):")
            for reason in exc.reasons:
                print(f"  - {reason}")
        return EXIT_FAIL
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(f"model        {profile.name} ({profile.num_layers} layers, {profile.model_type})")
        print(format_plan(result, nodes, links))
    return EXIT_OK


# --------------------------------------------------------------------------- install, uninstall


def _service_layout(args: argparse.Namespace) -> service.Layout | None:
    """The service Layout for the arguments, or None after printing why they cannot be used."""
    from meshnode import service  # lazy: only these commands need it

    platform = args.platform or service.host_platform()
    if platform != service.host_platform() and not args.dry_run:
        print(f"meshnode {args.command}: --platform {platform} on this machine needs --dry-run", file=sys.stderr)
        return None
    return service.layout(platform, system=args.system, root=args.root, home=args.home)


def _service_apply(args: argparse.Namespace, act: service.Action, uninstall: bool) -> int:
    from meshnode import service

    if args.dry_run:
        print(f"# meshnode {args.command} --dry-run: nothing is changed; a real run does this:")
        print(service.describe(act, uninstall=uninstall), end="")
        return EXIT_OK
    try:
        service.apply(act, uninstall=uninstall)
    except PermissionError as exc:
        hint = " (a --system service needs root: run it with sudo)" if args.system else ""
        print(f"meshnode {args.command}: {exc}{hint}", file=sys.stderr)
        return EXIT_FAIL
    except (service.CommandFailed, OSError) as exc:
        print(f"meshnode {args.command}: {exc}", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_OK


def cmd_install(args: argparse.Namespace) -> int:
    from meshnode import service

    lay = _service_layout(args)
    if lay is None:
        return EXIT_USAGE
    try:
        executable = args.executable or service.default_executable()
    except FileNotFoundError as exc:
        print(f"meshnode install: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        act = service.plan_install(
            lay, executable, dry_run=args.dry_run, cluster_key=os.environ.get("MESHNODE_CLUSTER_KEY") or None
        )
    except FileNotFoundError as exc:  # the templates are missing from this installation
        print(f"meshnode install: {exc}", file=sys.stderr)
        return EXIT_FAIL
    return _service_apply(args, act, uninstall=False)


def cmd_uninstall(args: argparse.Namespace) -> int:
    from meshnode import service

    lay = _service_layout(args)
    if lay is None:
        return EXIT_USAGE
    return _service_apply(args, service.plan_uninstall(lay, purge=args.purge), uninstall=True)


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors
        return int(exc.code) if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    if not getattr(args, "handler", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        handler: Callable[[argparse.Namespace], int] = args.handler
        return handler(args)
    except ConfigError as exc:
        print(f"meshnode: configuration error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
