"""What in-protocol compute status (patches/0002) costs and what it saves, on a model where a token takes tens of ms.

1. Decode tokens/s, side by side in alternating rounds on the same two local workers' ports:
   - patched: ggml-cluster as built (patched workers, patched RPC client, compute status negotiated);
   - stock: the same cluster with stock workers (``build: {path}`` to the unpatched build) and the coordinator's RPC
     client library rebuilt from the unpatched source (LLAMA_CPP_LIB_PATH): the stock wire format on both sides.
2. Recovery, from a failed compute to the next token the user sees:
   - a failed compute on a patched worker (its fault hook fails the ``--fault-at``-th compute), retried in place;
   - ``kill -9`` of the same worker at the same point: today's path (worker restart, coordinator restart, reload,
     replay), for comparison.
   Both as the gap between the tokens around the fault, less the median gap of that run (a token's own time).

    .venv/bin/python bench/compute_status.py [--rounds 3] [--tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core import client
from core.state import StateDir
from tests.harness import Cluster, big_model
from tests.stock import stock_client_libdir, stock_worker

PROMPT = "The cluster"
FAULT_TOKEN = 20  # the fault lands while this token is computed


def decode_rate(cluster: Cluster, tokens: int) -> float:
    """Decode tokens/s of one greedy run, as the cluster reports it."""
    import json

    result = json.loads(cluster.cli("run", PROMPT, "-n", str(tokens), "--json").stdout)
    return float(result["timings"]["decode_tokens_per_s"])


async def token_times(cluster: Cluster, tokens: int, on_token: Callable[[int], None] | None = None) -> list[float]:
    """Arrival times of a run's tokens; ``on_token(n)`` is called as the n-th arrives."""
    times: list[float] = []
    async for event in client.run(StateDir(cluster.state), {"prompt": PROMPT, "max_tokens": tokens}):
        if event.get("event") == "token":
            times.append(time.perf_counter())
            if on_token is not None:
                on_token(len(times))
    return times


def fault_gap(times: list[float], at: int) -> float:
    """Seconds the fault added to the token it hit: that token's gap less the run's median gap."""
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    return max(gaps[at - 2:at + 2]) - statistics.median(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-cs-", dir="/tmp"))
    model = big_model()
    top = [f"model: {model}"]
    for arm in ("patched", "stock", "failing"):
        (root / arm).mkdir()
    patched = Cluster(root / "patched", nodes=2, top=top)
    stock_path = stock_worker().path
    stock = Cluster(root / "stock", nodes=2, top=top, ports=patched.ports,
                    defaults=[f"build: {{path: {stock_path}}}"],
                    base_env={**os.environ, "LLAMA_CPP_LIB_PATH": str(stock_client_libdir())})
    rates: dict[str, list[float]] = {"patched": [], "stock": []}
    retried: list[float] = []
    killed: list[float] = []
    try:
        for round_ in range(args.rounds):
            arms = [("patched", patched), ("stock", stock)]
            for name, cluster in arms if round_ % 2 == 0 else arms[::-1]:  # neither always first: drift hits both
                cluster.cli("up")
                rates[name].append(decode_rate(cluster, args.tokens))
                negotiated = [item["session"]["counts"].get("COMPUTE_STATUS", 0) for item in cluster.status()["nodes"]]
                assert negotiated == ([1, 1] if name == "patched" else [0, 0]), (name, negotiated)  # what it says
                cluster.cli("down")
        # The prompt is compute 1 and token n is compute n (its logits come from the step of token n - 1).
        failing = Cluster(root / "failing", nodes=2, top=top, ports=patched.ports,
                          extra={1: ["env:", f"  GGML_RPC_FAULT_COMPUTE: '{FAULT_TOKEN + 1}'"]})
        for _ in range(args.rounds):
            failing.cli("up")
            retried.append(fault_gap(asyncio.run(token_times(failing, args.tokens)), FAULT_TOKEN))
            hit = [(item["compute_failures"], item["compute_retries"], item["restarts"])
                   for item in failing.status()["nodes"]]
            assert hit == [(0, 0, 0), (1, 1, 0)], hit  # one failure, retried in place, nothing restarted
            failing.cli("down")
            patched.cli("up")
            victim = patched.worker_pid("n1")

            def kill(arrived: int, victim: int = victim) -> None:
                if arrived == FAULT_TOKEN - 1:
                    os.kill(victim, signal.SIGKILL)

            killed.append(fault_gap(asyncio.run(token_times(patched, args.tokens, kill)), FAULT_TOKEN))
            patched.cli("down")
    finally:
        for cluster in (patched, stock):
            cluster.cli("down", check=False)
        shutil.rmtree(root, ignore_errors=True)
    ratio = statistics.median(a / b for a, b in zip(rates["patched"], rates["stock"], strict=True))
    print(f"model {model.stat().st_size / 1e6:.0f} MB, 2 local workers (-t 1), {args.tokens} tokens, "
          f"{args.rounds} alternating rounds (median)")
    print(f"  decode tok/s  patched {statistics.median(rates['patched']):6.1f}   "
          f"stock {statistics.median(rates['stock']):6.1f}   patched/stock {ratio:.3f} (goal >= 0.99)")
    print(f"    runs patched {', '.join(f'{v:.1f}' for v in rates['patched'])}; "
          f"stock {', '.join(f'{v:.1f}' for v in rates['stock'])}")
    print(f"  failed compute -> next token: retried in place {statistics.median(retried) * 1000:.1f} ms "
          f"(goal < 100 ms); kill -9 of that worker {statistics.median(killed):.2f} s")
    print(f"    runs in place {', '.join(f'{v * 1000:.1f}' for v in retried)} ms; "
          f"kill {', '.join(f'{v:.2f}' for v in killed)} s")


if __name__ == "__main__":
    main()
