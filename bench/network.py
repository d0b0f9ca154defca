"""The cluster over a real network (tests.netbed): each node in a network namespace of its own with its own sshd and
a shaped link to the head, where the controller and coordinator run; the real quantized model.

For each link profile (unshaped; lan: 1 Gbit, 0.25 ms each way; wifi: 100 Mbit, 3 ms each way) one bed of
``--nodes`` nodes, and on the same workers (the arms' clusters share the nodes' workdir and ports: each `up` adopts
them, `down --keep-workers` leaves them), alternating which goes first each round:
- ``node``: ggml-cluster over ssh, tokens sampled on the output node (`sampling: node`), `speculative: off`;
- ``coordinator``: the same with `sampling: coordinator` (every logit of every token crosses the link);
- ``direct``: the node arm with `transport: direct` (the coordinator reaches each worker on the node's address,
  no SSH): on links without delay alone, since the bed puts a link's delay in a proxy in front of each sshd;
- ``ngram``: the defaults, `sampling: node` and `speculative: ngram` (drafts verified in the step), with the
  drafted and kept tokens;
- ``logprobs``: the node arm, its request through the API with `logprobs: 5` (the likeliest 5 tokens' logprobs
  reported with each token by the node, patches/0006; before it, such a request was sampled as the coordinator
  arm's are), timed as the client receives the stream;
- ``penalties``: the same with `frequency_penalty` and `presence_penalty` 0.5 and speculation on (each output of a
  step counts the tokens sampled before it, patches/0007; before it, sampled as the coordinator arm's are);
- llama.cpp as shipped, on the same workers and split (``--no-llama`` leaves these out): ``llama-bench`` and
  ``llama-server`` `--rpc`, plain, with `--backend-sampling`, and with `--spec-type ngram-simple` (looking up 4
  tokens and drafting up to 8: its defaults, 12 and 48, drafted nothing in these requests). They speak RPC
  without SSH, so each node's worker is reached through a proxy in the node's namespace that holds every chunk
  for the link's delay each way (as the proxy in front of its sshd does for ggml-cluster), across the same shaped
  link. llama-server is asked greedy (`temperature: 0`) for the same prompt and tokens through /completion.
Reported per arm: decode tok/s (first token to last, as `run` sees them; llama-server's `predicted_per_second`,
llama-bench's `avg_ts`), time to first token (llama-server: its `prompt_ms`), bytes per token from and to each
node (the relays' counters in `status`: ggml-cluster's arms only), CPU ms per token by kind of process (workers,
sshd, controller with its relays, coordinator) and the whole machine's, with how busy its cores were (bench/cpu.py:
ggml-cluster's arms only; with `direct`, ssh's extra CPU a token beside its ratio), and `up` (the first one on a bed
starts the workers).
With ``--plan``, first: every node profiled (`profile`) and the compute strategy's plan for the bed (`plan
--strategy compute`), the planner's choice on that link; then one arm more, ``planned``: the defaults as a user
runs them after `profile` (`strategy: compute`, the planner's layout for that link, not the equal split).
With ``--faults``, then, on each bed, with the defaults: a `kill -9` of the worker of the 5th node (or the last,
with fewer) and a cut of that node's SSH connections, each in the middle of a request: the time from the fault to
the next token, and whether the text is the fault-free one.

    .venv/bin/python bench/network.py [--nodes 2] [--profiles unshaped,lan,wifi] [--rounds 2] [--tokens 64]
                                      [--faults] [--no-llama] [--plan]
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu import KINDS, Usage, sample, spent
from parity import equal_split, llama_tool

from tests.harness import CLI, Cluster, free_port, pid_in
from tests.netbed import PROFILES, NetBed, available
from tests.realmodel import real_model
from tests.sshd import listening_in

# Each arm's inventory lines.
ARMS = {"node": ["sampling: node", "speculative: off"], "coordinator": ["sampling: coordinator", "speculative: off"],
        "ngram": ["sampling: node", "speculative: ngram"],
        "logprobs": ["sampling: node", "speculative: off"],  # the node arm, its request with logprobs 5 (the API)
        "penalties": ["sampling: node", "speculative: ngram"],  # the defaults, its request penalised (the API)
        "direct": ["sampling: node", "speculative: off"]}  # the node arm, every node with transport: direct
DIRECT = "direct"
LOGPROBS = 5
# The fields of the arms' requests that go through the API (the others use `run`).
API_FIELDS: dict[str, dict[str, float]] = {"logprobs": {"logprobs": LOGPROBS},
                                           "penalties": {"frequency_penalty": 0.5, "presence_penalty": 0.5}}
# Such a request, streamed from the head's namespace (where the API listens): arrival times, its text.
API_REQUEST = """
import json, sys, time
import openai
client = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=600)
began, arrived, text, tokens = time.perf_counter(), [], "", 0
for chunk in client.completions.create(model="any", prompt=sys.argv[2], max_tokens=int(sys.argv[3]), temperature=0,
                                       stream=True, stream_options={"include_usage": True}, **json.loads(sys.argv[4])):
    tokens = chunk.usage.completion_tokens if chunk.usage is not None else tokens
    for choice in chunk.choices:
        if choice.text:
            arrived.append(time.perf_counter())
            text += choice.text
print(json.dumps({"first": arrived[0] - began, "decode": (tokens - 1) / (arrived[-1] - arrived[0]),
                  "tokens": tokens, "text": text}))
"""
NAMES = tuple(ARMS)
PLANNED = "planned"  # with --plan: the defaults on the compute strategy's layout (the profiles just taken)
# llama-server's arms: its flags.
SERVERS = {"llama-server": [], "llama-server --backend-sampling": ["--backend-sampling"],
           "llama-server --spec-type ngram-simple": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4",
                                                     "--spec-ngram-simple-size-m", "8"]}
LLAMA = ("llama-bench", *SERVERS)
RPC_PROXY_PORT = 50100  # in each node's namespace: its worker across the link, for llama.cpp's tools
SERVER_PORT = 8090      # llama-server's, in the head's namespace
ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def arm_cluster(bed: NetBed, root: Path, arm: str, nodes: int, ports: list[int], model: Path) -> Cluster:
    (root / arm).mkdir(parents=True, exist_ok=True)
    return Cluster(root / arm, nodes=nodes, ssh=[bed.node_lines(index) for index in range(nodes)],
                   base_env=bed.env(), prefix=bed.prefix, strategy="compute" if arm == PLANNED else "equal",
                   ports=ports, context=1024, top=[f"model: {model}", *ARMS.get(arm, ARMS["ngram"])],
                   defaults=[f"workdir: {root / 'nodes'}", *(["transport: direct"] if arm == DIRECT else [])],
                   api="{port: 0, parallel: 1}")


def cpu_per_token(before: Usage, after: Usage, wall_s: float, tokens: int) -> dict[str, float]:
    """Each kind of process's CPU ms per generated token over a request, and how busy the machine's cores were
    (``load``, 1.0: every core all the time)."""
    seconds = spent(before, after)
    return {**{kind: seconds[kind] * 1000 / tokens for kind in (*KINDS, "machine")},
            "load": seconds["machine"] / (wall_s * (os.cpu_count() or 1))}


def measure(cluster: Cluster, tokens: int) -> dict[str, object]:
    """One greedy request: decode tok/s, first token (s), each node's bytes per token each way, the tokens
    drafted and kept, and the CPU each kind of process spent on it per token."""
    start = cluster.status()
    cpu, began = sample(), time.monotonic()
    result = json.loads(cluster.cli("run", PROMPT, "-n", str(tokens), "--json").stdout)
    cpu_used = cpu_per_token(cpu, sample(), time.monotonic() - began, result["completion_tokens"])
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
            "kept": end["tokens_accepted"] - start["tokens_accepted"], "text": result["text"], "cpu": cpu_used}


def measure_api(bed: NetBed, cluster: Cluster, tokens: int, fields: dict[str, float]) -> dict[str, object]:
    """One greedy request through the API with ``fields`` (logprobs, penalties: `run` has neither): decode tok/s
    and first token as the client sees them, each node's bytes per token each way, the tokens drafted and kept, and
    the CPU each kind of process spent on it per token (the client's own among the machine's)."""
    start = cluster.status()
    cpu, began = sample(), time.monotonic()
    answer = subprocess.run([*bed.prefix, sys.executable, "-c", API_REQUEST, f"http://{start['api_endpoint']}/v1",
                             PROMPT, str(tokens), json.dumps(fields)], capture_output=True, text=True, check=True)
    result = json.loads(answer.stdout)
    cpu_used = cpu_per_token(cpu, sample(), time.monotonic() - began, result["tokens"])
    end = cluster.status()
    pairs = list(zip(start["nodes"], end["nodes"], strict=True))
    generated = result["tokens"]
    return {"decode": result["decode"], "first": result["first"],
            "from": [(now["bytes_from"] - then["bytes_from"]) / generated for then, now in pairs],
            "to": [(now["bytes_to"] - then["bytes_to"]) / generated for then, now in pairs],
            "drafted": end["tokens_drafted"] - start["tokens_drafted"],
            "kept": end["tokens_accepted"] - start["tokens_accepted"], "text": result["text"], "cpu": cpu_used}


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


def rpc_endpoints(bed: NetBed, ports: list[int]) -> list[str]:
    """Each node's worker reached from the head without SSH: a proxy in the node's namespace, on its address,
    holding every chunk for the link's delay each way (the bed puts the delay in front of each sshd alike)."""
    endpoints = []
    for index, (space, port) in enumerate(zip(bed.spaces, ports, strict=True)):
        address = bed.node_address(index)
        bed.proxies.append(subprocess.Popen(  # the bed ends them with its namespaces
            ["ip", "netns", "exec", space, sys.executable, "-m", "tests.delay", address, str(RPC_PROXY_PORT),
             "127.0.0.1", str(port), str(bed.links[index].delay_ms)], cwd=ROOT, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 20
        while not listening_in(bed.head, address, RPC_PROXY_PORT):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the RPC proxy of node {index} did not start")
            time.sleep(0.1)
        endpoints.append(f"{address}:{RPC_PROXY_PORT}")
    return endpoints


def llama_bench_run(bed: NetBed, model: Path, endpoints: list[str], split: str, tokens: int) -> dict[str, object]:
    """llama-bench's decode tok/s over the workers."""
    command = [*bed.prefix, str(llama_tool("llama-bench")), "-m", str(model), "--rpc", ",".join(endpoints),
               "-ngl", "99", "-sm", "layer", "-ts", split, "-p", "0", "-n", str(tokens), "-r", "1", "-o", "json"]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    decode = next(row["avg_ts"] for row in json.loads(result.stdout) if row["n_gen"] > 0)
    return {"decode": float(decode), "first": None, "drafted": None, "kept": None, "text": None}


def head_request(bed: NetBed, path: str, body: dict[str, object] | None = None) -> dict[str, object] | None:
    """A request to llama-server from the head's namespace: its JSON answer, or None if it does not answer 200."""
    command = [*bed.prefix, "curl", "-s", "-f", "--max-time", "600", f"http://127.0.0.1:{SERVER_PORT}{path}"]
    if body is not None:
        command += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def llama_server_run(bed: NetBed, model: Path, endpoints: list[str], split: str, flags: list[str], tokens: int,
                     log: Path) -> dict[str, object]:
    """llama-server over the workers with ``flags``: one warm-up and one greedy request through /completion."""
    with log.open("ab") as output:
        server = subprocess.Popen([*bed.prefix, str(llama_tool("llama-server")), "-m", str(model), "--rpc",
                                   ",".join(endpoints), "-ngl", "99", "-sm", "layer", "-ts", split, "-c", "1024",
                                   "-np", "1", "--host", "127.0.0.1", "--port", str(SERVER_PORT), *flags],
                                  stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while head_request(bed, "/health") is None:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server {' '.join(flags)} did not start: see {log}")
            time.sleep(0.5)
        ask = {"temperature": 0, "cache_prompt": False}
        head_request(bed, "/completion", {"prompt": "Hello", "n_predict": 4, **ask})
        answer = head_request(bed, "/completion", {"prompt": PROMPT, "n_predict": tokens, **ask})
        if answer is None:
            raise RuntimeError(f"llama-server {' '.join(flags)} did not answer: see {log}")
        timings: dict[str, float] = answer["timings"]  # type: ignore[assignment]
        return {"decode": timings["predicted_per_second"], "first": timings["prompt_ms"] / 1000,
                "drafted": timings.get("draft_n", 0), "kept": timings.get("draft_n_accepted", 0),
                "text": answer["content"]}
    finally:
        server.terminate()
        server.wait(30)


def run_profile(profile: str, args: argparse.Namespace, model: Path) -> dict[str, list[dict[str, object]]]:
    root = Path(tempfile.mkdtemp(prefix="bench-net-", dir="/tmp"))
    bed = NetBed(root / "bed", args.nodes, profile)
    ports = [free_port() for _ in range(args.nodes)]
    delayed = PROFILES[profile].delay_ms > 0  # the delay is a proxy in front of sshd: `direct` would skip it
    clusters = {arm: arm_cluster(bed, root, arm, args.nodes, ports, model)
                for arm in NAMES + ((PLANNED,) if args.plan else ()) if not (arm == DIRECT and delayed)}
    names = tuple(clusters) + (LLAMA if args.llama else ())
    server_log = root.parent / f"{root.name}-llama-server.log"  # outside the bed's folder: kept if llama-server fails
    runs: dict[str, list[dict[str, object]]] = {arm: [] for arm in names}
    split = "/".join(f"{share:g}" for share in equal_split(model, 1024, args.nodes).tensor_split)
    ups: list[float] = []
    try:
        started = time.monotonic()
        clusters[NAMES[0]].cli("up")  # starts the workers that every arm then uses
        ups.append(time.monotonic() - started)
        if args.plan:
            started = time.monotonic()
            clusters[NAMES[0]].cli("profile")
            print(f"{profile}: every node profiled in {time.monotonic() - started:.1f} s (with the reload); the "
                  f"planner's choice (strategy compute, objective latency) on this bed:")
            print(clusters[NAMES[0]].cli("plan", "--strategy", "compute").stdout)
        clusters[NAMES[0]].cli("down", "--keep-workers")
        endpoints = rpc_endpoints(bed, ports) if args.llama else []
        for round_ in range(args.rounds):
            shift = round_ % len(names)
            for arm in names[shift:] + names[:shift]:
                if arm == "llama-bench":
                    runs[arm].append(llama_bench_run(bed, model, endpoints, split, args.tokens))
                    continue
                if arm in SERVERS:
                    runs[arm].append(llama_server_run(bed, model, endpoints, split, SERVERS[arm], args.tokens,
                                                      server_log))
                    continue
                cluster = clusters[arm]
                started = time.monotonic()
                cluster.cli("up")
                ups.append(time.monotonic() - started)
                cluster.cli("run", "Hello", "-n", "4")  # warm: the first graph of a coordinator
                runs[arm].append(measure_api(bed, cluster, args.tokens, API_FIELDS[arm]) if arm in API_FIELDS else
                                 measure(cluster, args.tokens))
                cluster.cli("down", "--keep-workers")
        if args.faults:
            clusters["ngram"].cli("up")
            print(f"{profile}, faults mid-request (the defaults: sampling node, speculative ngram):")
            field_faults(bed, clusters["ngram"], root / "nodes", 4 * args.tokens)
        server_log.unlink(missing_ok=True)
    finally:
        for cluster in clusters.values():
            cluster.cli("down", check=False)
        bed.close()
        shutil.rmtree(root, ignore_errors=True)
    print(f"{profile}: `up` {ups[0]:.1f} s with the workers started, then {statistics.median(ups[1:]):.1f} s "
          f"(coordinator and model load on running workers)" if len(ups) > 1 else f"{profile}: `up` {ups[0]:.1f} s")
    return runs


def cpu_line(used: dict[str, float]) -> str:
    """CPU ms per token by kind of process, the machine's, and its cores' load."""
    return (f"{' '.join(f'{kind} {used[kind]:.1f}' for kind in KINDS)} machine {used['machine']:.1f} "
            f"(cores {used['load']:.0%} busy)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--profiles", default="unshaped,lan,wifi")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--faults", action="store_true", help="then a kill -9 and an SSH cut on each bed")
    parser.add_argument("--no-llama", dest="llama", action="store_false",
                        help="leave out llama-bench's and llama-server's arms")
    parser.add_argument("--plan", action="store_true",
                        help="first profile every node and print the compute strategy's plan for the bed, "
                             "then run the planned arm too (the others keep the equal split; with --rounds 0, "
                             "only the plan)")
    args = parser.parse_args()
    reason = available()
    if reason:
        print(f"bench/network.py needs network namespaces: {reason}")
        return 2
    model = real_model()
    results = {profile: run_profile(profile, args, model) for profile in args.profiles.split(",")}
    if args.rounds < 1:
        return 0
    print(f"\nmodel {model.name}, {args.nodes} ssh nodes, equal split, {args.tokens} tokens, {args.rounds} rounds")
    rates: dict[tuple[str, str], float] = {}
    cpu: dict[tuple[str, str], dict[str, float]] = {}
    for profile, runs in results.items():
        shape = PROFILES[profile]
        link = f"{shape.rate or 'unshaped'}, {shape.delay_ms:g} ms each way"
        for arm, measured in runs.items():
            decode = statistics.median(float(run["decode"]) for run in measured)  # type: ignore[arg-type]
            rates[profile, arm] = decode
            line = f"{profile:<9} ({link:<26}) {arm:<38} decode {decode:6.1f} tok/s"
            if measured[-1]["first"] is not None:
                first = statistics.median(float(run["first"]) for run in measured)  # type: ignore[arg-type]
                line += f"  first token {first * 1000:6.0f} ms"
            if "from" in measured[-1]:
                sent = [statistics.median(run["from"][node] for run in measured)  # type: ignore[index]
                        for node in range(args.nodes)]
                received = [statistics.median(run["to"][node] for run in measured)  # type: ignore[index]
                            for node in range(args.nodes)]
                line += (f"  B/token from nodes {' / '.join(f'{value:,.0f}' for value in sent)}  "
                         f"to nodes {' / '.join(f'{value:,.0f}' for value in received)}")
            if measured[-1]["drafted"] is not None:
                line += f"  drafted / kept {measured[-1]['drafted']} / {measured[-1]['kept']}"
            if "cpu" in measured[-1]:
                cpu[profile, arm] = {kind: statistics.median(run["cpu"][kind] for run in measured)  # type: ignore[index]
                                     for kind in measured[-1]["cpu"]}  # type: ignore[attr-defined]
                line += f"  CPU ms/token {cpu_line(cpu[profile, arm])}"
            print(line)
        print(f"{profile:<9} node / coordinator = {rates[profile, 'node'] / rates[profile, 'coordinator']:.2f}, "
              f"ngram / node = {rates[profile, 'ngram'] / rates[profile, 'node']:.2f}, logprobs {LOGPROBS} / node = "
              f"{rates[profile, 'logprobs'] / rates[profile, 'node']:.2f}, penalties / ngram = "
              f"{rates[profile, 'penalties'] / rates[profile, 'ngram']:.2f} (before patches/0006 and 0007 both were "
              f"sampled as the coordinator arm is)")
        if (profile, DIRECT) in rates:
            ssh, direct = cpu[profile, "node"], cpu[profile, DIRECT]
            print(f"{profile:<9} ssh / direct (sampling node) = {rates[profile, 'node'] / rates[profile, DIRECT]:.2f} "
                  f"(goal >= 0.95); CPU ms a token ssh - direct: "
                  f"{', '.join(f'{kind} {ssh[kind] - direct[kind]:+.2f}' for kind in (*KINDS, 'machine'))}; "
                  f"cores busy {ssh['load']:.0%} (ssh) and {direct['load']:.0%} (direct)")
        if args.llama:
            server = "llama-server --backend-sampling"
            node, bench = rates[profile, "node"], rates[profile, "llama-bench"]
            print(f"{profile:<9} ggml-cluster node / llama-bench = {node / bench:.2f}, defaults (ngram) / {server} = "
                  f"{rates[profile, 'ngram'] / rates[profile, server]:.2f} (goal >= 1.0), node / {server} = "
                  f"{node / rates[profile, server]:.2f}")
            texts = {runs[arm][-1]["text"] for arm in (*NAMES, *SERVERS) if arm in runs and arm != "penalties"}
            print(f"{profile:<9} greedy texts of ggml-cluster's and llama-server's arms: "
                  f"{'all the same' if len(texts) == 1 else f'{len(texts)} different'}")
    if "unshaped" in results:
        for profile in results:
            if profile != "unshaped":
                planned = (f", planned {rates[profile, PLANNED] / rates['unshaped', PLANNED]:.2f}"
                           if (profile, PLANNED) in rates else "")
                print(f"{profile} / unshaped: sampling node {rates[profile, 'node'] / rates['unshaped', 'node']:.2f}, "
                      f"defaults {rates[profile, 'ngram'] / rates['unshaped', 'ngram']:.2f}{planned} "
                      f"(goal at 100 Mbit >= 0.8)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
