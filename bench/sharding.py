"""Compute-aware sharding against llama.cpp's memory-proportional split, on a heterogeneous cluster made real here.

Skewed cluster, three real ggml-rpc-server workers on loopback:
- fast: one thread, but little memory (its cap holds 5 of the 8 layers);
- slow: one thread of the same worker built for a CPU without SIMD extensions (no AVX, FMA or F16C),
  about ten times slower per layer, with the most memory: the ARM board with 32 GB;
- far: one thread behind a proxy that delays every chunk each way: a node across a slow link.
Memory caps are what the inventory's `memory:` field gives the planner.

For each plan the coordinator (the same child process the controller runs) loads the model on the nodes
that hold layers and decodes; tokens/s is measured by the coordinator itself. Plans: memory-proportional,
equal, compute (ours: the nodes measured by core.engine.profile exactly as `up` does, then the DP), and the best
of every contiguous split that fits (brute force). The top brute-force splits and the compute plan are then
re-measured in alternating rounds, so the ratio compares numbers taken side by side. Then an
identical-workers control (three plain workers, equal memory): compute against memory.
Predicted ms/token (from the profiles) is printed next to each measured plan.

    .venv/bin/python bench/sharding.py [--tokens 64] [--rounds 5] [--delay-ms 4]

(A CPU quota was tried for the slow node and dropped: under a light load a throttled worker runs at full
speed between refills, so its cost per layer depends on how busy it is, which no per-layer profile captures.)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from faults import big_model

from core.engine.coordinator import CoordinatorConfig
from core.engine.profile import ProfileCache, Target, measure, profile_key
from core.engine.timing import WARMUP_TOKENS
from core.model import ModelFacts, read_model
from core.nodes.build import BASE_FLAGS, cache_dir, pinned_version, worker_binary, worker_source
from core.nodes.patches import flavour
from core.planner import (
    NodeCapacity,
    NodeSpeed,
    Plan,
    device_bytes,
    plan_compute,
    plan_equal,
    plan_memory,
    predict_seconds,
    split_for_counts,
)
from tests.delay import DelayProxy
from tests.harness import free_port, listening

CONTEXT = 512
PROMPT = "The cluster"
MIB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent


def baseline_worker() -> Path:
    """The same ggml-rpc-server built for a CPU without SIMD extensions (no AVX, FMA, F16C): the slow node.

    A real slower machine, uniformly slower per layer; built once (about a minute) and cached.
    """
    version = pinned_version()
    build = cache_dir() / "build" / f"bench-baseline-{version}-{flavour()}"  # the patches, as every build
    binary = build / "ggml-rpc-server"
    if binary.is_file():
        return binary
    print("building the baseline (no-SIMD) worker for the slow node, once …", flush=True)
    project = worker_source(version, lambda _message, _fraction: None)
    flags = [f"-DGGML_{flag}=OFF" for flag in ("NATIVE", "AVX", "AVX2", "AVX512", "FMA", "F16C", "SSE42", "BMI2")]
    subprocess.run(["cmake", "-S", str(project), "-B", str(build), *generator(), *BASE_FLAGS, *flags],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "--target", "ggml-rpc-server", "--parallel",
                    str(os.cpu_count() or 1)], check=True, stdout=subprocess.DEVNULL)
    return binary


def generator() -> list[str]:
    return ["-G", "Ninja"] if shutil.which("ninja") else []


def start_worker(port: int, binary: Path | None = None) -> subprocess.Popen[bytes]:
    """A ggml-rpc-server (this machine's build unless ``binary``), one thread, on loopback."""
    command = [str(binary or worker_binary("cpu").path), "-H", "127.0.0.1", "-p", str(port), "-t", "1"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not listening(port):
        time.sleep(0.05)
    return process


def stop_workers(workers: Sequence[subprocess.Popen[bytes]]) -> None:
    """Kill the workers ``start_worker`` started, and wait for each to go."""
    for worker in workers:
        worker.kill()
        worker.wait()


def decode_ms(model: Path, endpoints: Sequence[str], counts: Sequence[int], tokens: int) -> float:
    """Measured ms/token of decode with ``counts`` layers per endpoint (only the nodes that hold layers)."""
    used = [(endpoint, count) for endpoint, count in zip(endpoints, counts, strict=True) if count]
    config = CoordinatorConfig(model=str(model), endpoints=tuple(endpoint for endpoint, _ in used),
                               tensor_split=split_for_counts([count for _, count in used]), context=CONTEXT)
    coordinator = subprocess.Popen([sys.executable, "-m", "core.engine.coordinator", config.to_json()],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                   text=True, cwd=ROOT, env={**os.environ, "GGML_NO_BACKTRACE": "1"})
    assert coordinator.stdin is not None and coordinator.stdout is not None
    try:
        ready = json.loads(coordinator.stdout.readline())
        if ready.get("event") != "ready":
            raise RuntimeError(f"coordinator did not load: {ready}")
        coordinator.stdin.write(json.dumps({"op": "generate", "id": 1, "prompt": PROMPT, "max_tokens": tokens}) + "\n")
        coordinator.stdin.flush()
        arrivals = []
        while json.loads(coordinator.stdout.readline())["event"] != "done":
            arrivals.append(time.perf_counter())
        coordinator.stdin.write('{"op": "shutdown"}\n')
        coordinator.stdin.close()
        coordinator.wait(timeout=30)
        # Steady-state decode: the first steps after the prompt batch allocate (the profiler skips them too).
        steady = arrivals[WARMUP_TOKENS:]
        return 1000 * (steady[-1] - steady[0]) / (len(steady) - 1)
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
            coordinator.wait()


def counts_of(plan: Plan) -> tuple[int, ...]:
    return tuple(layers[1] - layers[0] + 1 if layers else 0 for layers in plan.layers)


def predicted_ms(model: ModelFacts, counts: Sequence[int], speeds: Sequence[NodeSpeed], overhead_s: float,
                 names: Sequence[str]) -> float:
    plan = Plan(nodes=tuple(names), tensor_split=split_for_counts(counts), layers=tuple(
        (sum(counts[:i]), sum(counts[:i]) + count - 1) if count else None for i, count in enumerate(counts)),
        bytes_needed=(0,) * len(counts), strategy="")
    return 1000 * (overhead_s + sum(predict_seconds(plan, speeds, model)))


def feasible_splits(model: ModelFacts, capacities: Sequence[NodeCapacity]) -> list[tuple[int, ...]]:
    """Every contiguous split (counts per node, in node order) whose memory fits."""
    splits = []
    for counts in itertools.product(range(model.n_layers + 1), repeat=len(capacities)):
        if sum(counts) != model.n_layers:
            continue
        last = max(i for i, count in enumerate(counts) if count)
        start, fits = 0, True
        for i, count in enumerate(counts):
            layers = (start, start + count - 1) if count else None
            fits &= device_bytes(model, layers, CONTEXT, output=i == last) <= capacities[i].usable
            start += count
        if fits:
            splits.append(counts)
    return splits


async def profile_nodes(cluster: Cluster) -> tuple[list[NodeSpeed], float, float]:
    """The nodes measured exactly as the controller does; returns speeds, coordinator share, seconds spent."""
    targets = [Target(name, endpoint, profile_key([name, endpoint], "bench"), capacity.usable)
               for name, endpoint, capacity in zip(cluster.names, cluster.endpoints, cluster.capacities, strict=True)]
    started = time.monotonic()
    profiles = await measure(cluster.model, targets, ProfileCache(cluster.cache), "bench-overhead",
                             cluster.cache / "profile.log", refresh=True)
    return profiles.speeds(cluster.model, cluster.names), profiles.overhead_s, time.monotonic() - started


def show(label: str, counts: Sequence[int], measured: float, predicted: float) -> None:
    error = (predicted - measured) / measured
    print(f"  {label:<22} layers {tuple(counts)!s:<14} measured {measured:6.2f} ms/token "
          f"({1000 / measured:6.1f} tok/s)  predicted {predicted:6.2f}  error {error:+.0%}", flush=True)


@dataclass(frozen=True)
class Cluster:
    """The nodes under test, as the planner and the profiler see them."""

    model_path: Path
    model: ModelFacts
    names: list[str]
    endpoints: list[str]
    capacities: list[NodeCapacity]
    cache: Path


def alternate(cluster: Cluster, candidates: dict[str, tuple[int, ...]], rounds: int, tokens: int
              ) -> tuple[dict[str, float], dict[str, float]]:
    """Median measured and predicted ms/token of each candidate over ``rounds`` alternating rounds.

    The nodes are profiled again at the start of every round, so each prediction is made next to the
    measurement it is compared with (this shared machine drifts over minutes).
    """
    splits = list(dict.fromkeys(candidates.values()))  # a plan two candidates share is measured once
    measured: dict[tuple[int, ...], list[float]] = {counts: [] for counts in splits}
    predicted: dict[tuple[int, ...], list[float]] = {counts: [] for counts in splits}
    for _ in range(rounds):
        speeds, overhead, _ = asyncio.run(profile_nodes(cluster))
        for counts in splits:
            measured[counts].append(decode_ms(cluster.model_path, cluster.endpoints, counts, tokens))
            predicted[counts].append(predicted_ms(cluster.model, counts, speeds, overhead, cluster.names))
    return ({label: statistics.median(measured[counts]) for label, counts in candidates.items()},
            {label: statistics.median(predicted[counts]) for label, counts in candidates.items()})


def compare(cluster: Cluster, candidates: dict[str, tuple[int, ...]], args: argparse.Namespace) -> dict[str, float]:
    """Measure the candidates side by side and print measured against predicted."""
    print(f"side by side, {args.rounds} alternating rounds (nodes profiled again before each), median:")
    measured, predicted = alternate(cluster, candidates, args.rounds, args.tokens)
    for label, counts in candidates.items():
        show(label, counts, measured[label], predicted[label])
    return measured


def skewed(args: argparse.Namespace, model_path: Path, model: ModelFacts, cache: Path) -> dict[str, float]:
    names = ["fast", "slow", "far"]
    layer = model.layer_bytes[0] + model.kv_bytes(CONTEXT)
    caps = [64 * MIB + device_bytes(model, (0, 4), CONTEXT, output=True) + layer // 2, 24 << 30, 8 << 30]
    ports = [free_port() for _ in names]
    workers = [start_worker(ports[0]), start_worker(ports[1], baseline_worker()), start_worker(ports[2])]
    try:
        with DelayProxy(ports[2], args.delay_ms / 1000) as proxy:
            endpoints = [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}", f"127.0.0.1:{proxy.port}"]
            free = 64 << 30  # every worker here reports this machine's RAM; the caps make them differ
            capacities = [NodeCapacity(name, free, cap) for name, cap in zip(names, caps, strict=True)]
            cluster = Cluster(model_path, model, names, endpoints, capacities, cache)
            speeds, overhead, spent = asyncio.run(profile_nodes(cluster))
            print(f"skewed cluster: fast (cap {caps[0] / MIB:.0f} MiB), slow (no-SIMD build, cap 24 GiB), "
                  f"far ({args.delay_ms:g} ms each way); profiled in {spent:.1f}s, as `up` does:")
            for name, speed in zip(names, speeds, strict=True):
                print(f"  {name:<5} fixed {speed.fixed_s * 1000:6.2f} ms  per layer {speed.per_layer_s * 1000:6.2f} ms"
                      f"  output {speed.output_s * 1000:5.2f} ms")
            print(f"  coordinator {overhead * 1000:.2f} ms/token")
            plans = {
                "memory (llama.cpp)": counts_of(plan_memory(model, capacities, CONTEXT)),
                "equal": counts_of(plan_equal(model, capacities, CONTEXT)),
                "compute (ours)": counts_of(plan_compute(model, capacities, speeds, CONTEXT)),
            }
            splits = feasible_splits(model, capacities)
            print(f"brute force: {len(splits)} contiguous splits fit; measuring each once ({args.tokens} tokens)")
            once = {counts: decode_ms(model_path, endpoints, counts, args.tokens) for counts in splits}
            top = sorted(once, key=once.__getitem__)[:3]
            print("  best three: " + ", ".join(f"{counts} {once[counts]:.2f} ms" for counts in top))
            candidates = {**plans, **{f"brute force #{rank + 1}": counts for rank, counts in enumerate(top)}}
            result = compare(cluster, candidates, args)
            result["brute force best"] = min(value for label, value in result.items() if label.startswith("brute"))
            return result
    finally:
        stop_workers(workers)


def identical(args: argparse.Namespace, model_path: Path, model: ModelFacts, cache: Path) -> dict[str, float]:
    names = ["a", "b", "c"]
    ports = [free_port() for _ in names]
    workers = [start_worker(port) for port in ports]
    try:
        endpoints = [f"127.0.0.1:{port}" for port in ports]
        capacities = [NodeCapacity(name, 64 << 30, 8 << 30) for name in names]
        cluster = Cluster(model_path, model, names, endpoints, capacities, cache)
        speeds, _, spent = asyncio.run(profile_nodes(cluster))
        print(f"identical workers (control), profiled in {spent:.1f}s")
        return compare(cluster, {"memory (llama.cpp)": counts_of(plan_memory(model, capacities, CONTEXT)),
                                 "compute (ours)": counts_of(plan_compute(model, capacities, speeds, CONTEXT))}, args)
    finally:
        stop_workers(workers)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64, help="decoded per measurement (the first 4 not timed)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--delay-ms", type=float, default=4.0, help="one-way delay of the far worker's link")
    args = parser.parse_args()
    model_path = big_model(cache_dir() / "models" / "bench-8x1024.gguf")
    model = read_model(model_path)
    with tempfile.TemporaryDirectory(prefix="ggml-bench-") as folder:
        cache = Path(folder)
        skew = skewed(args, model_path, model, cache)
        control = identical(args, model_path, model, cache)
    print("ratios (tokens/s, from the side-by-side medians above):")
    print(f"  skewed: compute / memory      = {skew['memory (llama.cpp)'] / skew['compute (ours)']:.2f}   (goal >= 2)")
    print(f"  skewed: compute / brute best  = {skew['brute force best'] / skew['compute (ours)']:.2f}   (goal >= 0.90)")
    print(f"  skewed: compute / equal       = {skew['equal'] / skew['compute (ours)']:.2f}")
    print(f"  identical: compute / memory   = {control['memory (llama.cpp)'] / control['compute (ours)']:.2f}"
          "   (goal >= 0.97)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
