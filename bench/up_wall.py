"""`up` wall time for 1, 2, 4 and 8 ssh nodes on loopback, from a warm build cache.

Every node is a real OpenSSH sshd on 127.0.0.1 with its own worker. Sizes are measured in alternating
rounds (1, 2, 4, 8, 1, 2, …) so that machine noise spreads over all of them; the ratio 8-node/1-node is
the result (close to 1 means the per-node work runs in parallel). On loopback every "node" (its sshd,
shells, probe and worker) shares this machine's CPUs, so the benchmark also reports how busy the CPUs were:
near 100% means the sizes are limited by this machine, not by waiting on one node after another.

    .venv/bin/python bench/up_wall.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.harness import CLI, free_port
from tests.sshd import SshWorld

SIZES = (1, 2, 4, 8)


def inventory(world: SshWorld, root: Path, nodes: int) -> Path:
    lines = ["cluster: bench-up", "context: 256", "defaults:", f"  workdir: {root / 'node-root'}", "nodes:"]
    for index in range(nodes):
        server = world.servers[index]
        lines += [f"  - name: n{index}", "    host: 127.0.0.1", f"    port: {server.port}", "    user: root",
                  f"    identity: {world.identity}", f"    rpc_port: {free_port()}", "    threads: 1"]
    path = root / f"inventory-{nodes}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def cli(world: SshWorld, root: Path, path: Path, *args: str) -> None:
    env = world.env(GGML_CLUSTER_STATE_DIR=str(root / "state"))
    subprocess.run([CLI, "-i", str(path), *args], env=env, check=True, capture_output=True, text=True, timeout=900)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-up-", dir="/tmp"))
    world = SshWorld(root, nodes=max(SIZES))
    try:
        warm = inventory(world, root, max(SIZES))
        cli(world, root, warm, "up")  # deploys the worker once: every later `up` finds it cached
        cli(world, root, warm, "down")
        times: dict[int, list[float]] = {size: [] for size in SIZES}
        busy: dict[int, list[float]] = {size: [] for size in SIZES}
        for _ in range(args.rounds):
            for size in SIZES:
                path = inventory(world, root, size)
                before = cpu_ticks()
                started = time.perf_counter()
                cli(world, root, path, "up")
                times[size].append(time.perf_counter() - started)
                after = cpu_ticks()
                busy[size].append((after[0] - before[0]) / max(1, after[1] - before[1]))
                cli(world, root, path, "down")
        print(f"`up` wall time, ssh nodes on loopback, warm cache, {args.rounds} alternating rounds (median):")
        for size in SIZES:
            print(f"  {size} node(s): {statistics.median(times[size]):6.2f} s   CPU busy "
                  f"{statistics.median(busy[size]):4.0%} of {os.cpu_count()} cores   (runs: "
                  f"{', '.join(f'{value:.2f}' for value in times[size])})")
        ratio = statistics.median(times[8]) / statistics.median(times[1])
        print(f"ratio 8-node/1-node: {ratio:.2f}")
    finally:
        world.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
