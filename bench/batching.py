"""Serving many clients at once: aggregate decode tokens/s of ggml-cluster against llama.cpp's own batching.

One run, on one pair of workers (ggml-rpc-server `-t 1`, two local nodes started by ggml-cluster and kept
running between arms by `down --keep-workers`), one model (`--model`: by default the ~180 MB 8-layer f16
model of tests.harness.big_model, where a token takes ~8 ms; `--model real` is the Gemma 3 270M Q4_K_M of
tests/realmodel.py; or any GGUF) and one layer split (the `equal` strategy's, which the cluster is checked
to have placed), for N = 1, 2, 4, 8 concurrent clients, the two arms alternating per N:
  - ggml-cluster: `up` (with `api: {parallel: N}` where the inventory knows that field), one warm-up
    request, then N clients (aiohttp, one event loop) each streaming one greedy completion of `--tokens`
    tokens of its own prompt through the OpenAI API, all sent at once, with `ignore_eos`; `down --keep-workers`;
  - llama-batched-bench, built from the same patched llama.cpp source as the workers and the coordinator,
    with `--rpc` to the same workers, the same split (`-ts`), context, batch sizes, threads and flash
    attention as the coordinator, `-npl N` sequences of a prompt as long as the clients' (`-npp`) and
    `--tokens` tokens each (`-ntg`).
Aggregate decode tokens/s, ours: every token but each client's first (which the prompt's evaluation
produces, as batched-bench's prompt pass does) divided by the time from the first token any client
received to the last token of all; tokens a client did not get (an early end of text) are not counted.
The prompt's time is reported on its own: from sending the requests to the first token of any client, and
each client's time to its first token (median). Batched-bench's is S_TG t/s (its T_PP s on its own).
Then per N: ours, batched-bench, ours/ours@1, batched-bench's own scaling (its rate over its rate at the
fewest clients: what batching can give on this machine at all), ours/batched-bench, and issue 22's goals
at 4 clients (ours >= 2.5x ours@1, >= 0.9x batched-bench). With `--rounds R` each round runs every N (the
arm that goes first alternates by round) and medians are reported; ratios are taken within a round (the
two arms of one N run within a minute of each other) and their median reported, as this machine's speed
drifts by more than some of the differences.

    .venv/bin/python bench/batching.py [--model PATH|real] [--rounds 3] [--tokens 128] [--clients 1,2,4,8]
    (first run: builds llama-batched-bench from the patched llama.cpp source, about 6 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from parity import WORDS, equal_split, model_argument, split_text

from core.errors import InventoryError
from core.inventory import parse_inventory
from core.nodes.build import cache_dir, pinned_version, source_tree
from core.nodes.patches import apply_patches, flavour
from core.planner import Plan
from tests.harness import Cluster, big_model, free_port

BATCHED_BENCH = "llama-batched-bench"
CONTEXT = 2048
# llama-cpp-python's default n_batch and n_ubatch, which the coordinator keeps: batched-bench gets the same.
BATCH = 512
# The Cluster harness writes this line; the N-client round adds `parallel: N` to it.
API_LINE = "api: {port: 0}"
# llama-server's field for decoding past the end-of-text token; an API that refuses it (a 400 naming it) is
# asked again without it, and in any case only the tokens a client received are counted.
IGNORE_EOS = "ignore_eos"
LOST_ROW_RETRIES = 3


def patched_tree(version: str) -> Path:
    """A full copy of the vendored llama.cpp with our patches applied, made once per (version, patches' digest).

    The workers build only ggml from a cut of the tree and the coordinator's wheel is patched at `make setup`;
    batched-bench needs llama and common too, so it gets a whole patched tree of its own. A changed patch
    changes the digest in the name, so a tree patched otherwise is never reused.
    """
    root = cache_dir() / "src"
    tree = root / f"llama.cpp-{version}-{flavour()}"
    if (tree / "CMakeLists.txt").is_file():
        return tree
    source = source_tree(version, lambda message, _: print(message))
    # Filled under another name and renamed when whole: an interrupted copy or a failed patch is never used.
    scratch = Path(tempfile.mkdtemp(prefix=".patched-", dir=root))
    try:
        # Without the sdist's `.git` file: it points at llama-cpp-python's repository, which is not there, and
        # git apply would follow it and fail.
        shutil.copytree(source, scratch, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".git"))
        apply_patches(scratch, version)
        scratch.replace(tree)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return tree


def batched_bench() -> Path:
    """llama-batched-bench built (once, cached by version and patches' digest) from the patched tree."""
    version = pinned_version()
    build = cache_dir() / "build" / f"batched-bench-{version}-{flavour()}"
    binary = build / "bin" / BATCHED_BENCH
    if binary.is_file():
        return binary
    tree = patched_tree(version)
    print(f"building {BATCHED_BENCH} from the patched llama.cpp of llama-cpp-python {version} into {build} "
          "(once; about 6 minutes on 2 cores)", flush=True)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", str(tree), "-B", str(build), *generator, "-DGGML_RPC=ON", "-DLLAMA_CURL=OFF",
                    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "--target", BATCHED_BENCH, "--parallel",
                    str(os.cpu_count() or 1)], check=True, stdout=subprocess.DEVNULL)
    return binary


def parallel_supported() -> bool:
    """Whether this build's inventory knows `api.parallel` (the batching coordinator); today's refuses it."""
    try:
        parse_inventory("cluster: probe\napi: {parallel: 2}\nnodes:\n  - name: a\n    kind: local\n", "probe")
    except InventoryError:
        return False
    return True


def cluster_for(root: Path, model: Path, ports: list[int], context: int, parallel: int | None) -> Cluster:
    """The two-node local cluster on ``ports``; every round's uses the same state folder, so `up` adopts the
    workers the previous round left running. ``parallel``: the `api.parallel` to set, or None to leave it out."""
    cluster = Cluster(root, nodes=2, context=context, strategy="equal", top=[f"model: {model}"], ports=ports)
    if parallel is not None:
        text = cluster.inventory.read_text()
        if API_LINE not in text:
            raise RuntimeError(f"the test harness no longer writes {API_LINE!r}; update batching.py's API_LINE")
        cluster.inventory.write_text(text.replace(API_LINE, f"api: {{port: 0, parallel: {parallel}}}"))
    return cluster


@dataclass
class Stream:
    """One client's streamed completion, with monotonic times (s)."""

    sent: float
    first: float = 0.0  # the first token's text arrived
    last: float = 0.0  # the last token's text arrived
    tokens: int = 0  # completion tokens, from the answer's usage
    prompt_tokens: int = 0
    reason: str = ""


@dataclass(frozen=True)
class Ours:
    """ggml-cluster with N clients: aggregate decode tokens/s and what it was computed from."""

    rate: float
    prompt_s: float  # requests sent → the first token of any client
    first_token_s: float  # each client's time to its first token, median
    tokens: tuple[int, ...]
    stopped: int  # clients whose completion ended early (end of text)


@dataclass(frozen=True)
class Batched:
    """One llama-batched-bench row."""

    rate: float  # S_TG t/s
    prompt_s: float  # T_PP s


class ApiError(RuntimeError):
    """The API answered an error; ``body`` is what it said."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"the API answered {status}: {body}")
        self.status, self.body = status, body


async def stream_one(session: aiohttp.ClientSession, url: str, body: dict[str, object]) -> Stream:
    """POST one streamed completion and time its tokens as they arrive."""
    stream = Stream(sent=time.monotonic())
    async with session.post(url, json={**body, "stream": True}) as response:
        if response.status != 200:
            raise ApiError(response.status, await response.text())
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                raise ApiError(200, json.dumps(event["error"]))
            choice = event["choices"][0]
            if choice["text"]:
                stream.first = stream.first or time.monotonic()
                stream.last = time.monotonic()
            if choice["finish_reason"]:
                stream.reason = choice["finish_reason"]
                stream.tokens = event["usage"]["completion_tokens"]
                stream.prompt_tokens = event["usage"]["prompt_tokens"]
    return stream


async def clients(url: str, prompts: list[str], tokens: int, extra: dict[str, object]) -> list[Stream]:
    """One greedy streamed completion per prompt, all sent at once."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return list(await asyncio.gather(*(
            stream_one(session, url, {"prompt": prompt, "max_tokens": tokens, "temperature": 0, **extra})
            for prompt in prompts)))


def client_prompts(count: int, words: int) -> list[str]:
    """``count`` prompts of ``words`` words each (one token per word on the demo vocabulary), each different:
    every client decodes its own sequence."""
    return [" ".join(WORDS[(client + i) % len(WORDS)] for i in range(words)) for client in range(count)]


def warm_up(url: str) -> dict[str, object]:
    """One short request (the first after a load pays one-off costs); returns the extra fields the API takes."""
    extra: dict[str, object] = {IGNORE_EOS: True}
    try:
        asyncio.run(clients(url, ["The cluster"], 8, extra))
    except ApiError as error:
        if error.status != 400 or IGNORE_EOS not in error.body:
            raise
        print(f"  note: the API refuses {IGNORE_EOS}; the clients ask without it", flush=True)
        extra = {}
        asyncio.run(clients(url, ["The cluster"], 8, extra))
    return extra


def ours(cluster: Cluster, count: int, words: int, tokens: int) -> Ours:
    """``count`` concurrent clients against the cluster that is up."""
    url = f"http://{cluster.status()['api_endpoint']}/v1/completions"
    extra = warm_up(url)
    streams = asyncio.run(clients(url, client_prompts(count, words), tokens, extra))
    if any(stream.tokens < 2 for stream in streams):
        raise RuntimeError(f"a client got fewer than 2 tokens: {[stream.tokens for stream in streams]}")
    start, sent = min(stream.first for stream in streams), min(stream.sent for stream in streams)
    # Each client's first token comes out of its prompt's evaluation, as batched-bench's prompt pass makes the
    # first; the rest are decode steps.
    decoded = sum(stream.tokens - 1 for stream in streams)
    return Ours(rate=decoded / (max(stream.last for stream in streams) - start), prompt_s=start - sent,
                first_token_s=statistics.median(stream.first - stream.sent for stream in streams),
                tokens=tuple(stream.tokens for stream in streams),
                stopped=sum(stream.tokens < tokens for stream in streams))


def batched_command(binary: Path, model: Path, ports: list[int], split: Plan, context: int, prompt: int,
                    tokens: int, count: int) -> list[str]:
    """llama-batched-bench as the coordinator runs the model: all layers on the two workers with the cluster's
    split, one thread here, its context, batch sizes and flash attention; ``count`` sequences of ``prompt`` +
    ``tokens``. `-fit off`: llama.cpp would otherwise change unset parameters to fit device memory."""
    return [str(binary), "-m", str(model), "--rpc", ",".join(f"127.0.0.1:{port}" for port in ports),
            "-ngl", "99", "-sm", "layer", "-ts", "/".join(f"{share:g}" for share in split.tensor_split),
            "-t", "1", "-tb", "1", "-c", str(context), "-b", str(BATCH), "-ub", str(BATCH), "-fa", "on",
            "-fit", "off", "-npp", str(prompt), "-ntg", str(tokens), "-npl", str(count), "--output-format", "jsonl"]


def batched(command: list[str]) -> Batched:
    """Run llama-batched-bench and read its one result row.

    Its logger writes from a thread that nobody waits for at exit (llama.cpp leaks it on purpose, upstream
    issue 22142), so on a busy machine the row printed last is sometimes lost with a clean exit status: that
    run is made again (a few times at most).
    """
    for _ in range(LOST_ROW_RETRIES):
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
        if result.returncode != 0 or len(rows) > 1:
            raise RuntimeError(f"{BATCHED_BENCH} exited {result.returncode} with {len(rows)} result rows:\n"
                               f"{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
        if rows:
            return Batched(rate=float(rows[0]["speed_tg"]), prompt_s=float(rows[0]["t_pp"]))
        print(f"  note: {BATCHED_BENCH} exited without its result row (its logger lost it); running it again",
              flush=True)
    raise RuntimeError(f"{BATCHED_BENCH} printed no result row {LOST_ROW_RETRIES} times (is N x (prompt + tokens) "
                       "more than -c? such a row is skipped)")


def parse_counts(text: str) -> list[int]:
    """`--clients`: comma-separated counts of concurrent clients, e.g. 1,2,4,8."""
    try:
        counts = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of whole numbers like 1,2,4,8") from None
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError("client counts start at 1")
    return counts


def check_placement(cluster: Cluster, split: Plan) -> None:
    """The cluster that is up placed the layers as ``split`` does, which batched-bench is given."""
    placed = cluster.status()
    layers = [tuple(node["layers"]) if node["layers"] else None for node in placed["nodes"]]
    if placed["tensor_split"] != list(split.tensor_split) or layers != list(split.layers):
        raise RuntimeError(f"the cluster placed layers {layers} with split {placed['tensor_split']}, not the equal "
                           f"split {list(split.layers)} {BATCHED_BENCH} is given")


def prompt_length(cluster: Cluster, count: int, words: int) -> int:
    """The clients' prompts' length in tokens as the cluster counts them (BOS included), median over clients:
    batched-bench's -npp."""
    url = f"http://{cluster.status()['api_endpoint']}/v1/completions"
    streams = asyncio.run(clients(url, client_prompts(count, words), 1, {}))
    return int(statistics.median(stream.prompt_tokens for stream in streams))


def paired(values: list[float], against: list[float]) -> float:
    """The median over rounds of each round's ratio: this machine's speed drifts between rounds."""
    return statistics.median(value / base for value, base in zip(values, against, strict=True))


def report(model: Path, split: Plan, settable: bool, prompt: int, tokens: int, context: int,
           ours_runs: dict[int, list[Ours]], batched_runs: dict[int, list[Batched]]) -> None:
    """The table: per client count, both arms' medians, the ratios, the counts; then issue 22's goals."""
    rounds = len(next(iter(ours_runs.values())))
    setting = "api.parallel = N" if settable else "no api.parallel (this build serves one request at a time)"
    print(f"\nmodel {model.name} ({model.stat().st_size / 1e6:.0f} MB) split {split_text(split)} over the same two "
          f"-t 1 workers; context {context}; each client {tokens} tokens after a {prompt}-token prompt; {setting}; "
          f"{rounds} round(s), medians")
    print(f"{'N':>2} | {'ours tok/s':>10} | {'batched S_TG':>12} | {'ours/ours@1':>11} | {'batched/@1':>10} | "
          f"{'ours/batched':>12} | {'ours prompt s':>13} | {'ours ttft s':>11} | {'batched T_PP s':>14} | "
          "ours tokens per client")
    base = min(ours_runs)
    for count, runs in ours_runs.items():
        rates = [run.rate for run in runs]
        others = [row.rate for row in batched_runs[count]]
        counts = sorted({tokens for run in runs for tokens in run.tokens})
        stopped = sum(run.stopped for run in runs)
        print(f"{count:>2} | {statistics.median(rates):>10.1f} | {statistics.median(others):>12.1f} | "
              f"{paired(rates, [run.rate for run in ours_runs[base]]):>11.2f} | "
              f"{paired(others, [row.rate for row in batched_runs[base]]):>10.2f} | {paired(rates, others):>12.3f} | "
              f"{statistics.median(run.prompt_s for run in runs):>13.3f} | "
              f"{statistics.median(run.first_token_s for run in runs):>11.3f} | "
              f"{statistics.median(row.prompt_s for row in batched_runs[count]):>14.3f} | "
              f"{'/'.join(map(str, counts))}" + (f" ({stopped} stopped early: end of text)" if stopped else ""))
        if rounds > 1:
            print(f"   rounds: ours {', '.join(f'{rate:.1f}' for rate in rates)}; batched "
                  f"{', '.join(f'{rate:.1f}' for rate in others)}")
    if 4 in ours_runs and base == 1:
        rates = [run.rate for run in ours_runs[4]]
        scaling = paired(rates, [run.rate for run in ours_runs[1]])
        parity = paired(rates, [row.rate for row in batched_runs[4]])
        print(f"goals at 4 clients: ours/ours@1 {scaling:.2f} (goal >= 2.5: {'met' if scaling >= 2.5 else 'missed'}), "
              f"ours/{BATCHED_BENCH} {parity:.3f} (goal >= 0.9: {'met' if parity >= 0.9 else 'missed'})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=model_argument, help="a GGUF, or 'real' (default: the 8-layer f16 model "
                        "made here)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128, help="tokens each client asks for")
    parser.add_argument("--prompt-words", type=int, default=15, help="words in each client's prompt")
    parser.add_argument("--clients", type=parse_counts, default=[1, 2, 4, 8], help="concurrent clients, e.g. 1,2,4,8")
    parser.add_argument("--context", type=int, default=CONTEXT, help="the cluster's context and batched-bench's -c")
    args = parser.parse_args()
    if max(args.clients) * (args.prompt_words + 1 + args.tokens) > args.context:
        parser.error(f"{max(args.clients)} clients of ~{args.prompt_words + 1} prompt and {args.tokens} tokens do not "
                     f"fit a context of {args.context} (fix: a larger --context, or fewer --tokens)")
    binary = batched_bench()
    model = args.model or big_model()
    split = equal_split(model, args.context)
    settable = parallel_supported()
    if not settable:
        print("note: this build's inventory has no api.parallel (requests run one at a time); the cluster runs "
              "without it", flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench-batching-", dir="/tmp"))
    ports = [free_port(), free_port()]
    ours_runs: dict[int, list[Ours]] = {count: [] for count in args.clients}
    batched_runs: dict[int, list[Batched]] = {count: [] for count in args.clients}
    cluster = cluster_for(root, model, ports, args.context, None)
    try:
        cluster.cli("up")  # starts the workers every arm uses
        check_placement(cluster, split)
        prompt = prompt_length(cluster, max(args.clients), args.prompt_words)
        cluster.cli("down", "--keep-workers")
        command = batched_command(binary, model, ports, split, args.context, prompt, args.tokens, 0)
        print("  " + " ".join(command).replace("-npl 0", "-npl N"), flush=True)
        for round_ in range(args.rounds):
            for count in args.clients:
                # Which arm goes first alternates by round: the second of two back-to-back runs may find the
                # machine warmer or busier.
                for arm in ("ours", "batched") if round_ % 2 == 0 else ("batched", "ours"):
                    if arm == "ours":
                        cluster = cluster_for(root, model, ports, args.context, count if settable else None)
                        cluster.cli("up")
                        check_placement(cluster, split)
                        result = ours(cluster, count, args.prompt_words, args.tokens)
                        cluster.cli("down", "--keep-workers")
                        ours_runs[count].append(result)
                        print(f"  round {round_ + 1} N={count} ours {result.rate:6.1f} tok/s  tokens {result.tokens}",
                              flush=True)
                    else:
                        row = batched(batched_command(binary, model, ports, split, args.context, prompt,
                                                      args.tokens, count))
                        batched_runs[count].append(row)
                        print(f"  round {round_ + 1} N={count} {BATCHED_BENCH} {row.rate:6.1f} tok/s", flush=True)
    finally:
        cluster.cli("down", check=False)  # with no controller up, `down` stops the workers it left running
        shutil.rmtree(root, ignore_errors=True)
    report(model, split, settable, prompt, args.tokens, args.context, ours_runs, batched_runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
