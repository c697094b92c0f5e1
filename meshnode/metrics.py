"""What a node measures about itself: Prometheus metrics (a registry per node, as tests run several
in one process), live figures and load progress."""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TextIO

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

OUTCOMES = ("ok", "client_error", "unavailable", "error", "cancelled")
MEMBERSHIP_KINDS = ("join", "loss", "leave")
RATE_WINDOW = 5.0  # seconds of tokens the live decode rate looks at
RATE_IDLE = 2.0  # no token for this long: not decoding, the live rate is 0

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TRANSPORT_BUCKETS = (0.000025, 0.00005, 0.0001, 0.00015, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)
_HOP_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


def outcome_for_status(status: int) -> str:
    """The outcome label of a request answered with HTTP ``status``."""
    if status < 400:
        return "ok"
    if status in (429, 503):  # busy, or the mesh cannot serve right now: retry later
        return "unavailable"
    if status < 500:
        return "client_error"
    return "error"


class NodeMetrics:
    """One node's metrics, in a registry of its own."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(
        self,
        epoch: Callable[[], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        unreachable: Callable[[], int] | None = None,
    ):
        self.registry = r = CollectorRegistry()
        self._clock = clock
        self._lock = threading.Lock()
        self._recent: deque[float] = deque(maxlen=8192)  # times of recent tokens (all requests)
        self.last_request_tps = 0.0  # decode rate of the last finished generation
        self.tokens = Counter("meshnode_tokens_generated", "Tokens generated for this node's clients", registry=r)
        self.decode_rate = Gauge(
            "meshnode_decode_tokens_per_second",
            f"Tokens per second decoded for this node's clients over the last {RATE_WINDOW:g} s (0 when idle)",
            registry=r,
        )
        self.decode_rate.set_function(self.tokens_per_second)
        self.ttft = Histogram(
            "meshnode_time_to_first_token_seconds",
            "Seconds from the start of a generation to its first token",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.hop = Histogram(
            "meshnode_hop_latency_seconds",
            "Round trip of one activation to a remote stage and back (Forward)",
            labelnames=("peer", "phase"),
            buckets=_HOP_BUCKETS,
            registry=r,
        )
        self.hop_transport = Histogram(
            "meshnode_hop_transport_seconds",
            "Added latency of one hop of a decode step: half of (the round trip to a remote stage minus the "
            "stage's own time), i.e. what the network and the transport add each way",
            labelnames=("peer", "transport"),
            buckets=_TRANSPORT_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "meshnode_requests", "Generation requests by outcome", labelnames=("outcome",), registry=r
        )
        self.membership = Counter(
            "meshnode_membership_changes",
            "Peers that joined, were lost (no heartbeat) or left (said goodbye)",
            labelnames=("kind",),
            registry=r,
        )
        self.epoch = Gauge("meshnode_plan_epoch", "Epoch of the plan this node follows", registry=r)
        self._epoch_value = 0
        self.epoch.set_function(epoch or (lambda: self._epoch_value))
        self.replans = Counter("meshnode_plans_adopted", "Plans (new epochs) this node adopted", registry=r)
        self.prompt_cache_hits = Counter(
            "meshnode_prompt_cache_hits", "Requests a stage here started from a kept conversation prefix", registry=r
        )
        self.prompt_cache_tokens = Counter(
            "meshnode_prompt_cache_reused_tokens",
            "Prompt positions stages here did not compute again (kept prefixes)",
            registry=r,
        )
        self.prompt_cache_disk_hits = Counter(
            "meshnode_prompt_cache_disk_hits", "Of the prompt cache hits, those read back from disk", registry=r
        )
        self.prompt_cache_disk_tokens = Counter(
            "meshnode_prompt_cache_disk_tokens", "Prompt positions read back from disk instead of computed", registry=r
        )
        self.prompt_cache_disk_written = Counter(
            "meshnode_prompt_cache_disk_written_bytes", "Bytes of kept prefixes written to disk", registry=r
        )
        self.lockstep_rounds = Counter(
            "meshnode_lockstep_rounds",
            "Rounds of several requests' decode steps run through the stages in lockstep",
            registry=r,
        )
        self.lockstep_rows = Counter(
            "meshnode_lockstep_rows",
            "Requests' steps in those rounds (rows / rounds: the mean micro-batch)",
            registry=r,
        )
        self.spec_passes = Counter(
            "meshnode_speculative_passes",
            "Speculative decoding: passes that checked the "
            "drafter's guesses with the next token, through every stage at once",
            registry=r,
        )
        self.spec_drafted = Counter("meshnode_speculative_drafted_tokens", "Tokens the drafter guessed", registry=r)
        self.spec_accepted = Counter(
            "meshnode_speculative_accepted_tokens",
            "Guesses the model confirmed (/ drafted: the acceptance rate)",
            registry=r,
        )
        self.spec_tokens = Counter(
            "meshnode_speculative_pass_tokens", "Tokens those passes yielded (/ passes: tokens per pass)", registry=r
        )
        self.spec_position_drafted = Counter(
            "meshnode_speculative_position_drafted",
            "Passes whose drafter guessed this many tokens or more (position: 1 is the first guess)",
            ["position"],
            registry=r,
        )
        self.spec_position_accepted = Counter(
            "meshnode_speculative_position_accepted",
            "Passes whose guess at this position was confirmed (/ drafted: the acceptance at the position)",
            ["position"],
            registry=r,
        )
        self.spec_cancelled = Counter(
            "meshnode_speculative_cancelled_passes",
            "Passes of guesses sent behind one in flight and cancelled by its rejection",
            registry=r,
        )
        self.spec_position_cost = Gauge(
            "meshnode_speculative_position_cost",
            "A pass's further position against a one-position pass, as the head's last speculating request measured it",
            registry=r,
        )
        self.spec_filled_share = Gauge(
            "meshnode_speculative_filled_share",
            "Time between passes of a full pipeline against one pass's traversal, as "
            "measured (about 1 / stages where stages compute at once; 0: not measured)",
            registry=r,
        )
        self._spec_costs: tuple[float, float | None] | None = None  # see pass_costs
        self.spec_position_cost.set_function(lambda: self._spec_costs[0] if self._spec_costs else 0.0)
        self.spec_filled_share.set_function(lambda: (self._spec_costs[1] or 0.0) if self._spec_costs else 0.0)
        self.failovers = Counter(
            "meshnode_generation_retries", "Generations carried over to a new placement after theirs failed", registry=r
        )
        self.unreachable = Gauge(
            "meshnode_unreachable_peers",
            "Peers announced over mDNS whose heartbeats from this node all failed for the "
            "grace period (Local Network permission, firewall)",
            registry=r,
        )
        self.unreachable.set_function(unreachable or (lambda: 0))
        for outcome in OUTCOMES:
            self.requests.labels(outcome=outcome)
        for kind in MEMBERSHIP_KINDS:
            self.membership.labels(kind=kind)

    # -- hooks
    def request(self, outcome: str) -> None:
        self.requests.labels(outcome=outcome).inc()

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def token(self) -> None:
        self.tokens.inc()
        with self._lock:
            self._recent.append(self._clock())

    def generation_done(self, tokens: int, decode_seconds: float) -> None:
        """The latest generation so far: ``tokens`` after its first one took ``decode_seconds``."""
        if tokens > 0 and decode_seconds > 0:
            self.last_request_tps = tokens / decode_seconds

    def hop_observer(self, peer: str) -> Callable[[float, int, float, str], None]:
        prefill, decode = self.hop.labels(peer=peer, phase="prefill"), self.hop.labels(peer=peer, phase="decode")
        overhead = {t: self.hop_transport.labels(peer=peer, transport=t) for t in ("tcp", "grpc")}

        def observe(seconds: float, positions: int, stage_seconds: float = 0.0, transport: str = "grpc") -> None:
            if positions <= 1:
                decode.observe(seconds)
                if stage_seconds > 0:
                    overhead[transport].observe(max(seconds - stage_seconds, 0.0) / 2)
            else:
                prefill.observe(seconds)

        return observe

    def prompt_cache_resumed(self, positions: int, source: str = "memory") -> None:
        """A request started from a kept prefix, held in memory or read back from disk."""
        self.prompt_cache_hits.inc()
        self.prompt_cache_tokens.inc(positions)
        if source == "disk":
            self.prompt_cache_disk_hits.inc()
            self.prompt_cache_disk_tokens.inc(positions)

    def prompt_cache_written(self, nbytes: int) -> None:
        self.prompt_cache_disk_written.inc(nbytes)

    def lockstep_round(self, rows: int) -> None:
        self.lockstep_rounds.inc()
        self.lockstep_rows.inc(rows)

    def speculated(self, drafted: int, accepted: int, tokens: int, cancelled: int = 0) -> None:
        """A speculative pass (meshnode.serving.speculative) and the passes behind it its rejection cancelled."""
        self.spec_passes.inc()
        self.spec_cancelled.inc(cancelled)
        self.spec_drafted.inc(drafted)
        self.spec_accepted.inc(accepted)
        self.spec_tokens.inc(tokens)
        for position in range(1, drafted + 1):  # the guesses confirmed are the first ``accepted``
            self.spec_position_drafted.labels(position=str(position)).inc()
            if position <= accepted:
                self.spec_position_accepted.labels(position=str(position)).inc()

    def pass_costs(self, position_cost: float, filled_share: float | None) -> None:
        """What a speculating request measured of its passes (meshnode.serving.draft_length.PassCosts)."""
        self._spec_costs = (position_cost, filled_share)

    def speculation(self) -> dict[str, Any]:
        passes, drafted = total(self.spec_passes), total(self.spec_drafted)
        costs = self._spec_costs
        return {
            "passes": int(passes),
            "drafted": int(drafted),
            "accepted": int(total(self.spec_accepted)),
            "tokens": int(total(self.spec_tokens)),
            "cancelled": int(total(self.spec_cancelled)),
            "acceptance_rate": round(total(self.spec_accepted) / drafted, 3) if drafted else None,
            "tokens_per_pass": round(total(self.spec_tokens) / passes, 3) if passes else None,
            "position_cost": round(costs[0], 3) if costs else None,
            "filled_share": round(costs[1], 3) if costs and costs[1] is not None else None,
        }

    def retry(self) -> None:
        self.failovers.inc()

    def event(self, kind: str, fields: dict[str, Any]) -> None:
        """A node event (see :class:`EventLog`)."""
        if kind in MEMBERSHIP_KINDS:
            self.membership.labels(kind=kind).inc()
        elif kind == "plan":
            self.replans.inc()
            self._epoch_value = int(fields.get("epoch", 0))

    # -- figures
    def tokens_per_second(self) -> float:
        """Live decode rate: tokens of the last RATE_WINDOW s over the time they span; 0 when idle."""
        now = self._clock()
        with self._lock:
            while self._recent and now - self._recent[0] > RATE_WINDOW:
                self._recent.popleft()
            if len(self._recent) < 2 or now - self._recent[-1] > RATE_IDLE:
                return 0.0
            span = self._recent[-1] - self._recent[0]
            return (len(self._recent) - 1) / span if span > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """The figures the dashboard shows (from the same metrics /metrics exports)."""
        requests = {o: int(total(self.requests, outcome=o)) for o in OUTCOMES}
        ttft_sum = sum(s.value for m in self.ttft.collect() for s in m.samples if s.name.endswith("_sum"))
        ttft_count = sum(s.value for m in self.ttft.collect() for s in m.samples if s.name.endswith("_count"))
        return {
            "tokens_generated": int(total(self.tokens)),
            "tokens_per_second": round(self.tokens_per_second(), 2),
            "last_request_tokens_per_second": round(self.last_request_tps, 2),
            "mean_time_to_first_token": round(ttft_sum / ttft_count, 4) if ttft_count else None,
            "requests": requests,
            "retries": int(total(self.failovers)),
            "speculation": self.speculation(),
        }

    def render(self) -> bytes:
        return generate_latest(self.registry)


def total(counter: Counter, **labels: str) -> float:
    """A counter's count (``labels``: its child's with those labels), read through the public collect()."""
    return sum(
        sample.value
        for metric in counter.collect()
        for sample in metric.samples
        if sample.name.endswith("_total") and all(sample.labels.get(k) == v for k, v in labels.items())
    )


class Progress:
    """A long task's progress: ``current`` for /v1/mesh, and a bar on stderr when it is a TTY."""

    def __init__(self, stream: TextIO | None = None, width: int = 30):
        self._stream = stream if stream is not None else sys.stderr
        self._width = width
        self.current: dict[str, Any] | None = None
        self._drawn = False

    def _tty(self) -> bool:
        try:
            return self._stream.isatty()
        except (AttributeError, ValueError):
            return False

    def update(self, task: str, done: int, total: int) -> None:
        self.current = {"task": task, "done": done, "total": total}
        if self._tty():
            filled = self._width * done // total if total else 0
            bar = "#" * filled + "-" * (self._width - filled)
            self._stream.write(f"\r{task} [{bar}] {done}/{total}\x1b[K")
            self._stream.flush()
            self._drawn = True

    def finish(self) -> None:
        self.current = None
        if self._drawn:
            self._stream.write("\r\x1b[K")
            self._stream.flush()
            self._drawn = False


class EventLog:
    """The last ``keep`` events of this node (joins, losses, plans, loads) for ``/v1/mesh``, each
    also counted in the metrics."""

    def __init__(self, metrics: NodeMetrics, keep: int = 100):
        self.metrics, self.keep = metrics, keep
        self.events: list[dict[str, Any]] = []

    def __call__(self, kind: str, **fields: Any) -> None:
        self.events.append({"time": time.time(), "event": kind, **fields})
        del self.events[: -self.keep]
        self.metrics.event(kind, fields)

    def recent(self, n: int = 20) -> list[dict[str, Any]]:
        return self.events[-n:]
