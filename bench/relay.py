"""What the observing relay costs: decode tokens/s through it against straight to the workers.

Two real workers on loopback and the 183 MB model split between them (the shape of bench/faults.py). The
coordinator (the same child process the controller runs) decodes with its endpoints either the workers
themselves or a relay per worker (core.relay on a RelayHost: the uvloop thread the controller runs its relays
on). Alternating rounds; medians; the ratio relay/direct.

    .venv/bin/python bench/relay.py [--rounds 5] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from faults import big_model
from sharding import decode_ms, start_worker

from core.build import cache_dir
from core.relay import Relay, RelayHost
from tests.harness import free_port


def start_relays(host: RelayHost, targets: list[tuple[str, int]]) -> tuple[list[Relay], list[str]]:
    """Relays on the host's loop (the controller's relay thread), as the controller starts them."""
    relays = [Relay(target, lambda message: print(f"relay: {message}")) for target in targets]
    addresses = [asyncio.run_coroutine_threadsafe(relay.start(), host.loop).result(10) for relay in relays]
    return relays, [f"{address[0]}:{address[1]}" for address in addresses]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    model = big_model(cache_dir() / "models" / "bench-8x1024.gguf")
    ports = [free_port(), free_port()]
    workers = [start_worker(port) for port in ports]
    host = RelayHost()
    relays, relayed = start_relays(host, [("127.0.0.1", port) for port in ports])
    direct = [f"127.0.0.1:{port}" for port in ports]
    samples: dict[str, list[float]] = {"direct": [], "relay": []}
    try:
        for _ in range(args.rounds):
            samples["direct"].append(decode_ms(model, direct, (4, 4), args.tokens))
            samples["relay"].append(decode_ms(model, relayed, (4, 4), args.tokens))
        stats = [relay.stats for relay in relays]
    finally:
        asyncio.run(host.close(relays))
        for worker in workers:
            worker.kill()
            worker.wait()
    rate = {label: 1000 / statistics.median(values) for label, values in samples.items()}
    for label, values in samples.items():
        print(f"{label:<7} ms/token {', '.join(f'{value:.2f}' for value in values)}  median "
              f"{statistics.median(values):.2f} ({rate[label]:.1f} tok/s)")
    for index, stat in enumerate(stats):
        print(f"relay {index}: {stat.computes} computes + {stat.recomputes} recomputes, "
              f"{stat.bytes_to / 1e6:.1f} MB to / {stat.bytes_from / 1e6:.2f} MB from the worker, "
              f"compute {stat.compute_ms or 0:.2f} ms (moving avg)")
    print(f"decode tokens/s, relay / direct = {rate['relay'] / rate['direct']:.3f}   (goal >= 0.97)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
