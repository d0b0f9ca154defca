"""How far live times are from the plan's prediction, request after request, and what the controller does about it.

A fresh two-worker local cluster on a fresh copy of the model (so its nodes are profiled now, on this machine as busy
as it is), speculative decoding off (one token per step); then ``--runs`` greedy requests of ``--tokens`` tokens. After
each: per node holding layers, the plan's predicted share, the live time (median of the latest 64 computes under the
plan) and the drift, with the decode rate; at the end the controller's profile-drift, replan and plan-kept events.

    .venv/bin/python bench/live_plan.py [--model demo|big|real] [--runs 6] [--tokens 64]

``real`` is the Gemma 3 270M Q4_K_M of the tests, whose output layer outweighs each layer 47 to 1.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.model import demo_model
from core.nodes.build import cache_dir
from tests.harness import Cluster, big_model
from tests.realmodel import real_model

EVENTS = ("profile", "plan", "coordinator-ready", "profile-drift", "replan", "plan-kept")


SOURCES = {"demo": lambda: demo_model(cache_dir()), "big": big_model, "real": real_model}


def number(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:.2f}{unit}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=tuple(SOURCES), default="big")
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-live-", dir="/tmp"))
    model = root / "model.gguf"  # a new path: a new profile
    shutil.copy(SOURCES[args.model](), model)
    cluster = Cluster(root, nodes=2, strategy=None, top=[f"model: {model}", "speculative: off"])
    try:
        cluster.cli("up")
        print(f"{'run':>3} {'node':<4} {'predicted':>9} {'live':>6} {'drift':>6} {'tok/s':>6}")
        for run in range(args.runs):
            cluster.cli("run", "Once upon a time", "-n", str(args.tokens))
            status = cluster.status()
            for node in status["nodes"]:
                if node["layers"]:
                    drift = None if node["drift"] is None else node["drift"] * 100
                    print(f"{run:>3} {node['name']:<4} {number(node['predicted_ms']):>9} "
                          f"{number(node['live_ms']):>6} {number(drift, '%'):>6} "
                          f"{number(status['decode_tokens_per_s']):>6}")
        for event in status["events"]:
            if event["kind"] in EVENTS:
                print(f"{event['kind']}{' ' + event['node'] if event['node'] else ''}: {event['message']}")
    finally:
        cluster.cli("down", check=False)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
