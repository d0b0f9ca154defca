"""Soak: many requests under the faults users meet, counting what the user would notice.

A cluster of three supervised workers, on loopback SSH nodes (real sshd, `--nodes ssh`, the default) or local
ones, serves ``--requests`` greedy requests one after another over the control socket (as `ggml-cluster run`
does). Every ``--fault-every`` requests one fault, of a kind drawn at random, lands at a random token of the request
in flight:

- ``kill``: `kill -9` of a random worker;
- ``stop``: `SIGSTOP` of a random worker (the watchdog must find it);
- ``drop``: every SSH connection to a random node is cut (a network blip; SSH nodes only);
- ``disconnect``: the client goes away mid-stream (the request is cancelled; the next one must be whole).

Every ``--long-every``-th request carries a ~2,900-token prompt, which takes several watchdog periods to
evaluate. A worker is not faulted again within ``--spacing`` seconds (five exits a minute is a crash loop,
which the supervisor rightly gives up on: a different test).

Each completed text is compared with the same prompt's text from the same cluster before any fault (the
~180 MB random-weights model has f16 near-ties that one process and an RPC split may break differently; the
agreement with one process is printed). Reports requests completed, cancelled, lost (ended in an error) and
corrupted (text or token count differs), whether every request after a cancelled one was whole, the
recoveries, and the time from each fault to the next token the client saw.

    .venv/bin/python bench/soak.py [--requests 200] [--fault-every 5] [--tokens 32] [--nodes ssh|local]
        [--model PATH|real]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from parity import model_argument

from core import client
from core.errors import ClusterError
from core.state import StateDir
from tests.harness import Cluster, big_model
from tests.sshd import SshWorld
from tests.test_cluster import single_process

PROMPTS = ["The cluster", "Once upon a time", "In the beginning", "A worker is", "Tokens flow",
           "The quick brown fox", "Hello", "When the node fails"]
LONG_PROMPT = " ".join(["the cluster runs a model across the nodes and"] * 180)
WORKERS = ("n0", "n1", "n2")
WATCHDOG_S = 5


@dataclass
class Tally:
    completed: int = 0
    cancelled: int = 0
    after_cancel_whole: int = 0
    after_cancel: int = 0
    lost: list[str] = field(default_factory=list)
    corrupted: list[str] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)
    recoveries: int = 0
    resumed_after: dict[str, list[float]] = field(default_factory=dict)  # fault → next token, seconds


@dataclass(frozen=True)
class Fault:
    kind: str
    node: str | None
    at_token: int


async def one_request(state: StateDir, prompt: str, tokens: int, fault: Fault | None,
                      inject: Callable[[Fault], None], tally: Tally) -> dict | str | None:
    """Run one request, injecting ``fault`` after its token ``at_token``: the done event, None when the
    client left on purpose, or why the request was lost."""
    seen = 0
    faulted_at: float | None = None
    try:
        async with contextlib.aclosing(client.run(state, {"prompt": prompt, "max_tokens": tokens})) as events:
            async for event in events:
                if event.get("event") == "done":
                    return event
                if event.get("event") != "token":
                    continue
                seen += 1
                if faulted_at is not None and fault is not None:
                    tally.resumed_after.setdefault(fault.kind, []).append(time.perf_counter() - faulted_at)
                    faulted_at = None
                if fault is not None and seen == fault.at_token:
                    tally.faults[fault.kind] += 1
                    if fault.kind.startswith("disconnect"):
                        return None  # closing the stream closes the connection: the controller cancels
                    inject(fault)
                    faulted_at = time.perf_counter()
    except (ClusterError, ConnectionError, OSError) as exc:
        return str(exc)
    return "the stream ended without a result"


def injector(cluster: Cluster, world: SshWorld | None) -> Callable[[Fault], None]:
    def inject(fault: Fault) -> None:
        assert fault.node is not None
        kind = fault.kind.split()[0]
        if kind == "kill":
            os.kill(cluster.worker_pid(fault.node), signal.SIGKILL)
        elif kind == "stop":
            os.kill(cluster.worker_pid(fault.node), signal.SIGSTOP)
        elif kind == "drop" and world is not None:
            world.servers[WORKERS.index(fault.node)].drop_connections()
    return inject


async def soak(cluster: Cluster, world: SshWorld | None, references: dict[str, dict],
               args: argparse.Namespace) -> Tally:
    state = StateDir(cluster.state)
    rng = random.Random(args.seed)
    kinds = ["kill", "stop", "drop", "disconnect"] if world is not None else ["kill", "stop", "disconnect"]
    tally = Tally()
    last_fault = dict.fromkeys(WORKERS, -1e9)
    due, after_cancel = False, False
    inject = injector(cluster, world)
    for index in range(args.requests):
        long = args.long_every and index % args.long_every == args.long_every - 1
        prompt = LONG_PROMPT if long else PROMPTS[index % len(PROMPTS)]
        due = due or (index % args.fault_every == args.fault_every - 1)
        fault = None
        if due:
            kind = rng.choice(kinds)
            now = time.monotonic()
            eligible = [name for name in WORKERS if now - last_fault[name] >= args.spacing]
            if kind == "disconnect" or eligible:
                node = None if kind == "disconnect" else rng.choice(eligible)
                fault = Fault(f"{kind} ({'long' if long else 'short'} prompt)", node, rng.randint(1, args.tokens - 2))
                if node is not None:
                    last_fault[node] = now
                due = False
        done = await one_request(state, prompt, args.tokens, fault, inject, tally)
        if done is None:
            tally.cancelled += 1
            after_cancel = True
            continue
        whole = False
        if isinstance(done, str):
            tally.lost.append(f"request {index} {prompt[:30]!r}: {done}")
        else:
            tally.recoveries += len(done.get("recoveries") or [])
            expected = references[prompt]
            if done["text"] != expected["text"] or done["completion_tokens"] != expected["tokens"]:
                tally.corrupted.append(f"request {index} {prompt[:30]!r}: got {done['text']!r}, "
                                       f"expected {expected['text']!r}")
            else:
                tally.completed += 1
                whole = True
        if after_cancel:
            tally.after_cancel += 1
            tally.after_cancel_whole += whole
            after_cancel = False
    return tally


async def fault_free(cluster: Cluster, prompt: str, tokens: int) -> dict:
    """The cluster's own text for a prompt, before any fault: the reference for a model with near-ties."""
    done = await one_request(StateDir(cluster.state), prompt, tokens, None, lambda _: None, Tally())
    if not isinstance(done, dict):
        raise SystemExit(f"the fault-free run of {prompt[:30]!r} failed: {done}")
    return {"text": done["text"], "tokens": done["completion_tokens"], "prompt_tokens": done["prompt_tokens"]}


def make_cluster(root: Path, nodes: str, model: Path) -> tuple[Cluster, SshWorld | None]:
    top = [f"model: {model}", f"watchdog: {WATCHDOG_S}"]
    if nodes == "local":
        return Cluster(root, nodes=len(WORKERS), context=4096, top=top), None
    world = SshWorld(root / "world", nodes=len(WORKERS))
    lines = [[f"host: {server.address}", f"port: {server.port}", "user: root", f"identity: {world.identity}"]
             for server in world.servers]
    return Cluster(root, nodes=len(WORKERS), context=4096, top=top, ssh=lines, base_env=world.env(),
                   defaults=[f"workdir: {root / 'nodes'}"]), world


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--fault-every", type=int, default=5, help="a fault every N requests")
    parser.add_argument("--long-every", type=int, default=10, help="every Nth request has a long prompt (0: none)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--nodes", choices=["ssh", "local"], default="ssh")
    parser.add_argument("--spacing", type=float, default=16.0, help="seconds before a worker is faulted again")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--model", type=model_argument, default=None,
                        help="a GGUF, or 'real': the tests' Gemma 3 270M Q4_K_M (default: the synthetic 180 MB model)")
    args = parser.parse_args()
    model = args.model or big_model()
    prompts = [*PROMPTS, LONG_PROMPT] if args.long_every else PROMPTS
    alone = {prompt: single_process(str(model), prompt, args.tokens) for prompt in PROMPTS}
    root = Path(tempfile.mkdtemp(prefix="bench-soak-", dir="/tmp"))
    cluster, world = make_cluster(root, args.nodes, model)
    started = time.monotonic()
    try:
        cluster.cli("up")
        references = {prompt: asyncio.run(fault_free(cluster, prompt, args.tokens)) for prompt in prompts}
        tally = asyncio.run(soak(cluster, world, references, args))
        status = cluster.status()
    finally:
        cluster.cli("down", check=False)
        if world is not None:
            world.stop()
        shutil.rmtree(root, ignore_errors=True)
    elapsed = time.monotonic() - started
    served = args.requests - tally.cancelled
    long = (f"{args.requests // args.long_every} with a {references[LONG_PROMPT]['prompt_tokens']}-token prompt"
            if args.long_every else "no long prompt")
    print(f"soak: {args.requests} requests of {args.tokens} tokens ({long}), "
          f"{model.stat().st_size / 1e6:.0f} MB model, 3 {args.nodes} workers, watchdog {WATCHDOG_S} s, a fault "
          f"every {args.fault_every} requests (same worker at most every {args.spacing:g} s), seed {args.seed}, "
          f"{elapsed:.0f} s")
    print(f"  faults: {', '.join(f'{kind} {count}' for kind, count in sorted(tally.faults.items()))}")
    print(f"  completed {tally.completed}/{served}   lost {len(tally.lost)}   corrupted {len(tally.corrupted)}   "
          f"cancelled by their client {tally.cancelled}   whole after a cancel {tally.after_cancel_whole}/"
          f"{tally.after_cancel}")
    agree = sum(references[prompt]["text"] == alone[prompt]["text"] for prompt in PROMPTS)
    print(f"  (reference: the cluster before any fault; {agree}/{len(PROMPTS)} short prompts' texts equal one "
          "process's)")
    print(f"  recoveries {tally.recoveries} (requests resumed)   worker restarts "
          f"{sum(node['restarts'] for node in status['nodes'])}   coordinator restarts "
          f"{status['coordinator']['restarts']}   nodes failed {sum(node['failures'] > 0 for node in status['nodes'])}")
    for kind, seconds in sorted(tally.resumed_after.items()):
        ordered = sorted(seconds)
        print(f"  {kind} -> next token: median {statistics.median(ordered):.2f} s, "
              f"p95 {ordered[int(0.95 * (len(ordered) - 1))]:.2f} s, max {ordered[-1]:.2f} s ({len(ordered)})")
    for line in [*tally.lost, *tally.corrupted][:10]:
        print(f"  ! {line}")
    sys.exit(1 if tally.lost or tally.corrupted or tally.after_cancel_whole != tally.after_cancel else 0)


if __name__ == "__main__":
    main()
