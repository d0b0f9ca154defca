"""Where tokens are sampled: on the node that holds the output layer (`sampling: node`) against the coordinator
(`sampling: coordinator`, every logit of every token shipped), on the real quantized model.

Two real workers on loopback, each behind a relay (core.rpc.relay, as the controller runs them) that counts the
bytes each way. Per round each arm loads the coordinator (the child process the controller runs) over the same
workers and decodes the same greedy request; the arms alternate which goes first. Reported per arm: decode tok/s,
first-token ms, bytes per token (prompt included, loading not) from and to the output layer's worker, and the
workers' compute buffers (llama.cpp's reserve, from the coordinator's log). Loopback has no link cost: the last
lines add the time each arm's bytes per token take at 100 Mbit and 1 Gbit to its measured time (an estimate; the
shaped network bed is still to come).

    .venv/bin/python bench/sampling.py [--rounds 4] [--tokens 128] [--parallel 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from relay import start_relays
from sharding import start_worker, stop_workers

from core.engine.coordinator import CoordinatorConfig
from core.rpc.relay import RelayHost
from tests.harness import free_port
from tests.realmodel import real_model

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
ARMS = ("coordinator", "node")
LINKS = {"100 Mbit": 100e6, "1 Gbit": 1e9}


def run_arm(model: Path, endpoints: list[str], sampling: str, tokens: int, parallel: int, log: Path,
            loaded: Callable[[], None]) -> tuple[float, float]:
    """Load the coordinator with ``sampling`` (``loaded`` is called once it has) and decode ``parallel`` greedy
    requests at once; (decode tok/s of all of them together, first-token ms of the first)."""
    config = CoordinatorConfig(model=str(model), endpoints=tuple(endpoints), tensor_split=(0.5, 0.5), context=1024,
                               sampling=sampling, parallel=parallel)
    with log.open("w") as stderr:
        coordinator = subprocess.Popen([sys.executable, "-m", "core.engine.coordinator", config.to_json()],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                       cwd=ROOT, env={**os.environ, "GGML_NO_BACKTRACE": "1"})
    assert coordinator.stdin is not None and coordinator.stdout is not None
    try:
        ready = json.loads(coordinator.stdout.readline())
        if ready.get("event") != "ready":
            raise RuntimeError(f"coordinator did not load: {ready}")
        loaded()
        started = time.perf_counter()
        for rid in range(parallel):
            coordinator.stdin.write(json.dumps({"op": "generate", "id": rid + 1, "prompt": PROMPT,
                                                "max_tokens": tokens, "ignore_eos": True}) + "\n")
        coordinator.stdin.flush()
        first: float | None = None
        done, decode_s = 0, 0.0
        while done < parallel:
            message = json.loads(coordinator.stdout.readline())
            if message["event"] == "token" and first is None:
                first = time.perf_counter() - started
            elif message["event"] == "done":
                done += 1
                decode_s = max(decode_s, message["decode_s"])
            elif message["event"] == "failed":
                raise RuntimeError(message)
        return parallel * (tokens - 1) / decode_s, (first or 0.0) * 1000
    finally:
        coordinator.stdin.close()
        coordinator.wait(60)


def compute_buffers(log: Path) -> list[float]:
    """The RPC devices' compute buffers (MiB) that llama.cpp reserved, in device order."""
    return [float(size) for size in re.findall(r"RPC\d+\[[^\]]+\] compute buffer size = +([\d.]+) MiB",
                                               log.read_text(errors="replace"))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--parallel", type=int, default=1, help="requests decoded together")
    args = parser.parse_args()
    model = real_model()
    ports = [free_port(), free_port()]
    workers = [start_worker(port) for port in ports]
    host = RelayHost()
    relays, relayed = start_relays(host, [("127.0.0.1", port) for port in ports])
    rate: dict[str, list[float]] = {arm: [] for arm in ARMS}
    first: dict[str, list[float]] = {arm: [] for arm in ARMS}
    sent: dict[str, list[float]] = {arm: [] for arm in ARMS}      # bytes per token from the output worker
    received: dict[str, list[float]] = {arm: [] for arm in ARMS}  # bytes per token to it
    buffers: dict[str, list[float]] = {}
    output = relays[-1].stats
    try:
        with tempfile.TemporaryDirectory() as scratch:
            for round_ in range(args.rounds):
                for arm in ARMS[round_ % 2:] + ARMS[:round_ % 2]:
                    before = [0, 0]

                    def loaded(before: list[int] = before) -> None:
                        before[:] = [output.bytes_from, output.bytes_to]  # the model's weights went before

                    log = Path(scratch) / f"{arm}.log"
                    tok_s, first_ms = run_arm(model, relayed, arm, args.tokens, args.parallel, log, loaded)
                    generated = args.parallel * args.tokens
                    rate[arm].append(tok_s)
                    first[arm].append(first_ms)
                    sent[arm].append((output.bytes_from - before[0]) / generated)
                    received[arm].append((output.bytes_to - before[1]) / generated)
                    buffers[arm] = compute_buffers(log)
    finally:
        asyncio.run(host.close(relays))
        stop_workers(workers)
    print(f"model {model.name}, 2 workers on loopback through relays, {args.parallel} request(s) at once, "
          f"{args.tokens} tokens each, {args.rounds} rounds")
    for arm in ARMS:
        print(f"sampling: {arm:<12} decode {statistics.median(rate[arm]):6.1f} tok/s "
              f"({', '.join(f'{value:.1f}' for value in rate[arm])})  first token "
              f"{statistics.median(first[arm]):6.0f} ms  from output worker {statistics.median(sent[arm]):10,.0f} "
              f"B/token  to it {statistics.median(received[arm]):8,.0f} B/token  compute buffers "
              f"{' / '.join(f'{size:.1f}' for size in buffers[arm])} MiB")
    paired = statistics.median(node / here for node, here in zip(rate["node"], rate["coordinator"], strict=True))
    print(f"decode, node / coordinator on loopback = {paired:.3f} (paired by round)")
    for link, bits in LINKS.items():
        estimate = {arm: 1 / (1 / statistics.median(rate[arm]) + (statistics.median(sent[arm])
                                                                   + statistics.median(received[arm]))
                             * 8 / bits)
                    for arm in ARMS}
        print(f"with each token's bytes sent over {link}: node {estimate['node']:.1f} tok/s, coordinator "
              f"{estimate['coordinator']:.1f} tok/s ({estimate['node'] / estimate['coordinator']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
