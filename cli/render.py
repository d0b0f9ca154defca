"""Pure rendering: a ClusterStatus (or a run result) to rich renderables and plain text."""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.table import Table
from rich.text import Text

from core.status import ClusterStatus, CoordinatorState, NodeState, NodeStatus, age, percent

if TYPE_CHECKING:  # `status` renders without loading what `check` and `plan` need (cli/app.py)
    from core.lifecycle import NodeCheck
    from core.plan_explained import PlanRow

STATE_STYLE = {
    NodeState.READY: "green",
    NodeState.STARTING: "yellow",
    NodeState.RESTARTING: "yellow",
    NodeState.RECONNECTING: "yellow",
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


def compact(value: int) -> str:
    """Bytes in at most four characters: ``512K``, ``3.3M``, ``24G``."""
    amount = float(value)
    for unit in "BKMGT":
        if amount < 999.5 or unit == "T":
            return f"{amount:.1f}{unit}" if amount < 9.95 and unit != "B" else f"{amount:.0f}{unit}"
        amount /= 1024
    return f"{amount:.0f}T"


BAR_CELLS = 4
_EIGHTHS = " ▏▎▍▌▋▊▉"


def bar(fraction: float, cells: int = BAR_CELLS) -> str:
    """A horizontal bar in eighths of a cell, ``░`` for the empty part."""
    eighths = round(min(max(fraction, 0.0), 1.0) * cells * 8)
    full, part = divmod(eighths, 8)
    text = "█" * full + (_EIGHTHS[part] if part else "")
    return text + "░" * (cells - len(text))


def memory(node: NodeStatus) -> str:
    """What the worker holds of its node's memory: a bar and ``used/total``.

    GPU nodes: device memory in use (nvidia-smi / rocm-smi). Others: the worker's resident memory against
    the memory it reported. The total is the node's cap (the inventory's ``memory:``) where that is less: the
    planner uses no more. ``-`` where the node never reported its memory.
    """
    used: int | None
    if node.gpu_mem_used is not None and node.gpu_mem_total:
        used, total = node.gpu_mem_used, node.gpu_mem_total
    elif node.mem_total:
        used, total = node.rss, node.mem_total
    else:
        return "-"
    if node.mem_cap is not None:
        total = min(total, node.mem_cap)
    if used is None:
        return f"{'░' * BAR_CELLS} -/{compact(total)}"
    return f"{bar(used / total)} {compact(used)}/{compact(total)}"


def load(node: NodeStatus) -> str:
    """GPU busy on a GPU node, else the worker's CPU use (100% = one core)."""
    value = node.gpu_percent if node.gpu_percent is not None else node.cpu_percent
    return "-" if value is None else f"{value:.0f}%"


def layers(node: NodeStatus) -> str:
    """A node's layer range."""
    if node.layers is None:
        return "-"
    first, last = node.layers
    return f"{first}-{last}" if first != last else str(first)


def header(status: ClusterStatus, now: float) -> list[Text]:
    """Three lines: what runs (cluster, model, coordinator, uptime), how it runs (rates, requests, plan), then
    who waits (slots generating, the queue against its bound, requests deferred and refused, and those sampled on
    the coordinator)."""
    first = Text()
    first.append(status.cluster, style="bold")
    first.append(f"  model {status.model}  coordinator ")
    first.append(str(status.coordinator.state), style=COORDINATOR_STYLE[status.coordinator.state])
    if status.coordinator.progress:
        first.append(f" ({status.coordinator.progress})")
    if status.coordinator.restarts:
        first.append(f" (restarts {status.coordinator.restarts})")
    first.append(f"  up {duration(now - status.started_at)}")
    parts = []
    if status.decode_tokens_per_s is not None:
        parts.append(f"decode {status.decode_tokens_per_s:.1f} tok/s")
    if status.prompt_tokens_per_s is not None:
        parts.append(f"prompt {status.prompt_tokens_per_s:.0f} tok/s")
    parts.append(f"requests {status.requests_served}" + (
        f" ({status.requests_in_flight} in flight)" if status.requests_in_flight else ""))
    if status.recoveries:
        parts.append(f"recoveries {status.recoveries}")
    if status.predicted_ms:
        parts.append(f"plan {status.predicted_ms:.1f} ms/tok")
    load = [f"slots {status.slots_busy}/{status.slots}", f"queue {status.queue_length}/{status.queue_limit}",
            f"deferred {status.requests_deferred}", f"rejected {status.requests_rejected}"]
    if status.slots > 1:  # with one slot, the request's own decode rate above is all of it
        load.append(f"all decode {status.aggregate_decode_tokens_per_s:.1f} tok/s")
    if status.requests_sampled_on_coordinator:  # every logit of every token crossed the network for these
        load.append(f"sampled here {status.requests_sampled_on_coordinator}")
    if status.tokens_drafted:  # speculative decoding: how many tokens came without a step of their own
        load.append(f"drafts kept {status.tokens_accepted}/{status.tokens_drafted}")
    return [first, Text("  ".join(parts)), Text("  ".join(load))]


@dataclass(frozen=True)
class _Column:
    title: str
    cell: Callable[[NodeStatus, float], str]  # the node, and the time the screen is drawn at
    right: bool = False   # numbers line up on the right
    drop: int = 0         # where the width leaves no room, dropped in this order (1 first); 0: always shown
    sparse: bool = False  # left out while no node has a value for it ("-" on every row)


def _compute(node: NodeStatus, now: float) -> str:
    # ms/token as the relay measures it; only meaningful for a node that holds layers.
    return f"{node.compute_ms:.2f}" if node.compute_ms is not None and node.layers else "-"


def _planned(node: NodeStatus, now: float) -> str:
    # The running plan's share of a token for the node (a node without layers has none).
    return f"{node.predicted_ms:.2f}" if node.predicted_ms is not None and node.layers else "-"


def _live(node: NodeStatus, now: float) -> str:
    # The median of its latest computes under the running plan ("-" until there are enough).
    return f"{node.live_ms:.2f}" if node.live_ms is not None and node.layers else "-"


def _drift(node: NodeStatus, now: float) -> str:
    # The live time's departure from the plan's share, as `plan` gives it.
    return percent(node.drift) if node.drift is not None and node.layers else "-"


def profile(node: NodeStatus, now: float) -> str:
    """How the node's speed profile was taken and how long ago, in `plan`'s words: ``timed 2 h`` (by the
    profiler) or ``live 3 min`` (corrected from the relay's live times); ``-`` for a node never profiled."""
    if node.profiled_at is None:
        return "-"
    # never negative, should the clock have stepped back since the profile was stamped
    return f"{node.profile_source or 'timed'} {age(max(0.0, now - node.profiled_at))}"


def _compute_failures(node: NodeStatus, now: float) -> str:
    # Failed computes the worker reported and the coordinator retried in place; "-": a stock worker, which aborts
    # instead of reporting one (or one not probed yet).
    return str(node.compute_failures) if node.compute_status or node.compute_failures else "-"


def compute_failure(node: NodeStatus) -> str:
    """The node's failed computes in words, with the latest ('' when it reported none)."""
    if not node.compute_failures:
        return ""
    count = node.compute_failures
    when = "" if node.last_compute_failure_at is None else (
        f" {time.strftime('%H:%M:%S', time.localtime(node.last_compute_failure_at))}")
    # The enum's prefix says nothing here and would push the line past 80 columns.
    last = node.last_compute_failure.replace("GGML_STATUS_", "")
    return f"{count} failed compute{'s' if count != 1 else ''} retried in place; last{when} {last}"


# What the plan learns from the relay (PLAN, LIVE, DRIFT, PROFILE) is dropped first on a narrow screen, then CFAIL,
# then LOAD: what a node holds, its state and its measured time per token always stay.
NODE_COLUMNS = (
    _Column("NODE", lambda node, now: node.name),
    _Column("BACKEND", lambda node, now: f"{node.arch or '?'}/{node.backend or '?'}"),
    _Column("STATE", lambda node, now: str(node.state)),
    _Column("LAYERS", lambda node, now: layers(node)),
    _Column("MEMORY", lambda node, now: memory(node)),
    _Column("LOAD", lambda node, now: load(node), right=True, drop=6),
    _Column("MS/TOK", _compute, right=True),
    _Column("PLAN", _planned, right=True, drop=4, sparse=True),
    _Column("LIVE", _live, right=True, drop=3, sparse=True),
    _Column("DRIFT", _drift, right=True, drop=2, sparse=True),
    _Column("PROFILE", profile, drop=1, sparse=True),
    _Column("COMPUTES", lambda node, now: "-" if node.link == "direct" else str(node.computes + node.recomputes),
            right=True),
    _Column("CFAIL", _compute_failures, right=True, drop=5),
    _Column("RESTARTS", lambda node, now: str(node.restarts), right=True),
)


def node_lines(status: ClusterStatus, width: int, now: float) -> list[Text]:
    """The node table: a row per node, and under a row the node's last status when it has one.

    Columns that may go are dropped, in their ``drop`` order, until the rest fit ``width``; the status line gets
    the whole width, so an error is readable at 80 columns.
    """
    cells = {column: [column.cell(node, now) for node in status.nodes] for column in NODE_COLUMNS}
    widths = {column: max([len(column.title), *(len(cell) for cell in cells[column])]) for column in NODE_COLUMNS}
    shown = [column for column in NODE_COLUMNS if not column.sparse or any(cell != "-" for cell in cells[column])]
    for column in sorted((column for column in shown if column.drop), key=lambda column: column.drop):
        if sum(widths[each] for each in shown) + len(shown) - 1 <= width:
            break
        shown.remove(column)

    def line(values: list[str], styles: dict[int, str] | None = None) -> Text:
        text = Text(no_wrap=True, overflow="ellipsis")
        for index, (column, value) in enumerate(zip(shown, values, strict=True)):
            padded = value.rjust(widths[column]) if column.right else value.ljust(widths[column])
            text.append(padded, style=(styles or {}).get(index, ""))
            if index < len(shown) - 1:
                text.append(" ")
        return text

    lines = [line([column.title for column in shown], dict.fromkeys(range(len(shown)), "bold"))]
    state_index = shown.index(NODE_COLUMNS[2])
    for row, node in enumerate(status.nodes):
        lines.append(line([cells[column][row] for column in shown], {state_index: STATE_STYLE[node.state]}))
        last = node.last_error or node.last_status or compute_failure(node)
        if not last and node.state == NodeState.READY and node.layers is None and status.tensor_split:
            last = "no layers in this plan; `ggml-cluster plan` says why"
        last = last or node.device  # with nothing to report, the device it serves (a software one says so)
        if node.left_out and node.retry_at is not None:
            last += (f" (failed {node.failures} time{'s' if node.failures != 1 else ''}; next try in "
                     f"{duration(node.retry_at - now)})")
        if last:
            style = {NodeState.FAILED: "red", NodeState.RESTARTING: "yellow",
                     NodeState.RECONNECTING: "yellow"}.get(node.state, "dim")
            lines.append(Text(f"  └ {last}", style=style, no_wrap=True, overflow="ellipsis"))
    return lines


def event_lines(status: ClusterStatus, count: int = 5) -> list[Text]:
    """The latest events, oldest first, a line each."""
    lines = []
    for event in status.events[-count:]:
        stamp = time.strftime("%H:%M:%S", time.localtime(event.time))
        where = f"[{event.node}] " if event.node else ""
        lines.append(Text(f"{stamp} {where}{event.kind}: {event.message}", style="dim", no_wrap=True,
                          overflow="ellipsis"))
    return lines


@dataclass(frozen=True)
class StatusView:
    """The status screen of one snapshot, laid out for the width it is drawn at (so a resize re-lays it)."""

    status: ClusterStatus
    now: float | None = None  # None: the time it is drawn at, so a live screen's uptime keeps moving
    events: int = 5

    def lines(self, width: int) -> list[Text]:
        """The screen as lines, at most ``width`` cells wide."""
        now = time.time() if self.now is None else self.now
        lines = [*header(self.status, now), Text(), *node_lines(self.status, width, now)]
        if self.events and self.status.events:
            lines += [Text(), Text("events", style="bold"), *event_lines(self.status, self.events)]
        if self.status.dashboard_url:
            lines += [Text(), Text(f"web dashboard {self.status.dashboard_url}", style="dim", no_wrap=True,
                                   overflow="ellipsis")]
        return lines

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        """Rich's rendering hook."""
        yield from self.lines(options.max_width)


def status_view(status: ClusterStatus, now: float | None = None, events: int = 5) -> StatusView:
    """The whole status screen."""
    return StatusView(status, now, events)


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
        how = node.detail + (f"; device {node.device}" if node.device else "")
        table.add_row(node.name, node.host, Text(str(node.state), style=STATE_STYLE[node.state]),
                      node.backend or "-", node.last_error if node.left_out else how or "-")
    return table


def check_table(rows: list[NodeCheck]) -> Table:
    """`check`: one row per node, problems in red."""
    table = Table(box=None, pad_edge=False, collapse_padding=True, header_style="bold")
    for column in ("NODE", "HOST", "SYSTEM", "BACKEND", "WORKER", "PORT"):
        table.add_column(column, no_wrap=True)
    table.add_column("HARDWARE / PROBLEM", overflow="fold")
    for row in rows:
        device = f"; device {row.device}" if row.device else ""
        last = Text(row.problem, style="bold red") if row.problem else Text(f"{row.hardware}; {row.reason}{device}")
        if row.note:
            last.append(f"; {row.note}", style="yellow")
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
