"""The cluster over a real network (tests.netbed): each node in a network namespace of its own with its own sshd and
a shaped link to the head, where the controller and coordinator run; the real quantized model.

For each link profile (unshaped; lan: 1 Gbit, 0.25 ms each way; wifi: 100 Mbit, 3 ms each way) one bed of
``--nodes`` nodes, and on the same workers (the arms' clusters share the nodes' workdir and ports: each `up` adopts
them, `down --keep-workers` leaves them), alternating which goes first each round:
- ``node``: ggml-cluster over ssh, tokens sampled on the output node (`sampling: node`), `speculative: off`;
- ``coordinator``: the same with `sampling: coordinator` (every logit of every token crosses the link);
- ``ngram``: the defaults, `sampling: node` and `speculative: ngram` (drafts verified in the step), with the
  drafted and kept tokens.
Reported per arm: decode tok/s (first token to last, as `run` sees them), time to first token, bytes per token
from and to each node (the relays' counters in `status`), and `up` (the first one on a bed starts the workers).
With ``--faults``, then, on each bed, with the defaults: a `kill -9` of the worker of the 5th node (or the last,
with fewer) and a cut of that node's SSH connections, each in the middle of a request: the time from the fault to
the next token, and whether the text is the fault-free one.

    .venv/bin/python bench/network.py [--nodes 2] [--profiles unshaped,lan,wifi] [--rounds 2] [--tokens 64]
                                      [--faults]
"""

from __future__ import annotations

import argparse
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

from tests.harness import CLI, Cluster, free_port, pid_in
from tests.netbed import PROFILES, NetBed, available
from tests.realmodel import real_model

# Each arm's inventory lines.
ARMS = {"node": ["sampling: node", "speculative: off"], "coordinator": ["sampling: coordinator", "speculative: off"],
        "ngram": ["sampling: node", "speculative: ngram"]}
NAMES = tuple(ARMS)
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def arm_cluster(bed: NetBed, root: Path, arm: str, nodes: int, ports: list[int], model: Path) -> Cluster:
    (root / arm).mkdir(parents=True, exist_ok=True)
    return Cluster(root / arm, nodes=nodes, ssh=[bed.node_lines(index) for index in range(nodes)],
                   base_env=bed.env(), prefix=bed.prefix, strategy="equal", ports=ports, context=1024,
                   top=[f"model: {model}", *ARMS[arm]], defaults=[f"workdir: {root / 'nodes'}"],
                   api="{port: 0, parallel: 1}")


def measure(cluster: Cluster, tokens: int) -> dict[str, object]:
    """One greedy request: decode tok/s, first token (s), each node's bytes per token each way, and the tokens
    drafted and kept."""
    start = cluster.status()
    result = json.loads(cluster.cli("run", PROMPT, "-n", str(tokens), "--json").stdout)
    end = cluster.status()
    before, after = start["nodes"], end["nodes"]
    timings = result["timings"]
    generated = result["completion_tokens"]
    pairs = list(zip(before, after, strict=True))
    return {"decode": (generated - 1) / (timings["total_s"] - timings["first_token_s"]),
            "first": timings["first_token_s"],
            "from": [(now["bytes_from"] - then["bytes_from"]) / generated for then, now in pairs],
            "to": [(now["bytes_to"] - then["bytes_to"]) / generated for then, now in pairs],
            "drafted": end["tokens_drafted"] - start["tokens_drafted"],
            "kept": end["tokens_accepted"] - start["tokens_accepted"]}


def faulted(cluster: Cluster, fault: object, tokens: int) -> tuple[float | None, str]:
    """A request with ``fault`` (a callable) a second in: (seconds from the fault to the next token, text)."""
    run = subprocess.Popen([*cluster.prefix, CLI, "-i", str(cluster.inventory), "run", PROMPT, "-n", str(tokens),
                            "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cluster.env())
    time.sleep(1.0)
    fault()  # type: ignore[operator]
    stdout, stderr = run.communicate(timeout=600)
    if run.returncode != 0:
        raise RuntimeError(f"the request with a fault failed: {stderr}")
    result = json.loads(stdout)
    recoveries = result["recoveries"]
    return (recoveries[0].get("first_token_after_s") if recoveries else None), result["text"]


def field_faults(bed: NetBed, cluster: Cluster, workdir: Path, tokens: int) -> None:
    """Kill -9 of the 5th node's worker, then a cut of its SSH connections, each mid-request."""
    index = min(4, len(bed.servers) - 1)
    clean = json.loads(cluster.cli("run", PROMPT, "-n", str(tokens), "--json").stdout)["text"]
    pid_file = workdir / f"test{os.getpid()}" / f"n{index}" / "worker.pid"
    for label, fault in (("kill -9 of its worker", lambda: os.kill(pid_in(pid_file), signal.SIGKILL)),
                         ("its SSH connections cut", bed.servers[index].drop_connections)):
        seconds, text = faulted(cluster, fault, tokens)
        after = "no recovery was needed" if seconds is None else f"next token {seconds:.2f} s after the fault"
        print(f"  node {index + 1} of {len(bed.servers)}, {label}: {after}; text "
              f"{'the same as without the fault' if text == clean else 'DIFFERENT from the fault-free text'}")


def run_profile(profile: str, args: argparse.Namespace, model: Path) -> dict[str, list[dict[str, object]]]:
    root = Path(tempfile.mkdtemp(prefix="bench-net-", dir="/tmp"))
    bed = NetBed(root / "bed", args.nodes, profile)
    ports = [free_port() for _ in range(args.nodes)]
    clusters = {arm: arm_cluster(bed, root, arm, args.nodes, ports, model) for arm in ARMS}
    runs: dict[str, list[dict[str, object]]] = {arm: [] for arm in NAMES}
    ups: list[float] = []
    try:
        for round_ in range(args.rounds):
            shift = round_ % len(NAMES)
            for arm in NAMES[shift:] + NAMES[:shift]:
                cluster = clusters[arm]
                started = time.monotonic()
                cluster.cli("up")
                ups.append(time.monotonic() - started)
                cluster.cli("run", "Hello", "-n", "4")  # warm: the first graph of a coordinator
                runs[arm].append(measure(cluster, args.tokens))
                cluster.cli("down", "--keep-workers")
        if args.faults:
            clusters["ngram"].cli("up")
            print(f"{profile}, faults mid-request (the defaults: sampling node, speculative ngram):")
            field_faults(bed, clusters["ngram"], root / "nodes", 4 * args.tokens)
    finally:
        for cluster in clusters.values():
            cluster.cli("down", check=False)
        bed.close()
        shutil.rmtree(root, ignore_errors=True)
    print(f"{profile}: `up` {ups[0]:.1f} s with the workers started, then {statistics.median(ups[1:]):.1f} s "
          f"(coordinator and model load on running workers)" if len(ups) > 1 else f"{profile}: `up` {ups[0]:.1f} s")
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--profiles", default="unshaped,lan,wifi")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--faults", action="store_true", help="then a kill -9 and an SSH cut on each bed")
    args = parser.parse_args()
    reason = available()
    if reason:
        print(f"bench/network.py needs network namespaces: {reason}")
        return 2
    model = real_model()
    results = {profile: run_profile(profile, args, model) for profile in args.profiles.split(",")}
    print(f"\nmodel {model.name}, {args.nodes} ssh nodes, equal split, {args.tokens} tokens, {args.rounds} rounds")
    rates: dict[tuple[str, str], float] = {}
    for profile, runs in results.items():
        shape = PROFILES[profile]
        link = f"{shape.rate or 'unshaped'}, {shape.delay_ms:g} ms each way"
        for arm in NAMES:
            decode = statistics.median(float(run["decode"]) for run in runs[arm])  # type: ignore[arg-type]
            rates[profile, arm] = decode
            first = statistics.median(float(run["first"]) for run in runs[arm])  # type: ignore[arg-type]
            sent = [statistics.median(run["from"][node] for run in runs[arm])  # type: ignore[index]
                    for node in range(args.nodes)]
            received = [statistics.median(run["to"][node] for run in runs[arm])  # type: ignore[index]
                        for node in range(args.nodes)]
            print(f"{profile:<9} ({link:<26}) sampling {arm:<11} decode {decode:6.1f} tok/s  first token "
                  f"{first * 1000:6.0f} ms  B/token from nodes {' / '.join(f'{value:,.0f}' for value in sent)}  "
                  f"to nodes {' / '.join(f'{value:,.0f}' for value in received)}  drafted / kept "
                  f"{runs[arm][-1]['drafted']} / {runs[arm][-1]['kept']}")
        print(f"{profile:<9} node / coordinator = {rates[profile, 'node'] / rates[profile, 'coordinator']:.2f}, "
              f"ngram / node = {rates[profile, 'ngram'] / rates[profile, 'node']:.2f}")
    if "unshaped" in results:
        for profile in results:
            if profile != "unshaped":
                print(f"{profile} / unshaped, sampling node: "
                      f"{rates[profile, 'node'] / rates['unshaped', 'node']:.2f} (goal at 100 Mbit >= 0.8)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
