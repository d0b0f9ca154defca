"""What observing the cluster costs: decode tokens/s through the relays against straight to the workers.

Two real workers on loopback and the 183 MB model split between them (the shape of bench/faults.py). The
coordinator (the same child process the controller runs) decodes with its endpoints either the workers
themselves, or a relay per worker (core.rpc.relay on a RelayHost: the uvloop thread the controller runs its relays
on), or the relays while each worker's CPU/memory is sampled on its node as the controller does it (the
sample script every METRICS_INTERVAL_S). Rounds rotate the arms' order; each arm's ratio to direct in the
same round, median over rounds.

    .venv/bin/python bench/relay.py [--rounds 6] [--tokens 256]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from faults import big_model
from sharding import decode_ms, start_worker, stop_workers

from core.controller.fleet import METRICS_INTERVAL_S
from core.nodes.build import cache_dir
from core.nodes.sample import parse_sample, sample_command
from core.rpc.relay import Relay, RelayHost
from tests.harness import free_port


def start_relays(host: RelayHost, targets: list[tuple[str, int]]) -> tuple[list[Relay], list[str]]:
    """Relays on the host's loop (the controller's relay thread), as the controller starts them."""
    relays = [Relay(target, lambda message: print(f"relay: {message}")) for target in targets]
    addresses = [asyncio.run_coroutine_threadsafe(relay.start(), host.loop).result(10) for relay in relays]
    return relays, [f"{address[0]}:{address[1]}" for address in addresses]


def sample_while(on: threading.Event, stop: threading.Event, pids: list[int]) -> None:
    """Sample each worker as the controller does (a shell on its node every METRICS_INTERVAL_S) while ``on``."""
    with tempfile.TemporaryDirectory() as root:
        commands = []
        for index, pid in enumerate(pids):
            folder = Path(root) / str(index)
            folder.mkdir()
            (folder / "worker.pid").write_text(str(pid))
            commands.append(sample_command(str(folder), "cpu"))
        while not stop.wait(METRICS_INTERVAL_S):
            if on.is_set():
                for command in commands:
                    result = subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True, check=False)
                    assert parse_sample(result.stdout) is not None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    model = big_model(cache_dir() / "models" / "bench-8x1024.gguf")
    ports = [free_port(), free_port()]
    workers = [start_worker(port) for port in ports]
    host = RelayHost()
    relays, relayed = start_relays(host, [("127.0.0.1", port) for port in ports])
    direct = [f"127.0.0.1:{port}" for port in ports]
    samples: dict[str, list[float]] = {"direct": [], "relay": [], "observed": []}
    sampling, stop = threading.Event(), threading.Event()
    sampler = threading.Thread(target=sample_while, args=(sampling, stop, [worker.pid for worker in workers]))
    sampler.start()
    try:
        arms = ["direct", "relay", "observed"]
        for round_ in range(args.rounds):
            for label in arms[round_ % 3:] + arms[:round_ % 3]:  # each arm takes each slot in turn
                if label == "observed":
                    sampling.set()
                samples[label].append(decode_ms(model, direct if label == "direct" else relayed, (4, 4), args.tokens))
                sampling.clear()
        stats = [relay.stats for relay in relays]
    finally:
        stop.set()
        sampler.join()
        asyncio.run(host.close(relays))
        stop_workers(workers)
    rate = {label: 1000 / statistics.median(values) for label, values in samples.items()}
    for label, values in samples.items():
        print(f"{label:<8} ms/token {', '.join(f'{value:.2f}' for value in values)}  median "
              f"{statistics.median(values):.2f} ({rate[label]:.1f} tok/s)")
    for index, stat in enumerate(stats):
        print(f"relay {index}: {stat.computes} computes + {stat.recomputes} recomputes, "
              f"{stat.bytes_to / 1e6:.1f} MB to / {stat.bytes_from / 1e6:.2f} MB from the worker, "
              f"compute {stat.compute_ms or 0:.2f} ms (moving avg)")
    # Each round's ratio to direct in that round, then their median: this machine's speed drifts by more than
    # the difference measured, and the arms of one round run within seconds of each other.
    for label, what in (("relay", "relay"), ("observed", "relay + node sampling")):
        paired = statistics.median(direct / ours
                                   for direct, ours in zip(samples["direct"], samples[label], strict=True))
        print(f"decode tokens/s, {what} / direct = {paired:.3f} (paired by round; medians alone "
              f"{rate[label] / rate['direct']:.3f})   (goal >= 0.97)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
