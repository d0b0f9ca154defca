"""ggml-cluster against bare llama.cpp, and the model load cold against warm (the workers' tensor cache).

Parity: the same two workers (ggml-rpc-server `-t 1` on two SSH nodes on loopback, real sshd, started by
ggml-cluster) and the same layer split of one model (`--model`: by default the 183 MB 8-layer f16 model made
here; `--model real` is the Gemma 3 270M Q4_K_M of tests/realmodel.py; or any GGUF), driven in one run with the
arms rotating each round by
  - llama-bench, built from the same pinned llama.cpp source as the workers and the coordinator, with
    `--rpc` to the workers while no cluster is up (`down --keep-workers`) and `-ts` the cluster's split:
    decode (tg) and prompt (pp) tokens/s;
  - ggml-cluster with `transport: direct` (`up` adopts the workers; `run`, then `down --keep-workers`);
  - the same with `transport: ssh` (RPC forwarded through the SSH connections, the default);
  - the same llama-bench with no workers: the whole model in one process on one thread (`-t 1`, as each worker
    has), the work the cluster spreads over two. The pipeline runs one node at a time, so a cluster at its best
    matches it; what it loses is the distribution's cost (network, relays) and the workers' build, which leaves
    out llamafile's kernels for batch invariance (core/nodes/build.py): the prompt rate of weights of their types
    (F16, Q8_0, Q5_0, Q4_0: both models here) shows it.
ggml-cluster is measured through `ggml-cluster run --json` (the path the API takes) after an 8-token warm-up
request (llama-bench warms up too): decode tokens/s from the first token to the last as the controller
receives them, prompt tokens/s as the coordinator times the prompt, and time to first token as the
controller sees it (request in to first token out). llama-bench has no time to first token; its equivalent
is derived as prompt/pp + 1/tg.
The split is the `equal` strategy's for the model's layer count, which is llama.cpp's own `-ts 1/1` (the output
layer takes a slot too: 5/3 of 8 layers, 10/8 of 18, the output with the second node); the cluster's placement is
checked against it before the rounds start.

Load: each cluster's coordinator is killed and the controller reloads the model into the same workers, with the
workers' tensor cache emptied first (cold) or kept (warm); the time is the controller's `coordinator-ready`
event. A model with tensors over the cache's threshold (1 MiB in our build, 10 MiB in stock llama.cpp) is used
for this part (4 layers, n_embd 2048: 366 MB). It runs twice: with the nodes on loopback, and with the nodes
across a shaped link (`--link`, 1 Gbit/s each way by default, a common LAN): two network namespaces made for
the run, the head's (controller, coordinator) and the nodes' (sshd, workers), joined by a veth pair whose ends
are rate-limited with `tc tbf`. On loopback the transfer that the cache saves costs little next to the loader's
fixed costs, so the link arm shows what the cache is for. The link arm needs root (it is skipped otherwise, or
with `--link none`). This part always uses its own model, whatever `--model` says: what the cache saves is
tensors over the threshold, which a small real model barely has.

    .venv/bin/python bench/parity.py [--model PATH|real] [--rounds 5] [--tokens 128] [--prompt 64] [--link 1gbit]
    (first run: builds llama-bench from the cached llama.cpp source, ~6 min on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from faults import big_model

from core.errors import InventoryError
from core.model import read_model, write_demo_model
from core.nodes.build import cache_dir, pinned_version, source_tree
from core.planner import NodeCapacity, Plan, plan_equal
from tests.harness import Cluster, free_port
from tests.realmodel import real_model
from tests.sshd import SshWorld

CONTEXT = 1024
ARMS = ("llama-bench", "direct", "ssh", "one process")
# Whole words of the demo vocabulary: one token each (on another model's vocabulary about one each; the prompt's
# length is counted by the cluster and given to llama-bench as it is).
WORDS = "the cluster model layer token worker shard graph compute memory tensor fast slow ready split plan".split()


def model_argument(text: str) -> Path:
    """`--model`: ``real`` for tests/realmodel.py's Gemma 3 270M Q4_K_M (fetched once), else a GGUF file."""
    path = real_model() if text == "real" else Path(text).expanduser()
    try:
        read_model(path)
    except InventoryError as error:
        reason = error.message.removeprefix("model: ")
        raise argparse.ArgumentTypeError(f"{reason} (fix: give a .gguf file, or 'real')") from None
    return path


def equal_split(model: Path, context: int = CONTEXT, nodes: int = 2) -> Plan:
    """The `equal` strategy's plan of ``model`` over ``nodes`` nodes: what the cluster arms run and llama.cpp's own
    benchmarks (llama-bench, llama-batched-bench, llama-server) are given.

    The nodes are on this machine, so memory is no limit here; the cluster checks its own when it plans.
    """
    facts = read_model(model)
    if facts.n_layers < nodes:
        raise SystemExit(f"--model {model}: {facts.n_layers} layer(s), but the arms split the model over {nodes} "
                         f"workers (fix: a model with at least {nodes} layers)")
    return plan_equal(facts, [NodeCapacity(f"n{index}", 1 << 62) for index in range(nodes)], context)


def split_text(plan: Plan) -> str:
    """Each node's layers, e.g. '10/8 (layers 0-9 | 10-17 + output)'."""
    counts = "/".join(str(last - first + 1) for first, last in (layers or (0, -1) for layers in plan.layers))
    ranges = " | ".join(f"{layers[0]}-{layers[1]}" for layers in plan.layers if layers)
    return f"{counts} (layers {ranges} + output)"


def llama_tool(target: str = "llama-bench") -> Path:
    """A llama.cpp tool (llama-bench, llama-server) built from the vendored llama.cpp the workers are built from,
    as shipped (no patches: llama.cpp as its users run it), cached."""
    version = pinned_version()
    build = cache_dir() / "build" / f"bench-llama-{version}"
    binary = build / "bin" / target
    if not binary.exists():
        source = source_tree(version, lambda message, _: print(message))
        print(f"building {target} (once; about 6 minutes on 2 cores, 10 for llama-server)")
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", "-DGGML_RPC=ON",
                        "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF",
                        "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"], check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(build), "--target", target, "--parallel",
                        str(os.cpu_count() or 1)], check=True, stdout=subprocess.DEVNULL)
    return binary


def bench_rates(binary: Path, model: Path, ports: list[int], split: Plan | None, prompt: int,
                tokens: int) -> tuple[float, float]:
    """llama-bench's (decode, prompt) tokens/s over the two workers with the cluster's split, or, with no
    ``split``, in one process on one thread."""
    placement = (["--rpc", ",".join(f"127.0.0.1:{port}" for port in ports), "-ngl", "99", "-sm", "layer", "-ts",
                  "/".join(f"{share:g}" for share in split.tensor_split)] if split else ["-ngl", "0"])
    result = subprocess.run(
        [str(binary), "-m", str(model), *placement, "-t", "1",
         "-p", str(prompt), "-n", str(tokens), "-r", "1", "-o", "json"],
        capture_output=True, text=True, check=True)
    rows = json.loads(result.stdout)
    decode = next(row["avg_ts"] for row in rows if row["n_gen"] > 0)
    fill = next(row["avg_ts"] for row in rows if row["n_prompt"] > 0)
    return float(decode), float(fill)


def cluster_rates(cluster: Cluster, prompt_text: str, tokens: int) -> tuple[float, float, float, int]:
    """ggml-cluster's decode tokens/s, prompt tokens/s, time to first token (s) and prompt length."""
    decode = json.loads(cluster.cli("run", "The cluster", "-n", str(tokens), "--json").stdout)
    if decode["completion_tokens"] < tokens:  # the model's end of text: fewer tokens than llama-bench decodes
        print(f"  note: the decode stopped at {decode['completion_tokens']} of {tokens} tokens (end of text)")
    fill = json.loads(cluster.cli("run", prompt_text, "-n", "1", "--json").stdout)
    # Decode as the controller sees the tokens arrive (first token to last), not only inside the coordinator.
    timings = decode["timings"]
    rate = (decode["completion_tokens"] - 1) / (timings["total_s"] - timings["first_token_s"])
    return (rate, fill["prompt_tokens"] / fill["timings"]["prompt_s"], float(fill["timings"]["first_token_s"]),
            int(fill["prompt_tokens"]))


def ssh_cluster(world: SshWorld, root: Path, model: Path, transport: str, workdir: Path,
                ports: list[int] | None = None) -> Cluster:
    """Two SSH nodes; clusters with the same ``workdir`` and ``ports`` run (and adopt) the same workers."""
    root.mkdir(parents=True, exist_ok=True)
    lines = [[f"host: {server.address}", f"port: {server.port}", "user: root", f"identity: {world.identity}"]
             for server in world.servers]
    return Cluster(root, nodes=2, context=CONTEXT, ssh=lines, base_env=world.env(), strategy="equal",
                   top=[f"model: {model}"], defaults=[f"workdir: {workdir}", f"transport: {transport}"],
                   ports=ports)


def reload_seconds(cluster: Cluster, cold: bool) -> float:
    """Kill the coordinator and time the controller's reload of the model into the same workers."""
    status = cluster.status()
    seen = sum(event["kind"] == "coordinator-ready" for event in status["events"])
    if cold:  # empty the nodes' tensor cache (the folder stays: a worker makes it only when it starts)
        for cached in (Path.home() / ".cache" / "llama.cpp" / "rpc").glob("*"):
            cached.unlink()
    os.kill(status["coordinator"]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        events = [event for event in cluster.status()["events"] if event["kind"] == "coordinator-ready"]
        if len(events) > seen:
            return float(re.search(r"in ([\d.]+)s", events[-1]["message"]).group(1))  # type: ignore[union-attr]
        time.sleep(0.2)
    raise RuntimeError("the coordinator did not come back")


def load_seconds(world: SshWorld, root: Path, model: Path, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Cold and warm reload times of ``model`` into the world's two nodes, per transport."""
    loads: dict[str, dict[str, list[float]]] = {}
    for transport in ("direct", "ssh"):
        place = root / f"load-{transport}"
        loading = ssh_cluster(world, place, model, transport, place / "node root")
        try:
            loading.cli("up")
            loads[transport] = {"cold": [], "warm": []}
            for _ in range(rounds):
                for kind in ("cold", "warm"):
                    loads[transport][kind].append(reload_seconds(loading, cold=kind == "cold"))
        finally:
            loading.cli("down", check=False)
    return loads


class Link:
    """Two network namespaces of this run's own, the head's and the nodes', joined by a veth pair whose two
    ends are shaped to ``rate`` (a tc rate: 1gbit, 100mbit) with a token bucket."""

    HEAD, NODE = "10.77.0.1", "10.77.0.2"

    def __init__(self, rate: str) -> None:
        tag = os.getpid()
        self.head, self.node = f"gcb-head-{tag}", f"gcb-node-{tag}"
        ends = {self.head: f"gcbh{tag}", self.node: f"gcbn{tag}"}
        try:
            for space in ends:
                self._ip("netns", "add", space)
            self._ip("link", "add", ends[self.head], "netns", self.head, "type", "veth", "peer", "name",
                     ends[self.node], "netns", self.node)
            for space, address in ((self.head, self.HEAD), (self.node, self.NODE)):
                self._ip("-n", space, "addr", "add", f"{address}/24", "dev", ends[space])
                self._ip("-n", space, "link", "set", ends[space], "up")
                self._ip("-n", space, "link", "set", "lo", "up")
                # A bucket of 1 MB: at least one timer tick's worth of bytes at 1 Gbit/s, or tbf under-delivers.
                subprocess.run(["tc", "-n", space, "qdisc", "add", "dev", ends[space], "root", "tbf", "rate", rate,
                                "burst", "1mb", "latency", "50ms"], check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError):
            self.close()
            raise

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    def close(self) -> None:
        """Delete both namespaces (the veth pair goes with them)."""
        for space in (self.head, self.node):
            subprocess.run(["ip", "netns", "delete", space], capture_output=True, check=False)


def link_loads(link: Link, rounds: int) -> dict[str, dict[str, list[float]]]:
    """`load_seconds` across the link: this script again, in the head's namespace (see `--loads-from`)."""
    result = subprocess.run(["ip", "netns", "exec", link.head, sys.executable, __file__, "--loads-from", link.node,
                             "--rounds", str(rounds)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"the load arm across the link failed:\n{result.stdout}\n{result.stderr}")
    return json.loads(result.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def print_loads(where: str, model: Path, loads: dict[str, dict[str, list[float]]]) -> None:
    print(f"load of {model.stat().st_size / 1e6:.0f} MB into the same two workers (coordinator reload), {where}:")
    for transport, values in loads.items():
        cold, warm = statistics.median(values["cold"]), statistics.median(values["warm"])
        print(f"  {transport:<6} cold {cold:5.2f} s  warm {warm:5.2f} s  cold/warm {cold / warm:.2f} (goal >= 3)   "
              f"(runs cold {values['cold']}, warm {values['warm']})")


def loads_from(node_space: str, model: Path, rounds: int) -> int:
    """The link arm's inside: nodes whose sshd runs in ``node_space``; prints the loads as JSON."""
    root = Path(tempfile.mkdtemp(prefix="bench-link-", dir="/tmp"))
    world = SshWorld(root / "world", nodes=2, address=Link.NODE, namespace=node_space)
    try:
        print(json.dumps(load_seconds(world, root, model, rounds)))
    finally:
        world.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=model_argument, help="a GGUF, or 'real' (default: the 8-layer f16 model "
                        "made here)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens for the prompt-rate arms")
    parser.add_argument("--link", default="1gbit", help="the shaped link's rate for the load arm, or 'none'")
    parser.add_argument("--loads-from", metavar="NAMESPACE", help=argparse.SUPPRESS)  # the link arm's inside
    args = parser.parse_args()
    load_model = cache_dir() / "models" / "bench-4x2048.gguf"
    if not load_model.exists():
        write_demo_model(load_model, n_layers=4, n_embd=2048, n_ff=5632, n_head=16, n_head_kv=4)
    load_rounds = max(2, args.rounds // 2)
    if args.loads_from:
        return loads_from(args.loads_from, load_model, load_rounds)
    binary = llama_tool()
    model = args.model or big_model(cache_dir() / "models" / "bench-8x1024.gguf")
    split = equal_split(model)
    root = Path(tempfile.mkdtemp(prefix="bench-parity-", dir="/tmp"))
    world = SshWorld(root / "world", nodes=2)
    ports = [free_port(), free_port()]
    clusters = {transport: ssh_cluster(world, root / transport, model, transport, root / "node root", ports)
                for transport in ("direct", "ssh")}
    rates: dict[str, dict[str, list[float]]] = {arm: {"decode": [], "prompt": [], "ttft": []}
                                                 for arm in ARMS}
    linked: dict[str, dict[str, list[float]]] = {}
    try:
        clusters["direct"].cli("up")  # starts the workers every arm uses
        placed = clusters["direct"].status()
        layers = [tuple(node["layers"]) if node["layers"] else None for node in placed["nodes"]]
        if placed["tensor_split"] != list(split.tensor_split) or layers != list(split.layers):
            raise RuntimeError(f"the cluster placed layers {layers} with split {placed['tensor_split']}, not the "
                               f"equal split {list(split.layers)} llama-bench is given")
        prompt_text = " ".join(WORDS[i % len(WORDS)] for i in range(args.prompt - 1))
        prompt_tokens = cluster_rates(clusters["direct"], prompt_text, 1)[3]  # BOS + the words: llama-bench's -p
        clusters["direct"].cli("down", "--keep-workers")
        for round_ in range(args.rounds):
            turn = round_ % len(ARMS)
            for arm in ARMS[turn:] + ARMS[:turn]:
                if arm in ("llama-bench", "one process"):
                    decode, fill = bench_rates(binary, model, ports, split if arm == "llama-bench" else None,
                                               prompt_tokens, args.tokens)
                    ttft = prompt_tokens / fill + 1 / decode
                else:
                    cluster = clusters[arm]
                    cluster.cli("up")
                    cluster.cli("run", "The cluster", "-n", "8")
                    decode, fill, ttft, _ = cluster_rates(cluster, prompt_text, args.tokens)
                    cluster.cli("down", "--keep-workers")
                for key, value in (("decode", decode), ("prompt", fill), ("ttft", ttft)):
                    rates[arm][key].append(value)
        clusters["direct"].cli("down")  # with no controller up, `down` stops the workers it left running
        loads = load_seconds(world, root, load_model, load_rounds)
        if args.link != "none":
            try:
                link = Link(args.link)
            except (OSError, subprocess.CalledProcessError) as error:
                print(f"skipping the load arm across a {args.link} link: no network namespaces here ({error})")
            else:
                try:
                    linked = link_loads(link, load_rounds)
                finally:
                    link.close()
    finally:
        for cluster in clusters.values():
            cluster.cli("down", check=False)
        world.stop()
        shutil.rmtree(root, ignore_errors=True)

    def median(arm: str, key: str) -> float:
        return statistics.median(rates[arm][key])

    def paired(arm: str, key: str, against: str = "llama-bench") -> float:
        # Each round's ratio to ``against`` in that round, then their median: this machine's speed drifts by
        # more than the difference measured, and arms of one round run within a minute of each other.
        return statistics.median(ours / base for ours, base in zip(rates[arm][key], rates[against][key],
                                                                   strict=True))

    print(f"model {model.name} ({model.stat().st_size / 1e6:.0f} MB) split {split_text(split)} over the same "
          f"two -t 1 workers; {args.tokens} decode tokens, {prompt_tokens}-token prompt; {args.rounds} rounds, "
          "arms rotated, medians")
    for arm, values in rates.items():
        print(f"  {arm:<11} decode {median(arm, 'decode'):6.1f} tok/s  prompt {median(arm, 'prompt'):7.1f} tok/s  "
              f"first token {median(arm, 'ttft') * 1000:6.1f} ms   (decode runs: "
              f"{', '.join(f'{value:.1f}' for value in values['decode'])})")
    print("  ratios to llama-bench in the same round, median over rounds:")
    for transport, goal in (("direct", 0.97), ("ssh", 0.90)):
        rounds = ", ".join(f"{ours / bare:.2f}" for ours, bare in zip(rates[transport]["decode"],
                                                                      rates["llama-bench"]["decode"], strict=True))
        print(f"  ggml-cluster {transport:<6} / llama-bench: decode {paired(transport, 'decode'):.3f} (goal >= {goal}; "
              f"rounds {rounds}), prompt {paired(transport, 'prompt'):.3f}, "
              f"first token time {paired(transport, 'ttft'):.2f}x")
    # The transport's own cost, without llama-bench in the ratio.
    print(f"  ggml-cluster ssh    / ggml-cluster direct: decode {paired('ssh', 'decode', 'direct'):.3f}")
    # What the spread costs against the same work in one process (no goal: a floor to watch, see the docstring).
    for arm in ("ssh", "llama-bench"):
        name = f"ggml-cluster {arm}" if arm == "ssh" else "llama-bench --rpc"
        print(f"  {name:<19} / one process: decode {paired(arm, 'decode', 'one process'):.3f}, "
              f"prompt {paired(arm, 'prompt', 'one process'):.3f}")
    print_loads("nodes on loopback", load_model, loads)
    if linked:
        print_loads(f"nodes across a {args.link} link", load_model, linked)
    return 0


if __name__ == "__main__":
    sys.exit(main())
