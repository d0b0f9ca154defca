"""Whether the workers re-run the graph they hold (GRAPH_RECOMPUTE) or are sent it whole (GRAPH_COMPUTE), serving
and profiling: on a slow link every whole graph sent is time on the wire.

A one-node local cluster on the real model, speculative decoding off: the relay's counters around ``--tokens``
served tokens, then around `profile` (its bytes include the reload's).

    .venv/bin/python bench/graph_reuse.py [--tokens 64]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.harness import Cluster
from tests.realmodel import real_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-graph-", dir="/tmp"))
    cluster = Cluster(root, nodes=1, strategy=None, top=[f"model: {real_model()}", "speculative: off"])

    def counters() -> tuple[int, int, int]:
        node = cluster.status()["nodes"][0]
        return node["computes"], node["recomputes"], node["bytes_to"]

    def report(what: str, before: tuple[int, int, int], after: tuple[int, int, int]) -> None:
        computes, recomputes, sent = (late - early for early, late in zip(before, after, strict=True))
        print(f"{what:<24} GRAPH_COMPUTE {computes:>5}  GRAPH_RECOMPUTE {recomputes:>5}  bytes to the node {sent:,}")

    try:
        cluster.cli("up")
        start = counters()
        cluster.cli("run", "Once upon a time", "-n", str(args.tokens))
        served = counters()
        report(f"serving {args.tokens} tokens", start, served)
        cluster.cli("profile")
        report("profile (and reload)", served, counters())
    finally:
        cluster.cli("down", check=False)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
