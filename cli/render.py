"""Pure rendering: a ClusterStatus (or a run result) to rich renderables and plain text."""

from __future__ import annotations

import io
import time
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from core.client import NodeCheck, PlanRow
from core.status import ClusterStatus, CoordinatorState, NodeState, NodeStatus

STATE_STYLE = {
    NodeState.READY: "green",
    NodeState.STARTING: "yellow",
    NodeState.RESTARTING: "yellow",
    NodeState.PENDING: "dim",
    NodeState.CONNECTING: "yellow",
    NodeState.DEPLOYING: "yellow",
    NodeState.FAILED: "bold red",
    NodeState.STOPPED: "dim",
}
COORDINATOR_STYLE = {
    CoordinatorState.READY: "green",
    CoordinatorState.GENERATING: "cyan",
    CoordinatorState.LOADING: "yellow",
    CoordinatorState.FAILED: "bold red",
    CoordinatorState.STOPPED: "dim",
}


def size(value: int) -> str:
    """Bytes as a short human size."""
    amount = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if amount < 1024 or unit == "GiB":
            return f"{amount:.0f} {unit}" if unit in ("B", "KiB") else f"{amount:.1f} {unit}"
        amount /= 1024
    return f"{amount:.1f} TiB"


def duration(seconds: float) -> str:
    """Seconds as 45s, 12m05s or 3h02m."""
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def memory(node: NodeStatus) -> str:
    """Free/total memory in the total's unit, e.g. ``21.3/23.5 GiB`` (``21/24 GiB`` from 10 up)."""
    if not node.mem_total:
        return "-"
    total = size(node.mem_total)
    number, unit = total.split(" ")
    scale = node.mem_total / float(number) if float(number) else 1.0
    digits = 0 if float(number) >= 10 else 1
    return f"{node.mem_free / scale:.{digits}f}/{float(number):.{digits}f} {unit}"


def layers(node: NodeStatus) -> str:
    """A node's layer range."""
    if node.layers is None:
        return "-"
    first, last = node.layers
    return f"{first}-{last}" if first != last else str(first)


def header(status: ClusterStatus, now: float) -> Text:
    """One line: cluster, model, coordinator, uptime."""
    line = Text()
    line.append(status.cluster, style="bold")
    line.append(f"  model {status.model}  coordinator ")
    line.append(str(status.coordinator.state), style=COORDINATOR_STYLE[status.coordinator.state])
    if status.coordinator.restarts:
        line.append(f" (restarts {status.coordinator.restarts})")
    line.append(f"  up {duration(now - status.started_at)}")
    if status.predicted_ms:
        line.append(f"  plan {status.predicted_ms:.1f} ms/tok")
    return line


def node_table(status: ClusterStatus) -> Table:
    """One row per node."""
    table = Table(box=None, pad_edge=False, collapse_padding=True, header_style="bold")
    for column in ("NODE", "BACKEND", "STATE", "LAYERS", "FREE/MEM", "MS/TOK", "COMPUTES", "RESTARTS"):
        table.add_column(column, no_wrap=True)
    table.add_column("LAST STATUS", overflow="fold", min_width=11)
    for node in status.nodes:
        # ms/token as the relay measures it; only meaningful for a node that holds layers.
        compute = f"{node.compute_ms:.2f}" if node.compute_ms is not None and node.layers else "-"
        table.add_row(
            node.name, f"{node.arch or '?'}/{node.backend or '?'}",
            Text(str(node.state), style=STATE_STYLE[node.state]), layers(node), memory(node), compute,
            str(node.computes + node.recomputes), str(node.restarts), node.last_error or node.last_status or "ok")
    return table


def event_lines(status: ClusterStatus, count: int = 5) -> Text:
    """The latest events, oldest first."""
    text = Text()
    for event in status.events[-count:]:
        stamp = time.strftime("%H:%M:%S", time.localtime(event.time))
        where = f"[{event.node}] " if event.node else ""
        text.append(f"{stamp} {where}{event.kind}: {event.message}\n", style="dim")
    return text


def status_view(status: ClusterStatus, now: float | None = None, events: int = 5) -> RenderableType:
    """The whole status screen."""
    parts: list[RenderableType] = [header(status, time.time() if now is None else now), node_table(status)]
    if events and status.events:
        parts += [Text("events", style="bold"), event_lines(status, events)]
    return Group(*parts)


def to_text(renderable: RenderableType, width: int = 100) -> str:
    """Plain text of a renderable at a fixed width (for --once on a pipe, and for tests)."""
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, force_terminal=False).print(renderable)
    return buffer.getvalue()


def deploy_table(status: ClusterStatus) -> Table:
    """After `up`: how each node came up, or why it did not."""
    table = Table(box=None, pad_edge=False, collapse_padding=True, header_style="bold")
    for column in ("NODE", "HOST", "STATE", "BACKEND"):
        table.add_column(column, no_wrap=True)
    table.add_column("HOW / WHY", overflow="fold")
    for node in status.nodes:
        table.add_row(node.name, node.host, Text(str(node.state), style=STATE_STYLE[node.state]),
                      node.backend or "-", node.last_error if node.state == NodeState.FAILED else node.detail or "-")
    return table


def check_table(rows: list[NodeCheck]) -> Table:
    """`check`: one row per node, problems in red."""
    table = Table(box=None, pad_edge=False, collapse_padding=True, header_style="bold")
    for column in ("NODE", "HOST", "SYSTEM", "BACKEND", "WORKER", "PORT"):
        table.add_column(column, no_wrap=True)
    table.add_column("HARDWARE / PROBLEM", overflow="fold")
    for row in rows:
        last = Text(row.problem, style="bold red") if row.problem else Text(f"{row.hardware}; {row.reason}")
        table.add_row(row.name, row.host, row.system or "-", row.backend or "-", row.worker or "-",
                      row.port or "-", last)
    return table


def plan_table(rows: list[PlanRow]) -> Table:
    """`plan`: per node, the layers it would hold, the memory that takes, its share of a token, and why."""
    table = Table(box=None, pad_edge=False, collapse_padding=True, header_style="bold")
    for column in ("NODE", "LAYERS", "NEEDS/USABLE", "MS/TOK"):
        table.add_column(column, no_wrap=True)
    table.add_column("WHY", overflow="fold")
    for row in rows:
        layers = "-" if row.layers is None else (
            f"{row.layers[0]}-{row.layers[1]}" if row.layers[0] != row.layers[1] else str(row.layers[0]))
        predicted = "-" if row.predicted_ms is None else f"{row.predicted_ms:.2f}"
        table.add_row(row.name, layers, f"{size(row.needs)}/{size(row.usable)}", predicted, row.why)
    return table


def run_summary(result: dict[str, Any]) -> str:
    """One line after a streamed run."""
    timings = result.get("timings") or {}
    rate = timings.get("decode_tokens_per_s")
    parts = [f"{result.get('completion_tokens', 0)} tokens"]
    if rate:
        parts.append(f"{rate:.1f} tok/s")
    if timings.get("first_token_s") is not None:
        parts.append(f"first token {timings['first_token_s'] * 1000:.0f} ms")
    recoveries = result.get("recoveries") or []
    if recoveries:
        parts.append(f"{len(recoveries)} recover{'y' if len(recoveries) == 1 else 'ies'}")
    return ", ".join(parts)
