"""The `ggml-cluster` command: parse, call core, render."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from cli import dashboard
from cli.render import check_table, deploy_table, plan_table, run_summary, status_view, to_text
from core import client
from core.errors import ClusterError
from core.inventory import Inventory, direct_warnings, find_inventory, load_inventory
from core.status import ClusterStatus, NodeState

# `status` and `run` load only core.client and the plain data: the commands that start, stop, check and plan a
# cluster import core.lifecycle (SSH, GGUF, the planner: half a second more) when they run.
if TYPE_CHECKING:
    from core.lifecycle import UpResult
    from core.plan_explained import PlanRow
    from core.planner import Plan

app = typer.Typer(
    name="ggml-cluster",
    help="Run one llama.cpp model across several machines with ggml-rpc, and keep it running.\n\n"
    "Inventory: -i PATH, else $GGML_CLUSTER_INVENTORY, else ./inventory.yaml, else the embedded default "
    "(two local workers and a tiny demo model). Exit codes: 0 success, 1 runtime failure, 2 bad usage "
    "or bad inventory.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True)
T = TypeVar("T")


class Options:
    """Global options shared by every command."""

    inventory: str | None = None
    debug: bool = False


OPTIONS = Options()

# Accepted before the command (`ggml-cluster -i inv.yaml up`) and after it (`ggml-cluster up -i inv.yaml`);
# the command's own takes precedence.
InventoryOption = Annotated[str | None, typer.Option(
    "--inventory", "-i", metavar="PATH",
    help="Inventory YAML file (else $GGML_CLUSTER_INVENTORY, else ./inventory.yaml, else the embedded default).")]
DebugOption = Annotated[bool, typer.Option("--debug", help="Show tracebacks.")]


@app.callback()
def _global(inventory: InventoryOption = None, debug: DebugOption = False) -> None:
    OPTIONS.inventory = inventory
    OPTIONS.debug = debug


def _fail(exc: ClusterError) -> NoReturn:
    """One line on stderr and the error's exit code (the traceback with --debug)."""
    if OPTIONS.debug:
        raise exc
    err.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
    raise typer.Exit(exc.exit_code) from None


def _execute(work: Coroutine[Any, Any, T], interrupted: str = "") -> T:
    """Run a core coroutine; a ClusterError becomes one line on stderr and its exit code.

    ``interrupted`` tells the user what Ctrl-C left behind and what to do about it.
    """
    try:
        return asyncio.run(work)
    except ClusterError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        err.print(f"interrupted{'; ' + interrupted if interrupted else ''}", highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None


def _inventory(inventory_file: str | None, debug: bool) -> Inventory:
    """The inventory to use, with the command's own -i and --debug applied over those before it."""
    OPTIONS.inventory = inventory_file or OPTIONS.inventory
    OPTIONS.debug = OPTIONS.debug or debug
    try:
        return load_inventory(find_inventory(OPTIONS.inventory))
    except ClusterError as exc:
        _fail(exc)


@app.command()
def up(
    require_all: Annotated[bool, typer.Option("--require-all", help="Fail unless every node comes up.")] = False,
    inventory_file: InventoryOption = None,
    debug: DebugOption = False,
) -> None:
    """Start the cluster (workers, controller, coordinator) and wait until it can serve.

    Idempotent: with nothing changed it returns at once; a changed inventory restarts the cluster.
    """
    from core import lifecycle
    from core.planner import slots_note

    inventory = _inventory(inventory_file, debug)
    for warning in direct_warnings(inventory):
        err.print(f"[yellow]warning:[/yellow] {warning}", highlight=False, soft_wrap=True)
    seen: dict[str, str] = {}
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                        TimeElapsedColumn(), console=err, transient=True)
    task: list[TaskID] = []
    bars: dict[str, TaskID] = {}

    def on_build(message: str, fraction: float | None) -> None:
        if not task:
            progress.start()
            task.append(progress.add_task(message, total=1.0))
        progress.update(task[0], description=message, completed=fraction or 0.0)

    def on_status(snapshot: ClusterStatus) -> None:
        if task:
            progress.stop()
            task.clear()
        for node in snapshot.nodes:
            if node.state == NodeState.DEPLOYING and node.last_status:
                if node.name not in bars:
                    progress.start()
                    bars[node.name] = progress.add_task(node.last_status, total=1.0)
                progress.update(bars[node.name], description=f"{node.name}: {node.last_status}",
                                completed=node.progress or 0.0)
            elif node.name in bars:
                progress.update(bars.pop(node.name), visible=False)
            state = str(node.state)
            if seen.get(node.name) != state:
                seen[node.name] = state
                detail = f" ({node.last_error})" if node.left_out else ""
                err.print(f"  {node.name}: {state}{detail}", highlight=False)
        coordinator = f"coordinator {snapshot.coordinator.state}"
        if seen.get("") != coordinator:
            seen[""] = coordinator
            err.print(f"  {coordinator}", highlight=False)

    async def work() -> UpResult:
        try:
            return await lifecycle.bring_up(inventory, on_status, on_build, require_all)
        finally:
            progress.stop()

    result = _execute(work(), "what this `up` had started was stopped; run `ggml-cluster up` again")
    snapshot = result.status
    if result.already_up:
        err.print(f"cluster '{inventory.cluster}' is already up with this inventory; nothing changed")
    elif result.restarted:
        err.print(f"cluster '{inventory.cluster}' restarted with the changed inventory")
    elif result.adopted:
        err.print("a new controller adopted the workers that were still running (they were not restarted)")
    out.print(status_view(snapshot, events=0))
    if any(node.kind != "local" or node.left_out for node in snapshot.nodes):
        out.print(deploy_table(snapshot))
    ready = sum(node.state == NodeState.READY for node in snapshot.nodes)
    failed = lifecycle.failed_nodes(snapshot)
    if failed:
        err.print(f"[yellow]warning:[/yellow] running on {ready} of {len(snapshot.nodes)} nodes; left out: "
                  f"{'; '.join(failed)}", soft_wrap=True, highlight=False)
    holding = sum(node.layers is not None for node in snapshot.nodes)
    predicted = f", predicted {snapshot.predicted_ms:.1f} ms/token" if snapshot.predicted_ms else ""
    err.print(f"plan: {snapshot.strategy}, layers on {holding} of {ready} worker(s){predicted}, "
              f"{slots_note(snapshot.slots, inventory.api.parallel)}; `ggml-cluster plan` says why",
              highlight=False, soft_wrap=True)
    for kind, address, shown in (("metrics", snapshot.metrics_endpoint, "metrics: http://{}/metrics"),
                                 ("api", snapshot.api_endpoint, "api: http://{}/v1 (OpenAI-compatible)")):
        problem = next((event.message for event in reversed(snapshot.events) if event.kind == f"{kind}-failed"), None)
        if problem:
            err.print(f"[yellow]warning:[/yellow] {problem}", soft_wrap=True, highlight=False)
        elif address:
            err.print(shown.format(address), soft_wrap=True, highlight=False)
    if snapshot.dashboard_url:
        signing_in = " (sign in with the API key)" if inventory.api_key else ""
        err.print(f"dashboard: {snapshot.dashboard_url}{signing_in}", soft_wrap=True, highlight=False)
    err.print(f"ready: {ready} worker(s), model {snapshot.model}; "
              f"try `ggml-cluster run \"Hello\"` or `ggml-cluster status`", soft_wrap=True, highlight=False)


@app.command()
def status(
    *,
    once: Annotated[bool, typer.Option("--once", help="Print one snapshot and exit.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON snapshot.")] = False,
    watch: Annotated[bool, typer.Option("--watch", help="With --json: one JSON object per line.")] = False,
    interval: Annotated[float, typer.Option(min=0.1, help="Seconds between refreshes (at least 0.1).")] = 1.0,
    inventory_file: InventoryOption = None,
    debug: DebugOption = False,
) -> None:
    """Show the cluster: a live dashboard on a terminal, else one snapshot."""
    state = client.state_for(_inventory(inventory_file, debug))

    async def work() -> None:
        if as_json and watch:
            async for snapshot in client.watch(state, interval):
                sys.stdout.write(json.dumps(snapshot.to_dict()) + "\n")
                sys.stdout.flush()
        elif as_json:
            sys.stdout.write(json.dumps((await client.status(state)).to_dict(), indent=2) + "\n")
        elif once or not out.is_terminal:
            snapshot = await client.status(state)
            if out.is_terminal:
                out.print(status_view(snapshot))
            else:
                sys.stdout.write(to_text(status_view(snapshot), width=120))
        else:
            await client.status(state)  # fail fast with a clear error when the cluster is not up
            await dashboard.live(state, out, interval)

    _execute(work())


@app.command()
def run(
    prompt: Annotated[str, typer.Argument(help="The prompt.")],
    *,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", min=1, help="Tokens to generate.")] = 128,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 is greedy (deterministic).")] = 0.0,
    seed: Annotated[int | None, typer.Option(help="Sampling seed (with --temperature > 0).")] = None,
    top_k: Annotated[int | None, typer.Option(help="Sample from the K likeliest tokens (0: all; default 40).")] = None,
    top_p: Annotated[float | None, typer.Option(help="Sample from the likeliest tokens that make up P of the "
                                                     "probability (1: all; default 0.95).")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="End the text before this string (repeatable, up to 4); "
                                                        "it is not printed.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object at the end.")] = False,
    chat: Annotated[bool, typer.Option("--chat", help="Send the prompt as a user message, rendered with the "
                                                      "inventory's chat_template or the model's own (as "
                                                      "/v1/chat/completions does).")] = False,
    inventory_file: InventoryOption = None,
    debug: DebugOption = False,
) -> None:
    """Stream a completion from the cluster to stdout."""
    state = client.state_for(_inventory(inventory_file, debug))
    request: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed, "top_k": top_k,
                               "top_p": top_p, "stop": stop}
    request.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})

    async def work() -> dict[str, Any]:
        async for event in client.run(state, request):
            kind = event.get("event")
            if kind == "token" and not as_json:
                sys.stdout.write(event["text"])
                sys.stdout.flush()
            elif kind == "notice":
                err.print(f"\n[yellow]notice:[/yellow] {event['message']}", highlight=False, soft_wrap=True)
            elif kind == "done":
                return event
        raise ClusterError("the controller closed the stream before the run finished")

    result = _execute(work())
    if as_json:
        sys.stdout.write(json.dumps({key: value for key, value in result.items() if key != "event"}) + "\n")
    else:
        sys.stdout.write("\n")
        err.print(run_summary(result), style="dim", highlight=False)


@app.command()
def check(
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    inventory_file: InventoryOption = None,
    debug: DebugOption = False,
) -> None:
    """Preflight every node (reach, hardware, backend, toolchain, worker, port) without starting anything.

    Exits 1 when any node has a problem.
    """
    from core import lifecycle

    inventory = _inventory(inventory_file, debug)
    rows = _execute(lifecycle.check(inventory))
    if as_json:
        sys.stdout.write(json.dumps([row.to_dict() for row in rows], indent=2) + "\n")
    else:
        out.print(check_table(rows))
    bad = [row.name for row in rows if row.problem]
    if bad:
        err.print(f"{len(bad)} of {len(rows)} nodes have problems: {', '.join(bad)}")
        raise typer.Exit(1)
    err.print(f"all {len(rows)} nodes are ready to run a worker")


@app.command()
def plan(
    strategy: Annotated[str | None, typer.Option(
        help="compute (by measured speed), memory (llama.cpp's default) or equal; default: the inventory's.")] = None,
    objective: Annotated[str | None, typer.Option(
        help="For compute: latency (time per token) or throughput (bottleneck); default: the inventory's.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    inventory_file: InventoryOption = None,
    debug: DebugOption = False,
) -> None:
    """Show the layer plan for the running cluster and why each node got its part (changes nothing)."""
    from core import lifecycle
    from core.planner import choice_problem

    inventory = _inventory(inventory_file, debug)
    chosen = strategy or inventory.strategy
    problem = choice_problem(chosen, objective)
    if problem:
        err.print(f"[red]error:[/red] --strategy/--objective: {problem}", highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    result, rows = _execute(lifecycle.explain_plan(inventory, chosen, objective))
    _print_plan(result, rows, as_json, inventory)


def _print_plan(result: Plan, rows: list[PlanRow], as_json: bool, inventory: Inventory) -> None:
    from core.planner import slots_note

    auto = inventory.api.parallel == "auto"
    if as_json:
        sys.stdout.write(json.dumps({**result.to_dict(), "slots_auto": auto, "rows": [row.to_dict() for row in rows]},
                                    indent=2) + "\n")
        return
    out.print(plan_table(rows))
    total = result.predicted_total_s
    predicted = "" if total is None else (f"; predicted {total * 1000:.1f} ms/token ({1 / total:.1f} tok/s) "
                                          f"with {result.overhead_s * 1000:.2f} ms in the coordinator")
    slots = (f"{slots_note(result.slots, inventory.api.parallel)} of {inventory.context} tokens: a "
             f"{inventory.context * result.slots}-token KV cache")
    err.print(f"strategy {result.strategy}: tensor_split {list(result.tensor_split)}; {slots}{predicted}",
              highlight=False, soft_wrap=True)


@app.command()
def profile(
    as_json: Annotated[bool, typer.Option("--json", help="Print the new plan as JSON.")] = False,
    inventory_file: InventoryOption = None,
    debug: DebugOption = False,
) -> None:
    """Measure every node's speed again, re-plan and reload the model (waits for a request in flight)."""
    from core import lifecycle

    inventory = _inventory(inventory_file, debug)
    err.print("measuring the nodes (a few seconds per node) …")
    _execute(lifecycle.reprofile(inventory))
    result, rows = _execute(lifecycle.explain_plan(inventory, inventory.strategy))
    _print_plan(result, rows, as_json, inventory)


@app.command()
def down(
    *,
    keep_workers: Annotated[bool, typer.Option(
        "--keep-workers", help="Leave the workers running (with their cached tensors) for the next `up` to "
                               "adopt, or for another RPC client.")] = False,
    inventory_file: InventoryOption = None,
    debug: DebugOption = False,
) -> None:
    """Stop the coordinator, every worker and the controller."""
    inventory = _inventory(inventory_file, debug)
    state = client.state_for(inventory)
    running = state.controller_pid() is not None
    result = _execute(client.stop_controller(state, keep_workers=keep_workers),
                      "the controller goes on stopping what it had been asked to; `ggml-cluster down` again "
                      "finishes the job (and stops leftover workers)")
    if result is None:  # only then SSH and the nodes' code: a controller that stopped its workers needs neither
        from core import lifecycle

        result = _execute(lifecycle.stop_leftover_workers(state),
                          "some leftover workers may still run; `ggml-cluster down` again stops them")
    if result.cleaned:
        err.print(f"the controller was not running; stopped leftover workers: {', '.join(result.cleaned)}")
    for line in result.unreachable:
        err.print(f"[yellow]warning:[/yellow] could not check for a leftover worker on {line}", highlight=False,
                  soft_wrap=True)
    for line in result.left_running:
        err.print(f"[yellow]warning:[/yellow] {line}", highlight=False, soft_wrap=True)
    kept = "; its workers are still running (the next `up` adopts them)" if keep_workers else ""
    if result.left_running or result.unreachable:
        err.print(f"cluster '{inventory.cluster}' is down but for what runs on the nodes named above")
        raise typer.Exit(1)
    err.print(f"cluster '{inventory.cluster}' is down{kept}" if running or result.cleaned
              else f"cluster '{inventory.cluster}' was not running")
