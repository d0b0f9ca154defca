"""Node metrics (the worker's CPU, memory and GPU use, sampled on its node) and the Prometheus exposition."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from core.nodes.probe import Gpu, make_script, parse_nvidia_smi_csv, parse_rocm_smi_csv, split_sections
from core.nodes.remote import shell_command
from core.status import ClusterStatus, CoordinatorState, NodeState

NVIDIA_USE_FIELDS = ("index", "name", "memory.total", "memory.free", "utilization.gpu")


@dataclass(frozen=True)
class Sample:
    """One reading of a worker process on its node."""

    pid: int
    cpu_s: float | None   # CPU time the process has used since it started
    rss: int | None       # resident memory, bytes
    gpus: tuple[Gpu, ...] = ()


def sample_command(workdir: str, backend: str) -> str:
    """A POSIX sh script that reads the worker's pid file and prints its usage in ``==name==`` sections.

    Linux gives CPU time in clock ticks (/proc, 10 ms resolution); elsewhere (macOS) `ps` gives it to the
    hundredth of a second. GPU tools are asked only on nodes whose worker uses that GPU.
    """
    sections = [
        ("pid", "echo $pid"),
        # Shell builtins where they do: the sample runs every few seconds, next to the decode's threads.
        ("proc", 'read -r stat < /proc/$pid/stat && echo "$stat" && getconf CLK_TCK && '
                 'while read -r key value unit; do [ "$key" = VmRSS: ] && echo "$key $value $unit"; '
                 "done < /proc/$pid/status"),
        ("ps", "[ -r /proc/$pid/stat ] || ps -o rss=,time= -p $pid"),
    ]
    if backend == "cuda":
        sections.append(("nvidia-smi", f"nvidia-smi --query-gpu={','.join(NVIDIA_USE_FIELDS)} "
                                        "--format=csv,noheader,nounits"))
    elif backend == "rocm":
        sections.append(("rocm-smi", "rocm-smi --showuse --showmeminfo vram --csv"
                                     " || /opt/rocm/bin/rocm-smi --showuse --showmeminfo vram --csv"))
    folder = shell_command([workdir])
    # `read`, not $(cat …): no subshell and no process of its own next to the decode. Its status is
    # ignored: a pid file without a final newline still sets the variable. The file is "PID START".
    return (f'pid=; {{ read -r pid _ < {folder}/worker.pid; }} 2>/dev/null; [ -n "$pid" ] || exit 0\n'
            f'{make_script(sections)}')


def parse_sample(text: str) -> Sample | None:
    """The sample script's output as a Sample; None when no worker was running."""
    sections = split_sections(text)
    pid = sections.get("pid", "").strip()
    if not pid.isdigit():
        return None
    cpu_s, rss = parse_proc(sections.get("proc", ""))
    if cpu_s is None and rss is None:
        cpu_s, rss = parse_ps(sections.get("ps", ""))
    gpus = (parse_nvidia_smi_csv(sections.get("nvidia-smi", ""), NVIDIA_USE_FIELDS)
            + parse_rocm_smi_csv(sections.get("rocm-smi", "")))
    return Sample(int(pid), cpu_s, rss, gpus)


def parse_proc(text: str) -> tuple[float | None, int | None]:
    """CPU seconds and resident bytes from `/proc/PID/stat`, `getconf CLK_TCK` and the VmRSS line."""
    lines = text.splitlines()
    if len(lines) < 2:
        return None, None
    # The command name (field 2) is in parentheses and may hold spaces; count fields after its last ")".
    fields = lines[0].rpartition(")")[2].split()
    ticks = lines[1].strip()
    cpu_s = None
    if len(fields) > 12 and ticks.isdigit() and int(ticks) > 0:
        cpu_s = (int(fields[11]) + int(fields[12])) / int(ticks)  # utime + stime (fields 14 and 15)
    rss = None
    for line in lines[2:]:
        match = re.fullmatch(r"VmRSS:\s+(\d+)\s+kB", line.strip())
        if match:
            rss = int(match.group(1)) * 1024
    return cpu_s, rss


def parse_ps(text: str) -> tuple[float | None, int | None]:
    """CPU seconds and resident bytes from `ps -o rss=,time=` (BSD ``M:SS.hh`` or procps ``[D-]HH:MM:SS``)."""
    match = re.fullmatch(r"(\d+)\s+(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+(?:\.\d+)?)", text.strip())
    if not match:
        return None, None
    rss_kib, days, hours, minutes, seconds = match.groups()
    cpu_s = ((int(days or 0) * 24 + int(hours or 0)) * 60 + int(minutes)) * 60 + float(seconds)
    return cpu_s, int(rss_kib) * 1024


def cpu_percent(before: Sample, after: Sample, seconds: float) -> float | None:
    """The worker's CPU use between two samples ``seconds`` apart (100 = one core busy); None across a restart."""
    if before.pid != after.pid or before.cpu_s is None or after.cpu_s is None or seconds <= 0:
        return None
    return max(0.0, (after.cpu_s - before.cpu_s) / seconds * 100)


@dataclass(frozen=True)
class Usage:
    """What a node's status shows of its worker (the NodeStatus fields of the same names)."""

    cpu_percent: float | None = None
    rss: int | None = None
    gpu_percent: float | None = None   # mean over the node's GPUs
    gpu_mem_used: int | None = None    # summed over them
    gpu_mem_total: int | None = None


def usage(before: Sample | None, after: Sample | None, seconds: float) -> Usage:
    """The worker's use from its latest sample (and the one ``seconds`` before it, for CPU)."""
    if after is None:
        return Usage()
    busy = [gpu.utilization for gpu in after.gpus if gpu.utilization is not None]
    known = [(gpu.memory_total, gpu.memory_free) for gpu in after.gpus
             if gpu.memory_total is not None and gpu.memory_free is not None]
    return Usage(cpu_percent=cpu_percent(before, after, seconds) if before else None, rss=after.rss,
                 gpu_percent=sum(busy) / len(busy) if busy else None,
                 gpu_mem_used=sum(total - free for total, free in known) if known else None,
                 gpu_mem_total=sum(total for total, _ in known) if known else None)


# --- Prometheus --------------------------------------------------------------------------------------

_PREFIX = "ggml_cluster"


def families(status: ClusterStatus) -> list[Metric]:
    """The snapshot as Prometheus metric families: cluster-wide series and one series per node."""
    cluster = [status.cluster]

    def gauge(name: str, doc: str, value: float | None, labels: dict[str, str] | None = None) -> GaugeMetricFamily:
        labels = {"cluster": status.cluster, **(labels or {})}
        family = GaugeMetricFamily(f"{_PREFIX}_{name}", doc, labels=list(labels))
        if value is not None:
            family.add_metric(list(labels.values()), value)
        return family

    result: list[Metric] = [
        gauge("up_since_seconds", "When the controller started (Unix time).", status.started_at),
        gauge("requests_in_flight", "Requests generating or queued.", status.requests_in_flight),
        gauge("decode_tokens_per_second", "Decode rate of the running request, else of the last one.",
              status.decode_tokens_per_s),
        gauge("prompt_tokens_per_second", "Prompt rate of the last request.", status.prompt_tokens_per_s),
        gauge("predicted_token_seconds", "Time per token the plan predicts.",
              None if status.predicted_ms is None else status.predicted_ms / 1000),
    ]
    coordinator = GaugeMetricFamily(f"{_PREFIX}_coordinator_state", "1 for the coordinator's current state.",
                                    labels=["cluster", "state"])
    for each in CoordinatorState:
        coordinator.add_metric([*cluster, str(each)], float(each == status.coordinator.state))
    served = CounterMetricFamily(f"{_PREFIX}_requests", "Requests served.", labels=["cluster"])
    served.add_metric(cluster, status.requests_served)
    recoveries = CounterMetricFamily(f"{_PREFIX}_recoveries", "Requests resumed after a fault.", labels=["cluster"])
    recoveries.add_metric(cluster, status.recoveries)
    result += [coordinator, served, recoveries]

    labels = ["cluster", "node"]
    state = GaugeMetricFamily(f"{_PREFIX}_node_state", "1 for the node's current state.",
                              labels=[*labels, "state"])
    per_node: dict[str, tuple[str, bool]] = {  # name: (help, is a counter)
        "layers": ("Layers the node holds.", False),
        "restarts": ("Worker restarts.", True),
        "computes": ("Graph computes sent to the node.", True),
        "recomputes": ("Graph re-computes sent to the node.", True),
        "sent_bytes": ("RPC bytes sent to the node.", True),
        "received_bytes": ("RPC bytes received from the node.", True),
        "compute_seconds": ("Time per token spent on the node (moving average).", False),
        "cpu_percent": ("The worker's CPU use (100 = one core).", False),
        "resident_bytes": ("The worker's resident memory.", False),
        "memory_bytes": ("The node's memory for the worker (device memory on GPU nodes).", False),
        "gpu_utilization_percent": ("GPU busy, mean over the node's GPUs.", False),
        "gpu_memory_used_bytes": ("GPU memory in use, summed over the node's GPUs.", False),
    }
    made = {name: (CounterMetricFamily if counter else GaugeMetricFamily)(f"{_PREFIX}_node_{name}", doc, labels=labels)
            for name, (doc, counter) in per_node.items()}
    for node in status.nodes:
        key = [status.cluster, node.name]
        for node_state in NodeState:
            state.add_metric([*key, str(node_state)], float(node_state == node.state))
        values: dict[str, float | None] = {
            "layers": 0 if node.layers is None else node.layers[1] - node.layers[0] + 1,
            "restarts": node.restarts,
            "compute_seconds": None if node.compute_ms is None else node.compute_ms / 1000,
            "cpu_percent": node.cpu_percent, "resident_bytes": node.rss, "memory_bytes": node.mem_total or None,
            "gpu_utilization_percent": node.gpu_percent, "gpu_memory_used_bytes": node.gpu_mem_used,
        }
        if node.link != "direct":  # no relay in front of a direct node: its traffic is not counted
            values.update(computes=node.computes, recomputes=node.recomputes, sent_bytes=node.bytes_to,
                          received_bytes=node.bytes_from)
        for name, value in values.items():
            if value is not None:
                made[name].add_metric(key, float(value))
    return [*result, state, *made.values()]


class _SnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], ClusterStatus]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        yield from families(self._snapshot())


@dataclass
class MetricsServer:
    """The Prometheus endpoint: an HTTP server thread that asks the controller's loop for each snapshot."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def address(self) -> str:
        """host:port it listens on (the real port when 0 was asked for)."""
        host, port = self.server.server_address[:2]
        return f"{host!s}:{port}"

    def close(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()


def serve_metrics(host: str, port: int, snapshot: Callable[[], ClusterStatus],
                  loop: asyncio.AbstractEventLoop) -> MetricsServer:
    """Serve /metrics on host:port. Snapshots are taken on ``loop`` (the controller's state lives there)."""

    def on_loop() -> ClusterStatus:
        async def take() -> ClusterStatus:
            return snapshot()
        return asyncio.run_coroutine_threadsafe(take(), loop).result(timeout=10)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(on_loop))
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(server, thread)
