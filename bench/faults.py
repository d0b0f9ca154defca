"""Recovery time and the cost of supervision, on a model big enough that a token takes tens of ms.

1. Decode tokens/s, side by side in alternating rounds:
   - supervised: `ggml-cluster up` (supervised workers, controller, watchdog) and `run`;
   - bare: the same two ggml-rpc-server binaries started by hand and the coordinator driven directly,
     with the same tensor_split: no supervisor, no controller.
2. Recovery time, fault → first resumed token, for `kill -9` of a worker and for `SIGSTOP` of a worker
   (which the watchdog finds; its bound is part of that time).

    .venv/bin/python bench/faults.py [--rounds 3] [--tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core import client
from core.engine.coordinator import CoordinatorConfig
from core.nodes.build import worker_binary
from core.state import StateDir
from tests.harness import Cluster, big_model, listening

PROMPT = "The cluster"
WATCHDOG_S = 3


def supervised_rate(cluster: Cluster, tokens: int) -> float:
    result = json.loads(cluster.cli("run", PROMPT, "-n", str(tokens), "--json").stdout)
    return float(result["timings"]["decode_tokens_per_s"])


def bare_rate(model: Path, ports: list[int], tokens: int, context: int) -> float:
    binary = worker_binary("cpu").path
    workers = [subprocess.Popen([str(binary), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for port in ports]
    try:
        while not all(listening(port) for port in ports):
            time.sleep(0.05)
        config = CoordinatorConfig(model=str(model), endpoints=tuple(f"127.0.0.1:{port}" for port in ports),
                                   tensor_split=(0.5, 0.5), context=context)
        coordinator = subprocess.Popen([sys.executable, "-m", "core.engine.coordinator", config.to_json()],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                       text=True, cwd=Path(__file__).resolve().parent.parent)
        assert coordinator.stdin is not None and coordinator.stdout is not None
        assert json.loads(coordinator.stdout.readline())["event"] == "ready"
        coordinator.stdin.write(json.dumps({"op": "generate", "id": 1, "prompt": PROMPT, "max_tokens": tokens}) + "\n")
        coordinator.stdin.flush()
        while (message := json.loads(coordinator.stdout.readline()))["event"] != "done":
            pass
        coordinator.stdin.write('{"op": "shutdown"}\n')
        coordinator.stdin.close()
        coordinator.wait(timeout=30)
        return float(message["completion_tokens"]) / float(message["decode_s"])
    finally:
        for process in workers:
            process.kill()
            process.wait()


async def recovery_time(cluster: Cluster, fault: str, tokens: int) -> float:
    """Seconds from the fault to the next token the user sees."""
    state = StateDir(cluster.state)
    victim = cluster.worker_pid("n1")
    arrived = 0
    fault_at = 0.0
    async for event in client.run(state, {"prompt": PROMPT, "max_tokens": tokens}):
        if event.get("event") != "token":
            continue
        arrived += 1
        if arrived == 10:
            fault_at = time.perf_counter()
            os.kill(victim, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        elif arrived == 11:
            return time.perf_counter() - fault_at
    raise RuntimeError("the run ended before the fault was recovered")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-faults-", dir="/tmp"))
    model = big_model(Path(tempfile.gettempdir()) / "ggml-cluster-bench-180mb.gguf")
    cluster = Cluster(root, nodes=2, context=512, top=[f"model: {model}", f"watchdog: {WATCHDOG_S}"])
    supervised: list[float] = []
    bare: list[float] = []
    try:
        for _ in range(args.rounds):
            cluster.cli("up")
            supervised.append(supervised_rate(cluster, args.tokens))
            cluster.cli("down")
            bare.append(bare_rate(model, cluster.ports, args.tokens, 512))
        kill: list[float] = []
        hang: list[float] = []
        for _ in range(args.rounds):
            # A fresh cluster for each fault: repeated faults lengthen the supervisor's backoff.
            for fault, times in (("kill", kill), ("stop", hang)):
                cluster.cli("up")
                times.append(asyncio.run(recovery_time(cluster, fault, args.tokens)))
                cluster.cli("down")
    finally:
        cluster.cli("down", check=False)
        shutil.rmtree(root, ignore_errors=True)
    print(f"model {model.stat().st_size / 1e6:.0f} MB, 2 local workers (-t 1), {args.tokens} tokens, "
          f"{args.rounds} alternating rounds (median)")
    print(f"  decode tok/s  supervised {statistics.median(supervised):6.1f}   bare {statistics.median(bare):6.1f}   "
          f"ratio {statistics.median(supervised) / statistics.median(bare):.3f}")
    print(f"    runs supervised {', '.join(f'{v:.1f}' for v in supervised)}; "
          f"bare {', '.join(f'{v:.1f}' for v in bare)}")
    print(f"  recovery, fault -> first resumed token: kill -9 worker {statistics.median(kill):.2f} s, "
          f"SIGSTOP worker {statistics.median(hang):.2f} s (watchdog {WATCHDOG_S} s)")
    print(f"    runs kill {', '.join(f'{v:.2f}' for v in kill)}; stop {', '.join(f'{v:.2f}' for v in hang)}")


if __name__ == "__main__":
    main()
