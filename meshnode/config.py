"""One ``Settings`` object for the whole node: defaults < config file (TOML) < environment
(``MESHNODE_<FIELD>``) < flags. Defaults live only in :class:`Settings`; ``configs/default.toml``
documents every key. Values parse alike in every source; an empty string means "not set"."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal, get_args

from meshnode.errors import MeshnodeError
from meshnode.values import (
    STRATEGIES,
    Strategy,
    as_float,
    as_int,
    as_path,
    as_text,
    bool_or_auto,
    checked,
    keep_alive_map,
    log_level,
    model_list,
    node_id,
    optional,
    origin_list,
    parse_bool,
    parse_duration,
    parse_peer,
    parse_size,
    peer_list,
    plan_layout,
    port,
    positive_duration,
    positive_int,
)
from meshnode.weights.kvquant import KV_BITS

__all__ = [
    "ConfigError",
    "ENV_PREFIX",
    "Settings",
    "default_cache_dir",
    "default_state_dir",
    "load_settings",
    "parse_bool",
    "parse_duration",
    "parse_peer",
    "parse_size",
]

ENV_PREFIX = "MESHNODE_"
#: Names a config file when ``load_settings`` gets no ``config_file``.
CONFIG_ENV = "MESHNODE_CONFIG"
SECRET_FIELDS = ("cluster_key", "api_key")

log = logging.getLogger(__name__)


class ConfigError(MeshnodeError, ValueError):
    """An unknown setting or a bad value; the message names the key and its source."""


# The strategy setting: "auto" (the least estimated time per token) or one the coordinator prefers.
StrategySetting = Literal["auto"] | Strategy
STRATEGY_CHOICES: tuple[StrategySetting, ...] = ("auto", *STRATEGIES)
# How tokens are guessed ahead: "auto" (the model's MTP head where it can draft, else prompt lookup
# where the model is split), or as named.
Speculative = Literal["auto", "off", "prompt_lookup", "draft_model", "mtp"]
SPECULATIVE_CHOICES: tuple[Speculative, ...] = get_args(Speculative)
# Whether concurrent decode steps travel through the stages in lockstep; "auto": with OpenBLAS only.
LockstepSetting = bool | Literal["auto"]
# Settings' earlier names -> their names now: read, with a warning, from a config file or the environment.
RENAMED = {"batch_stages": "lockstep"}
TENSOR_PORTS = 16  # ring endpoints: tensor_port + 0..15; group control channels: + 16..31
ECHO_OFFSET = 2 * TENSOR_PORTS  # the link echo
# The data port: activations in bare TCP frames.
DATA_OFFSET = ECHO_OFFSET + 1

_PARSERS: dict[str, Callable[[Any], Any]] = {
    "model": optional(as_text),
    "models": model_list,
    "keep_alive": keep_alive_map,
    "load_timeout": positive_duration,
    "host": checked(lambda v: as_text(v).strip(), bool, "a non-empty address"),
    "http_port": port,
    "grpc_port": port,
    "node_id": optional(node_id),
    "cluster_key": optional(as_text),
    "encrypt": parse_bool,
    "authenticate": parse_bool,
    "memory_budget": optional(checked(parse_size, lambda n: n > 0, "a positive size"), empty=("", "auto")),
    "memory_fraction": checked(as_float, lambda f: 0 < f <= 1, "a fraction 0 < f <= 1"),
    "memory_margin": checked(parse_size, lambda n: n >= 0, "0 (off) or a size"),
    "memory_dwell": positive_duration,
    "max_context": checked(as_int, lambda n: n >= 0, "0 (the model's own context) or a number of tokens"),
    "kv_requests": positive_int,
    "kv_bits": checked(as_int, lambda n: n == 0 or n in KV_BITS, "0 (off) or " + " or ".join(map(str, KV_BITS))),
    "prefill_step_size": positive_int,
    "pipelined_prefill": parse_bool,
    "prompt_cache": parse_bool,
    "prompt_cache_disk": checked(parse_size, lambda n: n >= 0, "0 (off) or a size"),
    "batching": parse_bool,
    "lockstep": bool_or_auto,
    "speculative": checked(
        lambda v: as_text(v).strip().lower().replace("-", "_"),
        lambda v: v in SPECULATIVE_CHOICES,
        "one of " + ", ".join(SPECULATIVE_CHOICES),
    ),
    "draft_max": checked(as_int, lambda n: 1 <= n <= 32, "a number of tokens from 1 to 32"),
    "draft_model": optional(as_text),
    "fast_hops": parse_bool,
    "max_step_ms": checked(as_float, lambda f: f > 0, "a positive number of milliseconds"),
    "max_tokens_limit": positive_int,
    "default_max_tokens": checked(as_int, lambda n: n >= 0, "0 (the room left) or a positive number"),
    "max_body_bytes": checked(parse_size, lambda n: n >= 1, "a positive size"),
    "max_concurrent_requests": positive_int,
    "peers": peer_list,
    "mdns": parse_bool,
    "heartbeat_interval": positive_duration,
    "failure_timeout": positive_duration,
    "failover_deadline": positive_duration,
    "stall_timeout": positive_duration,
    "rebalance_dwell": positive_duration,
    "slow_factor": checked(as_float, lambda f: f == 0 or f > 1, "0 (off) or a factor above 1"),
    "slow_dwell": positive_duration,
    "strategy": checked(
        lambda v: as_text(v).strip().lower(), lambda v: v in STRATEGY_CHOICES, "one of " + ", ".join(STRATEGY_CHOICES)
    ),
    "plan_layout": optional(plan_layout),
    "group_ready_timeout": positive_duration,
    "link_probe_interval": positive_duration,
    "inject_latency_us": checked(as_float, lambda f: 0 <= f <= 1e6, "microseconds from 0 to 1000000"),
    "tensor_port": checked(
        as_int, lambda n: 0 <= n <= 65535 - 2 * TENSOR_PORTS - 1, f"a port from 0 to {65535 - 2 * 16 - 1}"
    ),
    "state_dir": optional(as_path),
    "cache_dir": optional(as_path),
    "api_key": optional(as_text),
    "cors_origins": origin_list,
    "log_level": log_level,
    "access_log": parse_bool,
}


# --------------------------------------------------------------------------- platform defaults


def _is_macos() -> bool:
    return sys.platform == "darwin"


def default_state_dir(environ: Mapping[str, str] | None = None) -> Path:
    """macOS: ~/Library/Application Support/meshnode; elsewhere $XDG_STATE_HOME/meshnode or
    ~/.local/state/meshnode."""
    environ = os.environ if environ is None else environ
    if _is_macos():
        return Path.home() / "Library" / "Application Support" / "meshnode"
    xdg = environ.get("XDG_STATE_HOME", "")
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "meshnode"
    return Path.home() / ".local" / "state" / "meshnode"


def default_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """macOS: ~/Library/Caches/meshnode; elsewhere $XDG_CACHE_HOME/meshnode or ~/.cache/meshnode."""
    environ = os.environ if environ is None else environ
    if _is_macos():
        return Path.home() / "Library" / "Caches" / "meshnode"
    xdg = environ.get("XDG_CACHE_HOME", "")
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "meshnode"
    return Path.home() / ".cache" / "meshnode"


# --------------------------------------------------------------------------- Settings


@dataclass(frozen=True)
class Settings:
    """Everything a node can be told; the only defaults. configs/default.toml documents each key."""

    #: None = the built-in demo model; else a local mlx-lm directory or a Hugging Face id.
    model: str | None = None
    #: More models this node offers.
    models: tuple[str, ...] = ()
    #: Bind address for HTTP and gRPC.
    host: str = "0.0.0.0"
    http_port: int = 8470
    grpc_port: int = 8471
    #: None = generated once and kept in state_dir.
    node_id: str | None = None
    #: Nodes with the same key form one mesh; None = the open cluster. Never logged.
    cluster_key: str | None = field(default=None, repr=False)
    #: Mutual TLS between nodes, from cluster_key (needs one).
    encrypt: bool = False
    #: Tests and benchmarks only: False turns call signing off.
    authenticate: bool = True
    #: Bytes for weights + KV; None = memory_fraction x available memory.
    memory_budget: int | None = None
    memory_fraction: float = 0.75
    #: Memory the machine keeps free beyond what the node holds; less, and it offers less. 0: off.
    memory_margin: int = 1 << 30
    #: Seconds memory must stay free before a lowered offer is raised again.
    memory_dwell: float = 30.0
    #: Tokens of context per request; 0: as much as memory allows.
    max_context: int = 0
    #: Requests whose KV cache every stage reserves memory for.
    kv_requests: int = 2
    #: Quantize the KV cache to 4 or 8 bits (0: off).
    kv_bits: int = 0
    prefill_step_size: int = 512
    #: Prefill chunks flow through the stages like an assembly line.
    pipelined_prefill: bool = True
    #: Keep recent conversations' KV on every stage (the prompt cache).
    prompt_cache: bool = True
    #: Prompt cache bytes on disk (0: memory only).
    prompt_cache_disk: int = 32 * 10**9
    #: Batch concurrent generations where one node holds the whole model.
    batching: bool = True
    #: Concurrent decode steps travel through the stages in lockstep; "auto": with OpenBLAS only.
    lockstep: LockstepSetting = "auto"
    #: "prompt_lookup", "draft_model", "mtp" (the model's own head) or "off"; "auto": the model's
    #: MTP head where one node holds it whole, else prompt lookup where the model is split.
    speculative: Speculative = "auto"
    #: The most tokens guessed per pass.
    draft_max: int = 8
    #: A small model with the served model's tokenizer, for speculative = "draft_model".
    draft_model: str | None = None
    #: Activations between stages go over the data port, not gRPC.
    fast_hops: bool = True
    #: The longest prefill step (Apple's GPU watchdog kills long commands).
    max_step_ms: float = 500.0
    #: Larger max_tokens are capped to this.
    max_tokens_limit: int = 4096
    #: max_tokens of a request that gives none; 0: the room left in the context.
    default_max_tokens: int = 0
    max_body_bytes: int = 1 << 20
    max_concurrent_requests: int = 8
    #: Static peers, "HOST:PORT" of their gRPC port.
    peers: tuple[str, ...] = ()
    mdns: bool = True
    heartbeat_interval: float = 0.5
    failure_timeout: float = 2.0
    #: Seconds a failed-over generation may wait for a new plan.
    failover_deadline: float = 30.0
    #: Seconds an idle model stays loaded ({"*": s} or per model); 0: until its room is needed.
    keep_alive: dict[str, float] = field(default_factory=lambda: {"*": 0.0})
    #: Seconds a request may wait for its model to load (then 503).
    load_timeout: float = 600.0
    #: Seconds one model step may run before the node reports itself stalled.
    stall_timeout: float = 60.0
    #: Seconds a plan stays before the coordinator moves to a better one.
    rebalance_dwell: float = 5.0
    #: A node whose steps take this many times the measured figure is planned as that slow; 0: off.
    slow_factor: float = 3.0
    #: Seconds a slowdown (or a recovery) must last before the mesh plans around it.
    slow_dwell: float = 10.0
    #: auto, or prefer single, pipeline, tensor or hybrid where possible.
    strategy: StrategySetting = "auto"
    #: None, or pin the plan to these stages ("0-3@a | 4-7@b+c", as plan alternatives list them).
    plan_layout: str | None = None
    #: First of 34 TCP ports (tensor groups, echo +32, data port +33); 0 = grpc_port + 1.
    tensor_port: int = 0
    #: Seconds a tensor group may take to form and load.
    group_ready_timeout: float = 300.0
    #: Seconds between link measurements to each peer.
    link_probe_interval: float = 30.0
    #: Tests and benchmarks only: microseconds added to this node's round trips.
    inject_latency_us: float = 0.0
    #: None = platform default.
    state_dir: Path | None = None
    #: None = platform default.
    cache_dir: Path | None = None
    #: Optional Bearer key for the HTTP API. Never logged.
    api_key: str | None = field(default=None, repr=False)
    #: Origins whose web pages may call the API (CORS); empty = none.
    cors_origins: tuple[str, ...] = ()
    log_level: str = "INFO"
    #: One INFO line per HTTP request (logger meshnode.access).
    access_log: bool = True

    def __post_init__(self) -> None:
        # Settings(...) built in code obeys the same rules as a file.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            try:
                parsed = _PARSERS[f.name](value)
            except ValueError as exc:
                raise ConfigError(f"setting {f.name!r}: {exc}") from None
            if parsed is not value:
                object.__setattr__(self, f.name, parsed)
        _check_consistency(self, sources=None)

    # ------------------------------------------------------------------ derived values
    def offered_models(self) -> tuple[str | None, ...]:
        """Every model this node offers, ``model`` first (None: the built-in demo model)."""
        return (self.model, *(m for m in self.models if m != self.model))

    def resolved_state_dir(self) -> Path:
        """``state_dir`` or the platform default."""
        return self.state_dir if self.state_dir is not None else default_state_dir()

    def resolved_cache_dir(self) -> Path:
        """``cache_dir`` or the platform default."""
        return self.cache_dir if self.cache_dir is not None else default_cache_dir()

    def redacted(self) -> dict[str, Any]:
        """Every setting, JSON-friendly, secrets hidden."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in SECRET_FIELDS:
                value = None if value is None else "<redacted>"
            elif isinstance(value, Path):
                value = str(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Settings))
assert set(FIELD_NAMES) == set(_PARSERS), "every Settings field needs a parser"


def env_var(name: str) -> str:
    """The environment variable for a field: ``http_port`` -> ``MESHNODE_HTTP_PORT``."""
    return ENV_PREFIX + name.upper()


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_consistency(s: Any, sources: Mapping[str, str] | None) -> None:
    def where(*names: str) -> str:
        if not sources:
            return ""
        parts = [f"{n} from {sources.get(n, 'the defaults')}" for n in names]
        return " (" + "; ".join(parts) + ")"

    if s.default_max_tokens > s.max_tokens_limit:
        raise ConfigError(
            f"default_max_tokens ({s.default_max_tokens}) must not exceed max_tokens_limit "
            f"({s.max_tokens_limit}){where('default_max_tokens', 'max_tokens_limit')}"
        )
    if s.encrypt and not s.cluster_key:
        raise ConfigError(
            "encrypt needs a cluster_key (the certificate is derived from it)" + where("encrypt", "cluster_key")
        )
    if s.failure_timeout <= s.heartbeat_interval:
        raise ConfigError(
            f"failure_timeout ({s.failure_timeout} s) must be longer than heartbeat_interval "
            f"({s.heartbeat_interval} s){where('failure_timeout', 'heartbeat_interval')}"
        )


# --------------------------------------------------------------------------- loading


def read_config_file(path: Path) -> dict[str, Any]:
    """The raw key/value table of a TOML config file (keys checked, values not yet parsed)."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path}: not found") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read it: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: not valid TOML: {exc}") from None
    for was, now in RENAMED.items():
        if was in data:
            if now in data:
                raise ConfigError(f"config file {path}: {was!r} is the old name of {now!r}: keep one")
            log.warning("config file %s: %r is now called %r; the old name still works", path, was, now)
            data[now] = data.pop(was)
    unknown = [k for k in data if k not in _PARSERS]
    if unknown:
        k = unknown[0]
        hint = ""
        if isinstance(data[k], dict):
            hint = " (sections are not used: put every key at the top level)"
        else:
            close = _close_match(k)
            hint = f" (did you mean {close!r}?)" if close else ""
        raise ConfigError(f"config file {path}: unknown key {k!r}{hint}")
    return data


def _close_match(name: str) -> str | None:
    import difflib

    match = difflib.get_close_matches(name.replace("-", "_").lower(), FIELD_NAMES, n=1)
    return match[0] if match else None


def load_settings(
    config_file: Path | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Settings:
    """Settings from defaults < config file (else ``$MESHNODE_CONFIG``) < ``env`` < ``flags``
    (None: not given). Raises :class:`ConfigError`."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def put(name: str, raw: Any, source: str) -> None:
        try:
            values[name] = _PARSERS[name](raw)
        except ValueError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        sources[name] = source

    if config_file is None and env.get(CONFIG_ENV):
        config_file = Path(env[CONFIG_ENV])
    if config_file is not None:
        config_file = Path(config_file).expanduser()
        for name, raw in read_config_file(config_file).items():
            if name in ("state_dir", "cache_dir") and isinstance(raw, str) and raw:
                p = Path(raw).expanduser()
                raw = p if p.is_absolute() else (config_file.parent / p)
            put(name, raw, f"config file {config_file}: key {name!r}")

    for was, now in RENAMED.items():
        if env_var(was) in env and env_var(now) not in env:
            log.warning("environment %s is now %s; the old name still works", env_var(was), env_var(now))
            put(now, env[env_var(was)], f"environment {env_var(was)}")
    for name in FIELD_NAMES:
        var = env_var(name)
        if var in env:
            put(name, env[var], f"environment {var}")

    for name, raw in (flags or {}).items():
        if name not in _PARSERS:
            raise ConfigError(f"unknown setting {name!r} given as a flag")
        if raw is None:
            continue
        put(name, raw, f"flag {flag_name(name)}")

    merged = {f.name: values.get(f.name, f.default) for f in dataclasses.fields(Settings)}
    _check_consistency(SimpleNamespace(**merged), sources)
    return Settings(**values)
