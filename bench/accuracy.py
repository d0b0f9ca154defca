"""The plan's predictions against measurements, per node: time per token and memory, for two strategies.

On a GGUF (`--model`, default `real`: the Gemma 3 270M Q4_K_M of tests/realmodel.py), for the `compute` and then
the `memory` strategy, each on a fresh cluster of two workers (`-t 1`; local nodes, or with `--ssh` two SSH
nodes on loopback behind real sshd):
  1. `up` starts the workers, `down --keep-workers` leaves them running without a client, and each worker is
     killed for its supervisor to start a fresh one, so that no earlier client's heap is left in it. Then, per
     worker: its resident memory (VmRSS in /proc/PID/status, the pid from the node's worker.pid) and, over RPC
     while no coordinator is connected (a worker serves one client at a time), HELLO and GET_DEVICE_MEMORY.
  2. `up` again (it adopts the workers and loads the model), then `profile`: every node is measured afresh,
     the strategy re-plans with the measurements (the memory strategy is only given predictions this way) and
     the model is reloaded. An 8-token warm-up request.
  3. A greedy decode of `--tokens` tokens (`run --json`) between two `status --json` snapshots.
Per node that holds layers:
  - ms/token: plan.json's `predicted_ms` for the node against the relay's compute times over the decode, the
    difference of `compute_ms_total` over that of `computes_timed` between the snapshots (GRAPH_COMPUTE to the
    first answer after it: the node's share of a token as the coordinator sees it);
  - memory: plan.json's `bytes` for the node against what llama.cpp allocated on its device (the model, KV and
    compute buffers the coordinator's log reports for that worker in the last load), judged; and, shown beside
    it, what the worker took for the model: on a CPU node its resident memory after the decode minus before the
    load (lower than the allocation: a CPU buffer's untouched pages, such as most of the logits buffer a decode
    never fills, are not resident); on a GPU node the node's GPU memory in use after the decode (status's
    `gpu_mem_used`, from nvidia-smi/rocm-smi) minus the device's before the load (total - free from
    GET_DEVICE_MEMORY). GET_DEVICE_MEMORY cannot be read with the model loaded: the coordinator is the worker's
    one client then, and the worker frees a client's buffers when it leaves. llama.cpp's CPU device reports all
    of the machine's memory as free, so on CPU nodes its free/total is shown, not compared.
And for the coordinator: plan.json's `overhead_ms` against the measured total ms/token (`run --json`, first
token to last, as the controller receives them) minus the nodes' measured shares; then the plan's predicted
total against the measured total. Each ratio is measured / predicted, marked ok within the bounds of issue 20
(time per token within 15%, memory within 10%), else off. The bench reads whatever plan.json says, so a better
planner shows here without a change to this file.

    .venv/bin/python bench/accuracy.py [--model PATH|real] [--tokens 128] [--ssh]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from parity import model_argument

from core.model import read_model
from core.rpc.wire import DeviceMemory, probe_worker
from tests.harness import Cluster, alive, listening
from tests.realmodel import real_model
from tests.sshd import SshWorld

CONTEXT = 1024
PROMPT = "The cluster"
STRATEGIES = ("compute", "memory")
MS_BOUND, MEMORY_BOUND = 0.15, 0.10
MIB = 1 << 20


@dataclass
class Before:
    """A fresh worker with no client: its pid, resident bytes and what its devices report."""

    pid: int
    rss: int
    devices: tuple[DeviceMemory, ...]


@dataclass
class Row:
    """One node under one strategy: the plan's predictions and what was measured."""

    strategy: str
    node: str
    layers: list[int] | None
    predicted_ms: float | None
    measured_ms: float | None
    predicted_bytes: int
    allocated_bytes: int | None  # what llama.cpp allocated on the node's device (the coordinator's log)
    used_bytes: int | None
    device: str  # GET_DEVICE_MEMORY before the load, free/total


DEVICE = re.compile(r"llama_prepare_model_devices: using device RPC\d+ \(([^)]+)\)")
BUFFER = re.compile(r"RPC\d+\[([^\]]+)\] (?:model|KV|compute) buffer size =\s+([\d.]+) MiB")


def allocations(log_text: str) -> list[int]:
    """Bytes llama.cpp allocated on each RPC device in the last load of the coordinator's log (weights, KV
    caches, compute buffer), in the order the devices were registered: the plan's nodes with layers."""
    lines = log_text.splitlines()
    starts = [index for index, line in enumerate(lines)
              if DEVICE.search(line) and (index == 0 or not DEVICE.search(lines[index - 1]))]
    load = "\n".join(lines[starts[-1]:]) if starts else ""
    order = DEVICE.findall(load)  # the devices of that load in registration order, as llama.cpp lists them
    totals = dict.fromkeys(order, 0.0)
    for endpoint, size in BUFFER.findall(load):
        totals[endpoint] = totals.get(endpoint, 0.0) + float(size)
    return [int(size * MIB) for size in totals.values()]


def resident(pid: int) -> int:
    """A process's resident memory in bytes (VmRSS of /proc/PID/status)."""
    match = re.search(r"^VmRSS:\s+(\d+) kB$", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/{pid}/status has no VmRSS line")
    return int(match.group(1)) * 1024


def fresh_worker(cluster: Cluster, name: str, port: int) -> Before:
    """Kill node ``name``'s idle worker, wait for the one its supervisor starts, and read that one."""
    old = cluster.worker_pid(name)
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            pid = cluster.worker_pid(name)
        except (FileNotFoundError, ValueError, IndexError):
            pid = old  # the supervisor is between writing the file and filling it
        if pid != old and alive(pid) and listening(port):
            info = asyncio.run(probe_worker("127.0.0.1", port, timeout=10))
            return Before(pid, resident(pid), info.devices)
        time.sleep(0.2)
    raise RuntimeError(f"node {name}: its supervisor did not start a new worker within 60 s")


def new_cluster(root: Path, model: Path, strategy: str, world: SshWorld | None) -> Cluster:
    """Two workers under ``strategy``: local nodes, or the world's SSH nodes (their work dirs under ``root``)."""
    root.mkdir(parents=True)
    if world is None:
        return Cluster(root, nodes=2, context=CONTEXT, strategy=strategy, top=[f"model: {model}"])
    lines = [[f"host: {server.address}", f"port: {server.port}", "user: root", f"identity: {world.identity}"]
             for server in world.servers]
    return Cluster(root, nodes=2, context=CONTEXT, ssh=lines, base_env=world.env(), strategy=strategy,
                   top=[f"model: {model}"], defaults=[f"workdir: {root / 'node root'}"])


def decode_ms(result: dict[str, Any]) -> float:
    """Measured ms per decoded token of a `run --json` result: first token to last, as the controller saw them."""
    timings = result["timings"]
    return 1000 * (timings["total_s"] - timings["first_token_s"]) / (result["completion_tokens"] - 1)


def measure(root: Path, model: Path, strategy: str, tokens: int,
            world: SshWorld | None) -> tuple[list[Row], dict[str, Any], float]:
    """One strategy on a fresh cluster: its rows, its plan.json and the measured total ms/token."""
    cluster = new_cluster(root, model, strategy, world)
    try:
        cluster.cli("up")
        ports = {node["name"]: node["rpc_port"] for node in cluster.status()["nodes"]}
        cluster.cli("down", "--keep-workers")
        before = {name: fresh_worker(cluster, name, port) for name, port in ports.items()}
        cluster.cli("up")
        cluster.cli("profile")
        cluster.cli("run", PROMPT, "-n", "8")
        start = {node["name"]: node for node in cluster.status()["nodes"]}
        result = json.loads(cluster.cli("run", PROMPT, "-n", str(tokens), "--json").stdout)
        end = cluster.status()
        after = {name: resident(state.pid) for name, state in before.items()}
        plan = json.loads((cluster.state / "plan.json").read_text())
        allocated = dict(zip([node["name"] for node in plan["nodes"] if node["layers"]],
                             allocations((cluster.state / "coordinator.log").read_text(errors="replace")),
                             strict=False))
    finally:
        cluster.cli("down", check=False)
    if result["completion_tokens"] < tokens:
        print(f"note: the {strategy} decode stopped at {result['completion_tokens']} of {tokens} tokens (end of text)")
    planned = {node["name"]: node for node in plan["nodes"]}
    rows = []
    for node in end["nodes"]:
        name, first = node["name"], start[node["name"]]
        timed = node["computes_timed"] - first["computes_timed"]
        measured = (node["compute_ms_total"] - first["compute_ms_total"]) / timed if timed else None
        devices = before[name].devices
        if node["backend"] == "cpu":
            used: int | None = after[name] - before[name].rss
        elif node["gpu_mem_used"] is not None:
            used = node["gpu_mem_used"] - sum(device.total - device.free for device in devices)
        else:
            used = None
        device = "+".join(f"{device.free / MIB:.0f}/{device.total / MIB:.0f}" for device in devices)
        rows.append(Row(strategy, name, planned[name]["layers"], planned[name]["predicted_ms"], measured,
                        planned[name]["bytes"], allocated.get(name), used, f"{device} MiB ({node['backend']})"))
    return rows, plan, decode_ms(result)


def judged(predicted: float | None, measured: float | None, bound: float) -> tuple[str, str]:
    """The ratio measured / predicted as text, and ok or off against ``bound`` ('-' where nothing to compare)."""
    if predicted is None or measured is None:
        return "-", "-"
    if predicted <= 0:
        return "inf", "off"
    ratio = measured / predicted
    return f"{ratio:.2f}", "ok" if abs(ratio - 1) <= bound else "off"


def number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report(rows: list[Row], plans: dict[str, dict[str, Any]], totals: dict[str, float]) -> None:
    """The table: per strategy a row per node, then the coordinator's overhead and the total."""
    print(f"{'strategy':<8} {'node':<11} {'layers':<6} {'pred ms':>8} {'meas ms':>8} {'ratio':>5} {'ms':<3} "
          f"{'pred MiB':>8} {'alloc MiB':>9} {'ratio':>5} {'mem':<3} {'used MiB':>8}  device free/total before load")
    for strategy, plan in plans.items():
        nodes = [row for row in rows if row.strategy == strategy]
        for row in nodes:
            held = row.layers is not None
            layers = f"{row.layers[0]}-{row.layers[1]}" if row.layers else "-"
            ms_ratio, ms_mark = judged(row.predicted_ms, row.measured_ms if held else None, MS_BOUND)
            used = row.used_bytes if held else None
            allocated = row.allocated_bytes if held else None
            mem_ratio, mem_mark = judged(row.predicted_bytes if held else None, allocated, MEMORY_BOUND)
            print(f"{strategy:<8} {row.node:<11} {layers:<6} {number(row.predicted_ms):>8} "
                  f"{number(row.measured_ms if held else None):>8} {ms_ratio:>5} {ms_mark:<3} "
                  f"{row.predicted_bytes / MIB:>8.1f} {number(None if allocated is None else allocated / MIB, 1):>9} "
                  f"{mem_ratio:>5} {mem_mark:<3} {number(None if used is None else used / MIB, 1):>8}  {row.device}")
        shares = [row.measured_ms for row in nodes if row.layers is not None]
        total = totals[strategy]
        overhead = None if None in shares else total - sum(share for share in shares if share is not None)
        for name, predicted, measured in (("coordinator", plan["overhead_ms"], overhead),
                                          ("total", plan["predicted_ms"], total)):
            ratio, mark = judged(predicted, measured, MS_BOUND)
            print(f"{strategy:<8} {name:<11} {'':<6} {number(predicted):>8} {number(measured):>8} {ratio:>5} {mark}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=model_argument, help="a GGUF, or 'real' (the default)")
    parser.add_argument("--tokens", type=int, default=128, help="greedy decode length (at least 2)")
    parser.add_argument("--ssh", action="store_true", help="two SSH nodes on loopback instead of local nodes")
    args = parser.parse_args()
    if args.tokens < 2:
        parser.error("argument --tokens: at least 2 (the decode rate is taken from the first token to the last)")
    model = args.model or real_model()
    facts = read_model(model)
    root = Path(tempfile.mkdtemp(prefix="bench-accuracy-", dir="/tmp"))
    world = SshWorld(root / "world", nodes=2) if args.ssh else None
    rows: list[Row] = []
    plans: dict[str, dict[str, Any]] = {}
    totals: dict[str, float] = {}
    try:
        for strategy in STRATEGIES:
            found, plans[strategy], totals[strategy] = measure(root / strategy, model, strategy, args.tokens, world)
            rows += found
    finally:
        if world is not None:
            world.stop()
        shutil.rmtree(root, ignore_errors=True)
    kind = "SSH nodes on loopback" if args.ssh else "local nodes"
    print(f"model {model.name} ({facts.n_layers} layers, {model.stat().st_size / 1e6:.0f} MB), two -t 1 workers "
          f"({kind}), context {CONTEXT}, {args.tokens}-token greedy decode after `profile`")
    print(f"bounds (issue 20): per-node ms/token within {MS_BOUND:.0%} of the prediction, memory within "
          f"{MEMORY_BOUND:.0%}; ratio = measured / predicted")
    report(rows, plans, totals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
