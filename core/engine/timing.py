"""The profiler's child process: a job's layouts loaded on their workers, and their decode steps timed.

Started by core.engine.profile (``python -m core.engine.timing CONFIG``), one per job, apart from the controller
because llama.cpp aborts when a worker goes away. It loads, says so, waits to be released (so that jobs load at
once but are timed one at a time), then times every layout in turn and answers with the mean seconds per step and
how surely its first and last layouts differ.
Tokens are chosen where the cluster chooses them (inventory ``sampling``): on the node that holds the output layer,
whose step then sends only the token, or here from the logits it sends; over a slow link the two differ by the
logits' time on the link (1 MiB a token for a 262k vocabulary).
"""

from __future__ import annotations

import argparse
import codecs
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO

from core.engine.chain import NodeSampler
from core.engine.coordinator import FLASH_ATTENTION, emit
from core.engine.llama_context import LlamaContext, last_logits
from core.engine.protocol import Generate, Token
from core.engine.rpc_client import register_rpc_servers
from core.engine.sampling import Sampler, SamplingParams, chain_seed
from core.engine.step import Entry
from core.planner import PROFILE_BATCH, PROFILE_CONTEXT, split_for_counts

WARMUP_TOKENS = 4  # first decode steps allocate and warm caches
TIMED_TOKENS = 64
RUN_LENGTH = 8     # timed steps of one kind on one layout in a row: the worker keeps their graph between them


@dataclass(frozen=True)
class Layout:
    """A model file and how many of its layers each endpoint holds."""

    model: str
    counts: tuple[int, ...]


class TimedRun:
    """One layout loaded in the child, stepping exactly as the coordinator does per token."""

    def __init__(self, layout: Layout, threads: int, on_node: bool) -> None:
        """``on_node``: tokens sampled on the output layer's node (``sampling: node``), as the cluster serves."""
        import llama_cpp

        self._lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=layout.model, n_gpu_layers=-1,
                                   tensor_split=list(split_for_counts(layout.counts)), n_ctx=PROFILE_CONTEXT,
                                   n_batch=PROFILE_BATCH, n_ubatch=PROFILE_BATCH,
                                   n_threads=threads, n_threads_batch=threads, flash_attn=FLASH_ATTENTION,
                                   verbose=False)
        self.n_vocab = self.llm.n_vocab()
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.llm.eval([self.llm.token_bos()])
        self.token = self.llm.token_bos()
        self._context = LlamaContext(llama_cpp, self.llm.ctx, llama_cpp.llama_model_get_vocab(self.llm.model),
                                     self.n_vocab, 1)
        params = SamplingParams.of(Generate(0, TIMED_TOKENS))  # greedy, as a request at temperature 0
        self.sampler = Sampler(params)
        # the next token; later ones sampled on the node, if there
        self.chosen = self.sampler.choose(last_logits(self._lib, self.llm, self.n_vocab))
        # The request's chain on the output layer's device; None where that device cannot run it whole (the
        # cluster samples such a request from the logits here too).
        self.node: NodeSampler | None = None
        if on_node:
            node = NodeSampler(llama_cpp, params, chain_seed(params.seed), self.n_vocab)
            if self._context.attach(0, node):
                self.node = node

    def close(self) -> None:
        """Free the model (the context's batch lives as long as the process)."""
        if self.node is not None:
            self._context.detach(0)
        self.llm.close()

    def quiet_step(self) -> float:
        """Seconds of one decode step that asks for no logits: llama.cpp then computes (nearly) nothing and waits
        for nothing from the node, so this is the step's dispatch and the coordinator's own work."""
        started = time.perf_counter()
        if self._context.decode([Entry(self.token, self.llm.n_tokens, 0, False)]) != 0:
            raise RuntimeError("a decode step without logits failed")
        self.llm.n_tokens += 1
        return time.perf_counter() - started

    def step(self, out: IO[str]) -> float:
        """Seconds of one token: send the chosen one's event, decode it, and wait for the next: the token sampled
        on the node, or the logits to choose it from here."""
        started = time.perf_counter()
        token = self.token = self.chosen
        emit(out, Token(0, token, self.decoder.decode(self.llm.detokenize([token]))))  # as the coordinator does
        if self._context.decode([Entry(token, self.llm.n_tokens, 0, True)]) != 0:
            raise RuntimeError("a decode step failed")
        self.llm.n_tokens += 1
        if self.node is not None:
            self.node.accept(token)
            self.chosen = self._context.sampled(0)
        else:
            self.sampler.accept(token)
            self.chosen = self.sampler.choose(self._context.logits(0))
        return time.perf_counter() - started


def time_runs(runs: Sequence[TimedRun], warmup: int, tokens: int, out: IO[str],
              run_length: int = RUN_LENGTH) -> tuple[list[list[float]], list[list[float]]]:
    """Seconds of each timed decode step of each loaded layout (runs in the child): whole tokens, and the same
    steps without logits.

    The layouts take turns, ``run_length`` whole steps and as many without logits at a time, each run led by one
    untimed step: that one sends the worker its graph whole, and the rest re-run the graph the worker holds
    (GRAPH_RECOMPUTE), as consecutive tokens do when the cluster serves; a step after another layout's, or after
    one of the other kind, has a different graph. A whole step does what the coordinator does per token, writing
    the same event to ``out``, so that the measured time is the time a token costs when the cluster serves.
    """
    steps: list[list[float]] = [[] for _ in runs]
    quiet: list[list[float]] = [[] for _ in runs]
    for run in runs:
        for _ in range(warmup):
            run.step(out)
    timed = 0
    while timed < tokens:
        count = min(run_length, tokens - timed)
        for run, record, quiet_record in zip(runs, steps, quiet, strict=True):
            record.extend(_run_of(functools.partial(run.step, out), count))
            quiet_record.extend(_run_of(run.quiet_step, count))
        timed += count
    return steps, quiet


def _run_of(step: Callable[[], float], count: int) -> list[float]:
    """``count`` timed steps after an untimed one (the step that sends the worker its graph)."""
    step()
    return [step() for _ in range(count)]


def difference_error(first: Sequence[float], last: Sequence[float]) -> float:
    """Standard error of the mean difference between two layouts' steps, paired token by token (timed in turn,
    so that the machine's drift cancels out of each pair); 0 for a layout against itself."""
    differences = [b - a for a, b in zip(first, last, strict=True)]
    if len(differences) < 2:
        return 0.0
    return statistics.stdev(differences) / math.sqrt(len(differences))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the profiling child: loads its job's layouts and says ``{"loaded": true}``, waits for a line
    on stdin, then times them and says ``{"seconds": [...]}``; ``{"error"}`` when it cannot."""
    parser = argparse.ArgumentParser(description="ggml-cluster profiler (started by the controller)")
    parser.add_argument("config", help='{"endpoints": [...], "job": [{"model", "counts"}, ...], "threads", '
                                       '"sampling": "node" | "coordinator"}')
    config = json.loads(parser.parse_args(argv).config)
    runs: list[TimedRun] = []
    try:
        register_rpc_servers(tuple(config["endpoints"]))
        threads, on_node = int(config.get("threads", 1)), config.get("sampling") == "node"
        runs += [TimedRun(Layout(layout["model"], tuple(layout["counts"])), threads, on_node)
                 for layout in config["job"]]
        print(json.dumps({"loaded": True}), flush=True)
        sys.stdin.readline()
        steps, quiet = time_runs(runs, int(config.get("warmup", WARMUP_TOKENS)),
                                 int(config.get("tokens", TIMED_TOKENS)), sys.stdout)
        # The mean, not the median: a node that is slow in bursts (shared, throttled) pays for each one.
        print(json.dumps({"seconds": [statistics.fmean(record) for record in steps],
                          "quiet": [statistics.fmean(record) for record in quiet],
                          "difference_se": difference_error(steps[0], steps[-1])}), flush=True)
    except (RuntimeError, ValueError, OSError) as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 1
    finally:
        for run in runs:
            run.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
