"""Speculative decoding (`speculative: ngram`, the default, and with ``--draft-model`` a draft model on the head,
`speculative: {draft_model: PATH}`) against one token per step (`speculative: off`), on the real quantized model,
greedy.

Two real workers on loopback, each behind a proxy that holds every chunk ``--delay-ms`` each way (the `wifi`
profile's 3 ms by default; 0: plain loopback), so each device boundary costs a round trip as on a network. Per
round each arm loads the coordinator (the child process the controller runs) over the same workers and runs both
requests; the arms alternate which goes first. The requests:
- ``copy``: a chat that asks to repeat a paragraph given in the prompt (what drafts from the sequence itself
  serve best: edit this text, repeat it, code that reuses the names it was given);
- ``fresh``: a story, where little repeats.
Reported per arm and request: decode tok/s, drafted and kept tokens, the time spent drafting on the head per
token (a draft model's decodes run there between the cluster's steps), and each speculative arm's ratio to `off`
(paired by round) and whether its text equals `off`'s (greedy, and seeded: it must). ``--temperature T`` samples
(seed 1) instead of greedy: text that seldom repeats itself, so most drafts are rejected, which measures what
speculation costs a request with nothing to copy.

    .venv/bin/python bench/speculative.py [--rounds 3] [--tokens 96] [--delay-ms 3] [--parallel 1]
                                          [--sampling node|coordinator] [--draft-model PATH [--draft-threads 1]
                                          [--draft-p-min 0.75]] [--temperature 0]

``--draft-model real`` drafts with the real model itself (the only small model at hand with its vocabulary): every
greedy draft is kept, at the cost of a whole second copy of the model decoding on the head.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sharding import start_worker, stop_workers

from core.engine.coordinator import CoordinatorConfig
from core.inventory_fields import DRAFT_P_MIN
from tests.delay import DelayProxy
from tests.harness import free_port
from tests.realmodel import real_model

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("off", "ngram")  # and "draft" with --draft-model
PARAGRAPH = ("The lighthouse stood on a narrow spit of rock at the mouth of the harbour. Every evening the keeper "
             "climbed the one hundred and twelve steps, trimmed the wick, polished the great lens and wrote the "
             "weather in a leather book: the wind, the sea, the ships that passed and the hour the light was lit.")
WARM_TOKENS = 24  # each request's untimed run on a newly loaded coordinator
REQUESTS = {
    "copy": [{"role": "user", "content": f"Repeat this paragraph exactly, word for word:\n\n{PARAGRAPH}"}],
    "fresh": [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in "
                                          "a bottle."}],
}


def run_arm(model: Path, endpoints: list[str], arm: str, tokens: int, parallel: int, sampling: str,
            draft: tuple[str, int, float] | None = None, temperature: float = 0.0) -> dict[str, dict[str, object]]:
    """Load the coordinator for ``arm`` (off, ngram, or draft: ``draft``'s model, threads and p_min) and run each
    request (``parallel`` copies at once): per request, decode tok/s (all copies together), the first copy's text,
    the drafted and kept tokens, and the seconds spent drafting. ``temperature`` > 0: seeded sampling (seed 1)."""
    path, threads, p_min = draft if arm == "draft" and draft else (None, 1, DRAFT_P_MIN)
    config = CoordinatorConfig(model=str(model), endpoints=tuple(endpoints), tensor_split=(0.5, 0.5), context=1024,
                               parallel=parallel, chat_format="gemma", sampling=sampling,
                               speculative="draft_model" if path else arm, draft_model=path, draft_threads=threads,
                               draft_p_min=p_min)
    coordinator = subprocess.Popen([sys.executable, "-m", "core.engine.coordinator", config.to_json()],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                   text=True, cwd=ROOT, env={**os.environ, "GGML_NO_BACKTRACE": "1"})
    assert coordinator.stdin is not None and coordinator.stdout is not None
    stdin, stdout = coordinator.stdin, coordinator.stdout
    results: dict[str, dict[str, object]] = {}
    try:
        ready = json.loads(stdout.readline())
        if ready.get("event") != "ready":
            raise RuntimeError(f"coordinator did not load: {ready}")
        rid = 0

        def ask(messages: list[dict[str, str]], max_tokens: int) -> dict[str, object]:
            """``parallel`` copies of one request at once: decode tok/s, the first copy's text, the counts."""
            nonlocal rid
            first_id = rid + 1
            sampled = {"temperature": temperature, "seed": 1} if temperature > 0 else {}
            for _ in range(parallel):
                rid += 1
                stdin.write(json.dumps({"op": "generate", "id": rid, "messages": messages, "max_tokens": max_tokens,
                                        **sampled}) + "\n")
            stdin.flush()
            texts: dict[int, list[str]] = {}
            done, decode_s, generated, drafted, kept, draft_s = 0, 0.0, 0, 0, 0, 0.0
            while done < parallel:
                message = json.loads(stdout.readline())
                if message["event"] == "token":
                    texts.setdefault(message["id"], []).append(message["text"])
                elif message["event"] == "done":
                    done += 1
                    texts.setdefault(message["id"], []).append(message["text"])
                    decode_s = max(decode_s, message["decode_s"])
                    generated += message["completion_tokens"] - 1
                    drafted += message.get("drafted", 0)
                    kept += message.get("accepted", 0)
                    draft_s += message.get("draft_s", 0.0)
                elif message["event"] == "error":
                    raise RuntimeError(message)
            return {"decode": generated / decode_s, "text": "".join(texts[first_id]), "drafted": drafted,
                    "kept": kept, "tokens": generated + parallel, "draft_s": draft_s}

        # Untimed, first: a graph of a shape not seen yet costs the coordinator a build and each node the whole
        # graph (and a few allocation round trips), which a serving cluster pays once, not per request.
        for messages in REQUESTS.values():
            ask(messages, WARM_TOKENS)
        for name, messages in REQUESTS.items():
            results[name] = ask(messages, tokens)
    finally:
        coordinator.stdin.close()
        coordinator.wait(60)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--delay-ms", type=float, default=3.0, help="each way, per chunk, on each worker's link")
    parser.add_argument("--parallel", type=int, default=1, help="copies of each request decoded together")
    parser.add_argument("--sampling", default="node", choices=("node", "coordinator"), help="where tokens are sampled")
    parser.add_argument("--draft-model", help="a GGUF with the real model's vocabulary (real: the real model itself) "
                                              "for a third arm, `speculative: {draft_model: PATH}`")
    parser.add_argument("--draft-threads", type=int, default=1, help="the draft model's CPU threads")
    parser.add_argument("--draft-p-min", type=float, default=DRAFT_P_MIN, help="the draft model's p_min")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy; above: seeded sampling (text that seldom repeats: drafts mostly rejected)")
    args = parser.parse_args()
    model = real_model()
    draft = None
    arms: tuple[str, ...] = ARMS
    if args.draft_model:
        draft = (str(model if args.draft_model == "real" else Path(args.draft_model).resolve()), args.draft_threads,
                 args.draft_p_min)
        arms = (*ARMS, "draft")
    ports = [free_port(), free_port()]
    workers = [start_worker(port) for port in ports]
    runs: dict[str, list[dict[str, dict[str, object]]]] = {arm: [] for arm in arms}
    try:
        with ExitStack() as stack:
            endpoints = list(ports)
            if args.delay_ms:
                proxies = [stack.enter_context(DelayProxy(port, args.delay_ms / 1000)) for port in ports]
                endpoints = [proxy.port for proxy in proxies]
            for round_ in range(args.rounds):
                turn = round_ % len(arms)
                for arm in arms[turn:] + arms[:turn]:
                    runs[arm].append(run_arm(model, [f"127.0.0.1:{port}" for port in endpoints], arm, args.tokens,
                                             args.parallel, args.sampling, draft, args.temperature))
    finally:
        stop_workers(workers)
    how = "greedy" if args.temperature <= 0 else f"temperature {args.temperature:g}, seed 1"
    print(f"model {model.name}, 2 workers on loopback, {args.delay_ms:g} ms each way per chunk, {how}, sampling "
          f"{args.sampling}, up to {args.tokens} tokens, {args.parallel} at once, {args.rounds} rounds"
          + (f"; draft model {Path(draft[0]).name} on the head, {draft[1]} thread(s), p_min {draft[2]:g}"
             if draft else ""))
    for name in REQUESTS:
        for arm in arms:
            rates = [float(run[name]["decode"]) for run in runs[arm]]  # type: ignore[arg-type]
            last = runs[arm][-1][name]
            drafting_ms = 1000 * float(last["draft_s"]) / int(last["tokens"])  # type: ignore[arg-type,call-overload]
            print(f"{name:<6} speculative {arm:<6} decode {statistics.median(rates):6.1f} tok/s "
                  f"({', '.join(f'{rate:.1f}' for rate in rates)})  {last['tokens']} tokens, drafted "
                  f"{last['drafted']}, kept {last['kept']}, drafting {drafting_ms:.2f} ms per token")
        for arm in arms[1:]:
            paired = statistics.median(float(fast[name]["decode"]) / float(slow[name]["decode"])  # type: ignore[arg-type]
                                       for fast, slow in zip(runs[arm], runs["off"], strict=True))
            same = all(fast[name]["text"] == slow[name]["text"] for fast, slow in zip(runs[arm], runs["off"],
                                                                                       strict=True))
            print(f"{name:<6} {arm} / off = {paired:.2f} (paired by round); text "
                  f"{'identical' if same else 'DIFFERENT'}")
            if not same:
                print(f"  off:   {runs['off'][-1][name]['text']!r}\n  {arm}: {runs[arm][-1][name]['text']!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
