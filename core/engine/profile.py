"""Node profiles: what a token costs on each node for this model, measured through its real worker.

A node is measured by short timed runs: two copies of the model cut to its first 1 and 3 layers (the same
tensors, types and vocabulary: a few layers' worth of the model's own bytes, and its output layer) are loaded
with every layer on that node alone, and their decode steps are timed in turn, side by side, so that drift of
the machine cancels out of the difference. The slope is the node's time per byte of layer weights. After each
whole token a step without logits times what a step costs with (nearly) nothing computed: the node's fixed cost
(round trips, dispatch, the coordinator's own work); the rest of a token is the output layer on that node.
One extra run with two nodes separates the coordinator's share, so that a plan over several nodes counts it
once. Tokens are chosen where the cluster will choose them (``sampling``): the output layer's cost on a node holds
what its step sends, the token alone or every logit. All nodes load at once; their timed steps run one node at a
time. Results are cached per (node, model, build, sampling) and re-measured on request.

The timed runs happen in child processes (``python -m core.engine.timing``) for the same reason the
coordinator is one: llama.cpp aborts when a worker goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from core.engine import child
from core.engine.timing import TIMED_TOKENS, Layout
from core.errors import ProfileError
from core.gguf_layout import read_layout, write_cut
from core.model import ModelFacts
from core.planner import DEPTHS, NodeSpeed, depths_for

JOB_TIMEOUT_S = 120.0  # one load and its timed steps; a big model over a slow link takes a while
RESOLVED_SE = 2.0      # a depths' difference is trusted as the layers' time beyond this many standard errors


@dataclass(frozen=True)
class NodeProfile:
    """One node's measured cost for one model and build."""

    fixed_s: float           # seconds per token with layers on this node alone, less the layers' and the output's
    seconds_per_byte: float  # of layer weights
    measured_at: float
    samples: int             # timed tokens behind each depth
    output_s: float = 0.0    # the output layer, what it sends (the token, or the logits) and the sampling, per token
    source: str = "timed"    # timed (by the profiler) | live (corrected from the relay's times while serving)
    round_trip_s: float = 0.0  # the link's round trip, probed before timing: the part of fixed_s spent on the wire

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for the cache and `status --json`."""
        return asdict(self)


@dataclass(frozen=True)
class Job:
    """Layouts loaded together and timed one decode step of each in turn, so the machine's drift hits
    them alike and cancels out of their difference."""

    layouts: tuple[Layout, ...]


def model_fingerprint(path: Path) -> str:
    """Identity of a model file without reading it all: resolved path, size and modification time."""
    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]


# 2: the output layer timed on its own; 3: sampled where the cluster samples (before, the logits always crossed the
# node's link); 4: a deeper second layout whose slope the bytes' rate only bounds, and the link's round trip a
# fixed cost (before, a small model's layers were charged the output step's waits); 5: the coordinator's share no
# more than a node's step without its link (before, the output layers' noise could make it a whole fixed cost);
# 6: steps timed in runs that keep their graph on the worker (before, every step sent it whole, which a slow link
# charged to the output layer); older profiles are re-measured
PROFILE_VERSION = 6


def profile_key(node_identity: Sequence[object], model_id: str) -> str:
    """Cache key of one node's profile: where it is, how its worker runs, which model, how it was measured."""
    key = [list(map(str, node_identity)), model_id, PROFILE_VERSION]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:24]


class ProfileCache:
    """Profiles on disk, one JSON file per key, written atomically."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def load(self, key: str) -> NodeProfile | None:
        """The cached profile, or None when missing or unreadable."""
        data = self._read(f"{key}.json")
        try:
            return NodeProfile(**data) if data is not None else None
        except TypeError:
            return None

    def save(self, key: str, profile: NodeProfile) -> None:
        """Store a profile."""
        self._write(f"{key}.json", profile.to_dict())

    def load_overhead(self, key: str) -> float | None:
        """The coordinator's measured share of a token, or None."""
        data = self._read(f"overhead-{key}.json")
        try:
            return float(data["overhead_s"]) if data is not None else None
        except (KeyError, TypeError, ValueError):
            return None

    def save_overhead(self, key: str, seconds: float) -> None:
        """Store the coordinator's share of a token."""
        self._write(f"overhead-{key}.json", {"overhead_s": seconds, "measured_at": time.time()})

    def _read(self, name: str) -> dict[str, Any] | None:
        try:
            data = json.loads((self.root / name).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def _write(self, name: str, data: dict[str, Any]) -> None:
        # Atomic, so a reader never sees half a file; best effort: an entry that was not written is measured again.
        partial = self.root / f".{name}.{os.getpid()}.partial"
        with contextlib.suppress(OSError):
            self.root.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps(data))
            partial.replace(self.root / name)


def cut_model(source: Path, layers: int, folder: Path) -> Path:
    """A copy of ``source`` with only its first ``layers`` blocks (written once, atomically)."""
    target = folder / f"{model_fingerprint(source)}-{layers}.gguf"
    if target.is_file():
        return target
    partial = folder / f".{target.name}.{os.getpid()}.partial"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _write_cut(source, layers, partial)
        partial.replace(target)
    except OSError as exc:
        raise ProfileError(f"cannot write a cut copy of {source.name} into {folder}: {exc}",
                           "fix: free disk space there or set $GGML_CLUSTER_CACHE_DIR") from None
    finally:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
    return target


def _write_cut(source: Path, layers: int, path: Path) -> None:
    layout = read_layout(source)
    total = int(str(layout.get(f"{layout.get('general.architecture')}.block_count", 0)))
    if not 0 < layers <= total:
        raise ProfileError(f"cannot cut {source.name} to {layers} layers: it has {total}")
    write_cut(layout, layers, path)


def one_hot(n: int, index: int, layers: int) -> tuple[int, ...]:
    """Layer counts with all ``layers`` on endpoint ``index``."""
    return tuple(layers if i == index else 0 for i in range(n))


def fit_node(model: ModelFacts, seconds: tuple[float, float], quiet: tuple[float, float], depths: tuple[int, int],
             samples: int, *, difference_se: float = 0.0, round_trip_s: float = 0.0) -> NodeProfile:
    """Fixed cost, per-byte slope and output cost from the two timed depths (pure).

    ``seconds`` are whole tokens as served; ``quiet`` the same steps without logits, which llama.cpp sends off
    without waiting for the node (it reads nothing back): their time is a step's dispatch and the coordinator's
    own work. The node's fixed cost adds its link's ``round_trip_s``, which every token waits once on each node
    that holds layers (for the next node's input, or for the token). The slope comes from the whole tokens of the
    two depths (``difference_se``: the standard error of the mean of their per-token differences); what is left
    of a whole token at the low depth is the output layer's cost on this node (its read, what it sends, the
    sampling), measured on the same loaded layers instead of scaled by bytes.
    """
    low, high = depths
    fixed = quiet[0] + round_trip_s
    # With one depth, decode is taken to read every byte at one rate: the whole token less its fixed cost, per
    # byte of layers and output. That overcharges the layers wherever the output step waits on more than its bytes
    # (a slow link, sampling a large vocabulary), so with two depths it only bounds what noise hides.
    floor = max(0.0, seconds[0] - fixed) / max(1, sum(model.layer_bytes[:low]) + model.output_bytes)
    layer_bytes = sum(model.layer_bytes[low:high])
    difference, resolution = seconds[1] - seconds[0], RESOLVED_SE * difference_se
    if not (high > low and layer_bytes):
        per_byte = floor
    elif difference > resolution:
        per_byte = difference / layer_bytes
    else:  # lost in the noise: the layers cost no more than the difference it could hide
        per_byte = min(floor, resolution / layer_bytes)
    output = max(0.0, seconds[0] - fixed - per_byte * sum(model.layer_bytes[:low]))
    return NodeProfile(fixed_s=fixed, seconds_per_byte=per_byte, measured_at=time.time(), samples=samples,
                       output_s=output, round_trip_s=round_trip_s)


def fit_overhead(model: ModelFacts, first: NodeProfile, second: NodeProfile, pair_s: float, depth: int) -> float:
    """The coordinator's share of a token, from two nodes timed alone and together (pure).

    Alone, each node's time holds the coordinator's share and its own output layer; together, both once. The
    difference of such sums carries their output layers' noise (several ms a token for a large vocabulary), so the
    share is bounded by what it is part of: either node's step without its link's round trip. Above that bound it
    would leave a node's fixed cost less than its link, and a boundary between nodes would look free.
    """
    alone = first.fixed_s + second.fixed_s + (first.seconds_per_byte + second.seconds_per_byte) * sum(
        model.layer_bytes[:depth]) + first.output_s + second.output_s
    ceiling = min(first.fixed_s - first.round_trip_s, second.fixed_s - second.round_trip_s)
    return max(0.0, min(ceiling, alone - pair_s - first.output_s))


def node_speed(model: ModelFacts, profile: NodeProfile | None, overhead_s: float) -> NodeSpeed:
    """The planner's cost model of a node: fixed cost without the coordinator's share or the output layer.

    A node without a profile could not hold a single layer; it can never be chosen.
    """
    if profile is None:
        return NodeSpeed(fixed_s=math.inf, per_layer_s=0.0)
    mean_layer = sum(model.layer_bytes) / model.n_layers
    return NodeSpeed(fixed_s=max(0.0, profile.fixed_s - overhead_s),
                     per_layer_s=profile.seconds_per_byte * mean_layer, output_s=profile.output_s)


@dataclass(frozen=True)
class Target:
    """A node to measure: its worker's endpoint, its cache key, the bytes it may hold and its link's round trip
    (probed on the coordinator's path; 0 when unknown)."""

    name: str
    endpoint: str
    key: str
    usable: int
    round_trip_s: float = 0.0


@dataclass(frozen=True)
class Profiles:
    """Every node's profile (None: it cannot hold a layer) and the coordinator's share of a token."""

    nodes: dict[str, NodeProfile | None]
    overhead_s: float
    measured: tuple[str, ...]  # nodes timed now rather than read from the cache

    def speeds(self, model: ModelFacts, names: Sequence[str]) -> list[NodeSpeed]:
        """The planner's cost model of each named node."""
        return [node_speed(model, self.nodes.get(name), self.overhead_s) for name in names]


async def measure(model: ModelFacts, targets: Sequence[Target], cache: ProfileCache, overhead_key: str,
                  log_path: Path, *, threads: int = 1, refresh: bool = False, sampling: str = "node") -> Profiles:
    """Profiles of ``targets`` from the cache, timing the missing ones (all of them with ``refresh``), tokens
    sampled as ``sampling`` says (inventory ``sampling``: node or coordinator; the targets' keys tell them apart)."""
    nodes: dict[str, NodeProfile | None] = {}
    if not refresh:
        nodes = {target.name: profile for target in targets if (profile := cache.load(target.key)) is not None}
    overhead = None if refresh else cache.load_overhead(overhead_key)
    depths = {target.name: depths_for(model, target.usable) for target in targets}
    for target in targets:
        if depths[target.name] is None:
            nodes[target.name] = None
    todo = [index for index, target in enumerate(targets) if target.name not in nodes]
    endpoints = [target.endpoint for target in targets]
    low = min(DEPTHS[0], model.n_layers)
    cut_folder = cache.root / "models"
    if todo:
        wanted = sorted({depth for index in todo for depth in depths[targets[index].name] or ()})
        cut = {depth: str(await asyncio.to_thread(cut_model, model.path, depth, cut_folder)) for depth in wanted}
        # One layout when both depths are the same: the node may hold only that one copy.
        jobs = [Job(tuple(Layout(cut[depth], one_hot(len(targets), index, depth))
                          for depth in dict.fromkeys(depths[targets[index].name] or ())))
                for index in todo]
        answers = await run_jobs(endpoints, jobs, threads, log_path, timeout=JOB_TIMEOUT_S * len(jobs),
                                 sampling=sampling)
        for answer, index in zip(answers, todo, strict=True):
            target = targets[index]
            node_depths = depths[target.name] or (low, low)
            full, quiet = answer.seconds, answer.quiet
            profile = fit_node(model, (full[0], full[-1]), (quiet[0], quiet[-1]), node_depths, TIMED_TOKENS,
                               difference_se=answer.difference_se, round_trip_s=target.round_trip_s)
            cache.save(target.key, profile)
            nodes[target.name] = profile
    timed = [index for index, target in enumerate(targets) if nodes.get(target.name) is not None]
    if overhead is None and len(timed) > 1 and 2 * low <= model.n_layers:
        # The two steadiest nodes (least time alone): a slow or throttled one would bury the coordinator's share.
        def alone(index: int) -> float:
            profile = nodes[targets[index].name]
            assert profile is not None
            return profile.fixed_s + profile.seconds_per_byte * sum(model.layer_bytes[:low]) + profile.output_s

        first, second = sorted(sorted(timed, key=alone)[:2])
        counts = [0] * len(targets)
        counts[first] = counts[second] = low
        pair_model = str(await asyncio.to_thread(cut_model, model.path, 2 * low, cut_folder))
        [pair] = await run_jobs(endpoints, [Job((Layout(pair_model, tuple(counts)),))], threads, log_path,
                                JOB_TIMEOUT_S, sampling=sampling)
        [pair_s] = pair.seconds
        first_profile, second_profile = nodes[targets[first].name], nodes[targets[second].name]
        assert first_profile is not None and second_profile is not None
        overhead = fit_overhead(model, first_profile, second_profile, pair_s, low)
        cache.save_overhead(overhead_key, overhead)
    return Profiles(nodes, overhead or 0.0, tuple(targets[index].name for index in todo))


@dataclass(frozen=True)
class Timed:
    """One job's answer: mean seconds per step of each layout, whole and without logits, and the standard error
    of its first and last layouts' difference."""

    seconds: list[float]
    quiet: list[float]
    difference_se: float


async def run_jobs(endpoints: Sequence[str], jobs: Sequence[Job], threads: int, log_path: Path,
                   timeout: float, *, sampling: str = "node") -> list[Timed]:
    """Mean seconds per token of each layout of each job: whole tokens, and the same steps without logits.

    Each job runs in a child of its own that connects only to the workers its layouts use, so all of them load
    at once (a load is mostly transfer and set-up, and a worker serves one client at a time); then they are
    timed one after another, so that no job's timed steps compete with another's for a shared machine.
    """
    children = [_JobChild(endpoints, job, threads, sampling) for job in jobs]
    try:
        async with asyncio.timeout(timeout):
            with log_path.open("ab") as log:
                for job_child in children:
                    await job_child.start(log)
            await asyncio.gather(*(job_child.answer("loaded", log_path) for job_child in children))
            results = []
            for job_child in children:
                job_child.release()
                answer = await job_child.answer("seconds", log_path)
                results.append(Timed([float(value) for value in answer["seconds"]],
                                     [float(value) for value in answer["quiet"]],
                                     float(answer.get("difference_se", 0.0))))
    except TimeoutError:
        raise ProfileError(f"profiling took longer than {timeout:g}s", f"see {log_path}") from None
    finally:
        for job_child in children:
            await job_child.stop()
    return results


class _JobChild:
    """One job's child process: it loads its layouts, says so, and times them when released."""

    def __init__(self, endpoints: Sequence[str], job: Job, threads: int, sampling: str) -> None:
        used = [index for index in range(len(endpoints)) if any(layout.counts[index] for layout in job.layouts)]
        self.config = {"endpoints": [endpoints[index] for index in used], "threads": threads, "sampling": sampling,
                       "job": [{"model": layout.model, "counts": [layout.counts[index] for index in used]}
                               for layout in job.layouts]}
        self.process: asyncio.subprocess.Process | None = None

    async def start(self, log: IO[bytes]) -> None:
        self.process = await child.start("core.engine.timing", json.dumps(self.config), log, stdin=True)

    async def answer(self, key: str, log_path: Path) -> dict[str, Any]:
        """The child's next protocol line that carries ``key``."""
        assert self.process is not None and self.process.stdout is not None
        async for line in self.process.stdout:
            try:
                answer = json.loads(line)
            except json.JSONDecodeError:
                continue  # not ours: llama.cpp writes to stdout on some paths
            if not isinstance(answer, dict):
                continue
            if "error" in answer:
                raise ProfileError(f"profiling failed: {answer['error']}", f"see {log_path}")
            if key in answer:
                return answer
        code = await self.process.wait()
        raise ProfileError(f"the profiler exited with {code} before it was done (a worker went away?)",
                           f"see {log_path}")

    def release(self) -> None:
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(b"go\n")

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()
