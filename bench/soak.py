"""Soak: many requests while workers are killed, counting what the user would notice.

A local cluster of three supervised workers serves ``--requests`` greedy requests, one after another, over
the control socket (as `ggml-cluster run` does). Every ``--kill-every`` requests a random worker gets
`kill -9` at a random token of the request in flight. A worker is not killed again within ``--spacing``
seconds: five exits a minute is a crash loop, which the supervisor rightly gives up on, and that is a
different test. Each completed text is compared with the same prompt's text from llama-cpp-python in one
process (no RPC, no faults) with the demo model; with the ~180 MB random-weights model, whose f16 logits have
near-ties that one process and an RPC split may break differently, with the same cluster's text before
the first fault (and the agreement with one process is printed).

Reports requests completed, lost (ended in an error) and corrupted (text or token count differs), the
recoveries, and the time from each kill to the next token the client saw. The model is bench/faults.py's
~180 MB one (a token takes tens of ms, so 200 requests last long enough for a kill every 5 requests within
that spacing), or the tiny demo model with ``--model demo``.

    .venv/bin/python bench/soak.py [--requests 200] [--kill-every 5] [--tokens 32] [--spacing 16] [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.faults import big_model
from core import client
from core.build import cache_dir
from core.errors import ClusterError
from core.model import demo_model
from core.state import StateDir
from tests.harness import Cluster
from tests.test_cluster import single_process

PROMPTS = ["The cluster", "Once upon a time", "In the beginning", "A worker is", "Tokens flow",
           "The quick brown fox", "Hello", "When the node fails"]
WORKERS = ("n0", "n1", "n2")


@dataclass
class Tally:
    completed: int = 0
    lost: list[str] = field(default_factory=list)
    corrupted: list[str] = field(default_factory=list)
    kills: int = 0
    recoveries: int = 0
    resumed_after: list[float] = field(default_factory=list)  # kill → next token, seconds


async def one_request(state: StateDir, cluster: Cluster, prompt: str, tokens: int, kill_at: int | None,
                      victim: str | None, tally: Tally) -> dict | str:
    """Run one request, killing ``victim`` after token ``kill_at``: its done event, or why it was lost."""
    seen = 0
    killed_at: float | None = None
    try:
        async for event in client.run(state, {"prompt": prompt, "max_tokens": tokens}):
            kind = event.get("event")
            if kind == "token":
                seen += 1
                if killed_at is not None:
                    tally.resumed_after.append(time.perf_counter() - killed_at)
                    killed_at = None
                if victim is not None and seen == kill_at:
                    os.kill(cluster.worker_pid(victim), signal.SIGKILL)
                    killed_at = time.perf_counter()
                    tally.kills += 1
            elif kind == "error":
                return str(event.get("message"))
            elif kind == "done":
                return event
    except (ClusterError, ConnectionError, OSError) as exc:
        return str(exc)
    return "the stream ended without a result"


async def soak(cluster: Cluster, references: dict[str, dict], args: argparse.Namespace) -> Tally:
    state = StateDir(cluster.state)
    rng = random.Random(args.seed)
    tally = Tally()
    last_kill = dict.fromkeys(WORKERS, -1e9)
    due = False
    for index in range(args.requests):
        prompt = PROMPTS[index % len(PROMPTS)]
        due = due or (index % args.kill_every == args.kill_every - 1)
        now = time.monotonic()
        eligible = [name for name in WORKERS if now - last_kill[name] >= args.spacing]
        victim = rng.choice(eligible) if due and eligible else None
        kill_at = rng.randint(1, args.tokens - 2) if victim else None
        if victim:
            last_kill[victim] = now
            due = False
        done = await one_request(state, cluster, prompt, args.tokens, kill_at, victim, tally)
        if isinstance(done, str):
            tally.lost.append(f"request {index} {prompt!r}: {done}")
            continue
        tally.recoveries += len(done.get("recoveries") or [])
        expected = references[prompt]
        if done["text"] != expected["text"] or done["completion_tokens"] != expected["tokens"]:
            tally.corrupted.append(f"request {index} {prompt!r}: got {done['text']!r}, expected {expected['text']!r}")
        else:
            tally.completed += 1
    return tally


async def fault_free(cluster: Cluster, prompt: str, tokens: int) -> dict:
    """The cluster's own text for a prompt, before any fault: the reference for a model with near-ties."""
    done = await one_request(StateDir(cluster.state), cluster, prompt, tokens, None, None, Tally())
    if isinstance(done, str):
        raise SystemExit(f"the fault-free run of {prompt!r} failed: {done}")
    return {"text": done["text"], "tokens": done["completion_tokens"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--kill-every", type=int, default=5, help="kill a worker every N requests")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--model", choices=["big", "demo"], default="big")
    parser.add_argument("--spacing", type=float, default=16.0, help="seconds before a worker is killed again")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    model = demo_model(cache_dir()) if args.model == "demo" else \
        big_model(cache_dir() / "models" / "bench-8x1024.gguf")
    alone = {prompt: single_process(str(model), prompt, args.tokens) for prompt in PROMPTS}
    root = Path(tempfile.mkdtemp(prefix="bench-soak-", dir="/tmp"))
    cluster = Cluster(root, nodes=len(WORKERS), top=[f"model: {model}", "watchdog: 10"])
    started = time.monotonic()
    try:
        cluster.cli("up")
        references = alone if args.model == "demo" else {prompt: asyncio.run(fault_free(cluster, prompt, args.tokens))
                                                         for prompt in PROMPTS}
        tally = asyncio.run(soak(cluster, references, args))
        status = cluster.status()
    finally:
        cluster.cli("down", check=False)
        shutil.rmtree(root, ignore_errors=True)
    elapsed = time.monotonic() - started
    print(f"soak: {args.requests} requests of {args.tokens} tokens, {model.stat().st_size / 1e6:.0f} MB model, "
          f"3 local workers, a kill -9 every "
          f"{args.kill_every} requests (same worker at most every {args.spacing:g} s), seed {args.seed}, "
          f"{elapsed:.0f} s")
    print(f"  completed {tally.completed}/{args.requests}   lost {len(tally.lost)}   corrupted {len(tally.corrupted)}"
          f"   (reference: {'one process' if args.model == 'demo' else 'the cluster before any fault'}; "
          f"{sum(references[p]['text'] == alone[p]['text'] for p in PROMPTS)}/{len(PROMPTS)} prompts' texts "
          "equal one process's)")
    print(f"  worker kills {tally.kills}   recoveries {tally.recoveries} (requests resumed)   "
          f"worker restarts {sum(node['restarts'] for node in status['nodes'])}   "
          f"nodes failed {sum(node['state'] == 'failed' for node in status['nodes'])}")
    if tally.resumed_after:
        ordered = sorted(tally.resumed_after)
        print(f"  kill -> next token: median {statistics.median(ordered):.2f} s, "
              f"p95 {ordered[int(0.95 * (len(ordered) - 1))]:.2f} s, max {ordered[-1]:.2f} s")
    for line in [*tally.lost, *tally.corrupted][:10]:
        print(f"  ! {line}")
    sys.exit(1 if tally.lost or tally.corrupted else 0)


if __name__ == "__main__":
    main()
