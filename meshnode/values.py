"""Setting values in the syntax every source shares (config file, environment, flags): sizes,
durations, booleans, peers, and the per-field coercions :mod:`meshnode.config` builds its table of
parsers from. Each raises ValueError with what was expected; config adds where the value came from.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

from meshnode.identity import VALID_ID

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# How a plan splits a model: one node, a pipeline of stages, one tensor group, or stages of groups
# (the planner's word; here, below both, so the strategy setting can name it too).
Strategy = Literal["single", "pipeline", "tensor", "hybrid"]
STRATEGIES: tuple[Strategy, ...] = get_args(Strategy)


_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}


def parse_size(text: str | int) -> int:
    """Bytes from ``"123"``, ``"4K"``, ``"1.5GiB"``, ``"2GB"`` ...

    ``K/M/G/T`` and ``KiB/MiB/GiB/TiB`` are binary (1024^n); ``KB/MB/GB/TB`` are SI (1000^n); ``B`` or
    no unit is bytes. Units are case-insensitive. Fractions are rounded down to whole bytes; the result
    must be a whole, non-negative number of bytes.
    """
    if isinstance(text, bool):
        raise ValueError(f"expected a size, got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative, got {text}")
        return text
    if isinstance(text, float):
        if not math.isfinite(text) or text < 0:
            raise ValueError(f"expected a non-negative size, got {text!r}")
        return int(text)
    if not isinstance(text, str):
        raise ValueError(f"expected a size, got {text!r}")
    m = _SIZE_RE.match(text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(
            f"expected a size like 1048576, 512M, 1.5GiB or 2GB, got {text!r} "
            "(K/M/G/T and KiB/MiB/GiB/TiB are 1024^n, KB/MB/GB/TB are 1000^n)"
        )
    number, unit = m.group(1), m.group(2).lower()
    if "." in number:
        return int(float(number) * _SIZE_UNITS[unit])
    return int(number) * _SIZE_UNITS[unit]


def parse_duration(text: str | int | float) -> float:
    """Seconds from ``2``, ``0.5``, ``"0.5"``, ``"2s"``, ``"500ms"``, ``"5m"`` or ``"1h"``."""
    if isinstance(text, bool):
        raise ValueError(f"expected seconds, got {text!r}")
    if isinstance(text, (int, float)):
        value = float(text)
    elif isinstance(text, str):
        s = text.strip().lower()
        scale = 1.0
        if s.endswith("ms"):
            s, scale = s[:-2], 1e-3
        elif s.endswith("s"):
            s = s[:-1]
        elif s.endswith("m"):
            s, scale = s[:-1], 60.0
        elif s.endswith("h"):
            s, scale = s[:-1], 3600.0
        try:
            value = float(s.strip()) * scale
        except ValueError:
            raise ValueError(f"expected seconds like 0.5, 2s or 500ms, got {text!r}") from None
    else:
        raise ValueError(f"expected seconds, got {text!r}")
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number of seconds, got {text!r}")
    return value


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def bool_or_auto(text: str | bool | int) -> bool | Literal["auto"]:
    """``"auto"``, or a boolean as :func:`parse_bool` reads it."""
    if isinstance(text, str) and text.strip().lower() == "auto":
        return "auto"
    try:
        return parse_bool(text)
    except ValueError:
        raise ValueError(f"expected auto, true or false, got {text!r}") from None


def parse_bool(text: str | bool | int) -> bool:
    if isinstance(text, bool):
        return text
    if isinstance(text, int) and text in (0, 1):
        return bool(text)
    if isinstance(text, str):
        s = text.strip().lower()
        if s in _TRUE:
            return True
        if s in _FALSE:
            return False
    raise ValueError(f"expected true/false (or 1/0, yes/no, on/off), got {text!r}")


def parse_peer(text: str) -> str:
    """Validate one ``"HOST:PORT"`` (IPv6: ``"[addr]:PORT"``) and return it stripped."""
    if not isinstance(text, str):
        raise ValueError(f"expected a peer 'HOST:PORT', got {text!r}")
    s = text.strip()
    host, sep, port = s.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected a peer 'HOST:PORT' (the peer's gRPC port), got {text!r}")
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise ValueError(f"bad IPv6 peer {text!r}: write it as '[addr]:PORT'")
    elif ":" in host:
        raise ValueError(f"bad peer {text!r}: write IPv6 addresses as '[addr]:PORT'")
    if any(c.isspace() for c in host):
        raise ValueError(f"bad peer {text!r}: the host contains white space")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"bad peer {text!r}: port must be 1..65535")
    return s


# ---------------------------------------------------------------- per-field coercion (the parser table's parts)


def optional(inner: Callable[[Any], Any], empty: tuple[str, ...] = ("",)) -> Callable[[Any], Any]:
    def parse(value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, str) and value.strip().lower() in empty:
            return None
        return inner(value)

    return parse


def as_text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def as_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip().replace("_", ""), 10)
        except ValueError:
            pass
    raise ValueError(f"expected an integer, got {value!r}")


def as_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    try:
        result = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number, got {value!r}") from None
    if not math.isfinite(result):
        raise ValueError(f"expected a finite number, got {value!r}")
    return result


def as_path(value: Any) -> Path:
    if isinstance(value, Path):
        return value.expanduser()
    if isinstance(value, str):
        return Path(value).expanduser()
    raise ValueError(f"expected a path, got {value!r}")


def peer_list(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        items = [p for p in re.split(r"[,\s]+", value) if p]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ValueError(f"expected a list of 'HOST:PORT' peers, got {value!r}")
    out: list[str] = []
    for item in items:
        peer = parse_peer(item)
        if peer not in out:
            out.append(peer)
    return tuple(out)


def model_list(value: Any) -> tuple[str, ...]:
    """Models a node offers beside ``model``: a TOML array, or names separated by commas or spaces."""
    if isinstance(value, str):
        items = [p for p in re.split(r"[,\s]+", value) if p]
    elif isinstance(value, (list, tuple)):
        items = [as_text(v).strip() for v in value]
    else:
        raise ValueError(f"expected a list of models, got {value!r}")
    if not all(items):
        raise ValueError("a model in the list is empty")
    return tuple(dict.fromkeys(items))


def keep_alive_map(value: Any) -> dict[str, float]:
    """Seconds an idle model stays loaded: one duration for every model (``"5m"``; 0: until its room
    is needed), or per model: a TOML table ``{"model" = "1h", "*" = "5m"}`` or ``"model=1h,*=5m"``."""
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, str) and "=" in value:
        items = [tuple(p.split("=", 1)) for p in re.split(r"[,\s]+", value) if p]
        if any(len(i) != 2 for i in items):
            raise ValueError(f"expected MODEL=DURATION entries, got {value!r}")
    else:
        items = [("*", value)]
    out = {}
    for model, duration in items:
        seconds = parse_duration(duration)
        if seconds < 0 or not as_text(model).strip():
            raise ValueError(f"expected a model and a duration of 0 or more, got {model!r} = {duration!r}")
        out[as_text(model).strip()] = seconds
    return out


def origin_list(value: Any) -> tuple[str, ...]:
    """Web origins allowed to call the API from a browser: "*" or "scheme://host[:port]" each."""
    if isinstance(value, str):
        items = [p for p in re.split(r"[,\s]+", value) if p]
    elif isinstance(value, (list, tuple)):
        items = [as_text(v) for v in value]
    else:
        raise ValueError(f"expected a list of origins, got {value!r}")
    for item in items:
        if item != "*" and not re.fullmatch(r"https?://[A-Za-z0-9.\-\[\]:]+", item):
            raise ValueError(f'expected "*" or an origin like "https://host:port", got {item!r}')
    return tuple(dict.fromkeys(items))


def log_level(value: Any) -> str:
    s = as_text(value).strip().upper()
    if s == "WARN":
        s = "WARNING"
    if s not in LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return s


def node_id(value: Any) -> str:
    s = as_text(value).strip()
    if not VALID_ID.match(s):
        raise ValueError(
            f"node id {value!r} must be 1-63 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return s


_T = TypeVar("_T")


def checked(parse: Callable[[Any], _T], check: Callable[[_T], bool], what: str) -> Callable[[Any], _T]:
    def parse_checked(value: Any) -> _T:
        result = parse(value)
        if result is not None and not check(result):
            raise ValueError(f"must be {what}, got {value!r}")
        return result

    return parse_checked


def port(value: Any) -> int:
    return checked(as_int, lambda p: 0 <= p <= 65535, "a port 0..65535 (0 = any free port)")(value)


def positive_int(value: Any) -> int:
    return checked(as_int, lambda n: n >= 1, "an integer >= 1")(value)


def positive_duration(value: Any) -> float:
    return checked(parse_duration, lambda s: s > 0, "a positive number of seconds")(value)


# A plan's layout as the planner writes it: "0-3@a | 4-7@b+c" (stages by first-last layer, their nodes).
Layout = tuple[tuple[tuple[str, ...], int, int], ...]


def layout_units(text: str) -> Layout:
    """``"0-3@a | 4-7@b+c"`` as ((("a",), 0, 4), (("b", "c"), 4, 8)): each stage's nodes and its
    layers [start, end). ValueError where the text is not such a layout."""
    out = []
    for part in text.split("|"):
        span, at, members = part.strip().partition("@")
        first, dash, last = span.partition("-")
        ids = tuple(m.strip() for m in members.split("+"))
        if not (at and dash and first.strip().isdigit() and last.strip().isdigit() and all(ids)):
            raise ValueError(f"expected stages as 'FIRST-LAST@NODE[+NODE...]' joined by ' | ', got {text!r}")
        out.append((ids, int(first), int(last) + 1))
    return tuple(out)


def plan_layout(value: Any) -> str:
    """A layout (:func:`layout_units`) in the planner's own spelling."""
    return " | ".join(f"{s}-{e - 1}@{'+'.join(ids)}" for ids, s, e in layout_units(as_text(value)))
