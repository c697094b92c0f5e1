"""``meshnode status``: a node's ``GET /v1/mesh`` document for a person, and its exit status.

Healthy means: the node's plan is loaded everywhere and every announced peer answers. Anything else
is explained on a ``health`` line, so the exit status and the text always agree.
"""

from __future__ import annotations

from typing import Any

from meshnode.control.reachability import HINT
from meshnode.nodeinfo import speed_note

__all__ = ["format_status", "status_exit_code", "health_problems"]

EXIT_OK, EXIT_FAIL = 0, 1


def _gib(n: Any) -> str:
    try:
        return f"{float(n) / 2**30:.1f} GiB"
    except (TypeError, ValueError):
        return "?"


def _rate(bps: Any) -> str:
    try:
        bps = float(bps)
    except (TypeError, ValueError):
        return "?"
    for unit, size in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bps >= size:
            return f"{bps / size:.1f} {unit}"
    return f"{bps:.0f} B/s"


def _serving(data: dict[str, Any]) -> bool:
    if "healthy" in data:
        return data["healthy"] is True
    return bool(data.get("plan"))  # an older node without the key: a plan is the best sign


def health_problems(data: Any) -> list[str]:
    """Why the node is not healthy, in words; empty when it is."""
    if not isinstance(data, dict):
        return ["the node's answer is not a status document"]
    problems = []
    if not _serving(data):
        epoch, ready = data.get("epoch"), data.get("ready_epoch")
        progress = data.get("progress")
        if data.get("plan_error"):
            problems.append(f"not serving: the model does not fit on the nodes available ({data['plan_error']})")
        elif not data.get("plan"):
            problems.append("not serving: no plan yet (the mesh is forming)")
        elif isinstance(progress, dict) and progress.get("total"):
            problems.append(
                f"not serving: {progress.get('task', 'loading')} ({progress.get('done', 0)}/{progress['total']})"
            )
        elif isinstance(epoch, int) and isinstance(ready, int) and ready < epoch:
            problems.append(f"not serving: loading this node's part of epoch {epoch}")
        else:
            problems.append("not serving: waiting for the other nodes of the plan to load it")
    for peer in data.get("unreachable") or []:
        if isinstance(peer, dict):
            problems.append(
                f"peer {peer.get('node_id', '?')} is announced over mDNS but does not answer at "
                f"{peer.get('address', '?')} (for {peer.get('seconds', '?')} s: {peer.get('error', '')})"
            )
    return problems


def status_exit_code(data: Any) -> int:
    """0 when the node is healthy (see the module docstring), else 1."""
    return EXIT_OK if isinstance(data, dict) and not health_problems(data) else EXIT_FAIL


def format_status(data: dict[str, Any]) -> str:
    """A human summary of a /v1/mesh document."""
    lines: list[str] = []
    me = data.get("node_id", "?")
    problems = health_problems(data)
    lines.append(
        f"node         {me}  (meshnode {data.get('version', '?')}, {'NOT healthy' if problems else 'healthy'})"
    )
    lines.append("health       " + ("ok: serving, every peer answers" if not problems else problems[0]))
    lines += [f"             {p}" for p in problems[1:]]
    if data.get("model"):
        lines.append(f"model        {data['model']}")
    coordinator = data.get("coordinator")
    lines.append(f"coordinator  {coordinator if coordinator else '(none yet)'}")
    epoch = data.get("epoch")
    ready = data.get("ready_epoch")
    epoch_text = "-" if epoch is None else str(epoch)
    if ready is not None and ready != epoch:
        epoch_text += f" (ready: {ready})"
    lines.append(f"epoch        {epoch_text}")
    lines += _plan_lines(data)
    if data.get("drafter"):
        lines.append(f"drafter      {data['drafter']}")
    if data.get("plan_error"):
        lines.append(f"plan error   {data['plan_error']}")
    models = data.get("models") or []
    if len(models) > 1:  # several models on one mesh: each with its own plan
        for i, m in enumerate(models):
            if not isinstance(m, dict):
                continue
            plan = m.get("plan")
            plan = plan if isinstance(plan, dict) else {}
            where = " | ".join(
                f"{s.get('start_layer')}-{s.get('end_layer', 1) - 1}@{'+'.join(s.get('nodes', []))}"
                for s in plan.get("stages") or []
                if isinstance(s, dict)
            )
            lines.append(
                f"{'models' if i == 0 else '':<13}{m.get('model')}: {m.get('state', '?')}"
                + (f", epoch {m.get('epoch')}: {where}" if where else "")
                + (f"; drafter {m['drafter']}" if m.get("drafter") else "")
            )
    lines += _node_lines(data, me, coordinator)
    lines += _link_lines(data, me)
    if data.get("unreachable"):
        lines.append(f"hint         {HINT}")
    return "\n".join(lines)


def _plan_lines(data: dict[str, Any]) -> list[str]:
    plan = data.get("plan")
    if not (isinstance(plan, dict) and plan.get("stages") is not None):
        return ["plan         (none)"]
    strategy = plan.get("strategy") or "plan"
    head = f"plan         {strategy}, epoch {plan.get('epoch', '?')}"
    if plan.get("max_context"):
        head += f", max context {plan['max_context']}"
    if plan.get("kv_bits"):
        head += f", {plan['kv_bits']}-bit KV cache"
    if isinstance(plan.get("tokens_per_s"), (int, float)):
        head += f", est. {plan['tokens_per_s']:.3g} tok/s"
    lines = [head]
    for stage in plan.get("stages") or []:
        start, end = stage.get("start_layer"), stage.get("end_layer")
        where = " + ".join(str(n) for n in stage.get("nodes") or []) or "?"
        if isinstance(start, int) and isinstance(end, int) and end > start:
            span = f"layers {start}–{end - 1}"
        else:
            span = f"layers {start}–{end}"
        lines.append(f"  {span} on node {where}")
    if plan.get("reason"):
        lines.append(f"  why: {plan['reason']}")
    return lines


def _node_lines(data: dict[str, Any], me: str, coordinator: Any) -> list[str]:
    nodes = [n for n in data.get("nodes") or [] if isinstance(n, dict)]
    lines = [f"nodes        {len(nodes)}"]
    for node in nodes:
        nid = node.get("node_id", "?")
        marks = []
        if nid == me:
            marks.append("this node")
        if node.get("role") == "coordinator" or nid == coordinator:
            marks.append("coordinator")
        address = node.get("address") or ""
        if address and node.get("http_port"):
            address = f"{address}:{node['http_port']}"
        memory = f"offers {_gib(node.get('memory_budget'))} of {_gib(node.get('total_memory'))}"
        compute = node.get("compute")
        compute_text = f", {compute:.0f} GFLOP/s" if isinstance(compute, (int, float)) else ""
        if node.get("version") and node.get("version") != data.get("version"):
            marks.append(f"meshnode {node['version']}")  # a mixed mesh: mid-upgrade
        extra = f"  [{', '.join(marks)}]" if marks else ""
        lines.append(f"  {nid}  {address}  {memory}{compute_text}{extra}".rstrip())
        slowdown = node.get("slowdown")
        if isinstance(slowdown, (int, float)) and slowdown > 1:
            lines.append(f"    {speed_note(nid, slowdown, float(node.get('slow_since') or 0))}")
    return lines


def _us(value: Any) -> str:
    """Microseconds for a person: "45 µs", "2.40 ms"."""
    if not isinstance(value, (int, float)):
        return "?"
    return f"{value:.0f} µs" if value < 1000 else f"{value / 1e3:.2f} ms"


def _link_lines(data: dict[str, Any], me: str) -> list[str]:
    """The links this node measured to its peers (round trip, jitter, bandwidth per address)."""
    mine = next((n for n in data.get("nodes") or [] if isinstance(n, dict) and n.get("node_id") == me), {})
    links = [link for link in mine.get("links") or [] if isinstance(link, dict)]
    if not links:
        return []
    lines = ["links        measured from this node"]
    for link in sorted(links, key=lambda x: (str(x.get("peer")), str(x.get("address")))):
        text = f"round trip {_us(link.get('rtt_us'))}"
        if isinstance(link.get("jitter_us"), (int, float)):
            text += f" ± {_us(link['jitter_us'])}"
        if isinstance(link.get("rpc_rtt_us"), (int, float)) and link["rpc_rtt_us"] > 0:
            text += f" (a gRPC call {_us(link['rpc_rtt_us'])})"
        lines.append(
            f"  to {link.get('peer', '?')} via {link.get('address', '?')}  {text}, {_rate(link.get('bandwidth'))}"
        )
    return lines
