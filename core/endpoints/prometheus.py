"""The Prometheus endpoint: a snapshot of the cluster as metric families, served over HTTP."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from prometheus_client import make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector, CollectorRegistry

from core.endpoints.auth import bearer_matches
from core.listener import open_clear_of
from core.status import ClusterStatus, CoordinatorState, NodeState

_PREFIX = "ggml_cluster"


# How a node's speed profile was taken (NodeStatus.profile_source): by the profiler, or corrected from live times.
PROFILE_SOURCES = ("timed", "live")


def families(status: ClusterStatus, now: float | None = None) -> list[Metric]:
    """The snapshot as Prometheus metric families: cluster-wide series and one series per node; ``now`` (epoch
    seconds, default the time of the call) is what the nodes' profile ages are measured to."""
    now = time.time() if now is None else now
    cluster = [status.cluster]

    def gauge(name: str, doc: str, value: float | None, labels: dict[str, str] | None = None) -> GaugeMetricFamily:
        labels = {"cluster": status.cluster, **(labels or {})}
        family = GaugeMetricFamily(f"{_PREFIX}_{name}", doc, labels=list(labels))
        if value is not None:
            family.add_metric(list(labels.values()), value)
        return family

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(f"{_PREFIX}_{name}", doc, labels=["cluster"])
        family.add_metric(cluster, value)
        return family

    result: list[Metric] = [
        gauge("up_since_seconds", "When the controller started (Unix time).", status.started_at),
        gauge("requests_in_flight", "Requests generating or queued.", status.requests_in_flight),
        gauge("slots", "Requests generated at once.", status.slots),
        gauge("slots_busy", "Slots generating now.", status.slots_busy),
        gauge("queue_length", "Requests waiting for a slot.", status.queue_length),
        gauge("queue_limit", "Requests that may wait for a slot (api.queue); one more is refused.",
              status.queue_limit),
        counter("requests_deferred", "Requests that waited for a slot.", status.requests_deferred),
        counter("requests_rejected", "Requests refused because the queue was full (503).", status.requests_rejected),
        counter("prompt_tokens_shared", "Prompt tokens copied from another request's KV cells instead of evaluated.",
                status.prompt_tokens_shared),
        counter("requests_sampled_on_coordinator", "Requests sampled from the whole vocabulary's logits on the "
                "coordinator instead of on the node that holds the output layer.",
                status.requests_sampled_on_coordinator),
        counter("completion_tokens", "Tokens generated.", status.completion_tokens),
        counter("completion_tokens_batched", "Tokens generated in a decode step that carried another request's too.",
                status.completion_tokens_batched),
        counter("tokens_drafted", "Tokens drafted and verified in a decode step (speculative decoding).",
                status.tokens_drafted),
        counter("tokens_accepted", "Drafted tokens the model chose too: tokens that took no decode step of their own.",
                status.tokens_accepted),
        gauge("decode_tokens_per_second", "Decode rate of the running request, else of the last one.",
              status.decode_tokens_per_s),
        gauge("aggregate_decode_tokens_per_second", "Decode rate of every request generating now, together.",
              status.aggregate_decode_tokens_per_s),
        gauge("prompt_tokens_per_second", "Prompt rate of the last request.", status.prompt_tokens_per_s),
        gauge("predicted_token_seconds", "Time per token the plan predicts.",
              None if status.predicted_ms is None else status.predicted_ms / 1000),
    ]
    coordinator = GaugeMetricFamily(f"{_PREFIX}_coordinator_state", "1 for the coordinator's current state.",
                                    labels=["cluster", "state"])
    for each in CoordinatorState:
        coordinator.add_metric([*cluster, str(each)], float(each == status.coordinator.state))
    result += [coordinator, counter("requests", "Requests served.", status.requests_served),
               counter("recoveries", "Requests resumed after a fault.", status.recoveries)]

    labels = ["cluster", "node"]
    state = GaugeMetricFamily(f"{_PREFIX}_node_state", "1 for the node's current state.",
                              labels=[*labels, "state"])
    source = GaugeMetricFamily(f"{_PREFIX}_node_profile_source", "1 for how the node's speed profile was taken: "
                               "timed by the profiler, or live: corrected from the relay's times.",
                               labels=[*labels, "source"])
    per_node: dict[str, tuple[str, bool]] = {  # name: (help, is a counter)
        "layers": ("Layers the node holds.", False),
        "restarts": ("Worker restarts.", True),
        "computes": ("Graph computes sent to the node.", True),
        "recomputes": ("Graph re-computes sent to the node.", True),
        "sent_bytes": ("RPC bytes sent to the node.", True),
        "received_bytes": ("RPC bytes received from the node.", True),
        "compute_seconds": ("Time per token spent on the node (moving average).", False),
        "predicted_compute_seconds": ("The node's share of a token that the running plan predicts.", False),
        "live_compute_seconds": ("Median of the node's latest computes under the running plan (its share of a "
                                 "token now).", False),
        "drift_ratio": ("The node's live time against the plan's prediction, as a fraction (0.3: 30% slower).", False),
        "rtt_seconds": ("A request's round trip to the node's worker, probed before each plan: its link.", False),
        "profile_age_seconds": ("How old the node's speed profile is.", False),
        "cpu_percent": ("The worker's CPU use (100 = one core).", False),
        "resident_bytes": ("The worker's resident memory.", False),
        "memory_bytes": ("The node's memory for the worker (device memory on GPU nodes).", False),
        "gpu_utilization_percent": ("GPU busy, mean over the node's GPUs.", False),
        "gpu_memory_used_bytes": ("GPU memory in use, summed over the node's GPUs.", False),
        "compute_failures": ("Failed graph computes the node's worker reported (patched workers).", True),
        "compute_retries": ("Steps retried in place after the node's failed computes, that then succeeded.", True),
        "compute_retry_seconds": ("Time those retries took, failure seen to the retried step's logits.", True),
    }
    made = {name: (CounterMetricFamily if counter else GaugeMetricFamily)(f"{_PREFIX}_node_{name}", doc, labels=labels)
            for name, (doc, counter) in per_node.items()}
    for node in status.nodes:
        key = [status.cluster, node.name]
        for node_state in NodeState:
            state.add_metric([*key, str(node_state)], float(node_state == node.state))
        if node.profiled_at is not None:  # a node never profiled has no source to show
            for how in PROFILE_SOURCES:
                source.add_metric([*key, how], float(how == node.profile_source))
        values: dict[str, float | None] = {
            "layers": 0 if node.layers is None else node.layers[1] - node.layers[0] + 1,
            "restarts": node.restarts,
            "compute_seconds": None if node.compute_ms is None else node.compute_ms / 1000,
            "cpu_percent": node.cpu_percent, "resident_bytes": node.rss, "memory_bytes": node.mem_total or None,
            "gpu_utilization_percent": node.gpu_percent, "gpu_memory_used_bytes": node.gpu_mem_used,
            "predicted_compute_seconds": None if node.predicted_ms is None else node.predicted_ms / 1000,
            "live_compute_seconds": None if node.live_ms is None else node.live_ms / 1000,
            "drift_ratio": node.drift,
            "rtt_seconds": None if node.rtt_ms is None else node.rtt_ms / 1000,
            # never negative, should the clock have stepped back since the profile was stamped
            "profile_age_seconds": None if node.profiled_at is None else max(0.0, now - node.profiled_at),
        }
        if node.compute_status or node.compute_failures:  # a stock worker aborts instead of reporting
            values.update(compute_failures=node.compute_failures, compute_retries=node.compute_retries,
                          compute_retry_seconds=node.compute_retry_ms_total / 1000)
        if node.link != "direct":  # no relay in front of a direct node: its traffic is not counted
            values.update(computes=node.computes, recomputes=node.recomputes, sent_bytes=node.bytes_to,
                          received_bytes=node.bytes_from)
        for name, value in values.items():
            if value is not None:
                made[name].add_metric(key, float(value))
    return [*result, state, source, *made.values()]


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


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """A line per scrape on stderr would fill the controller's log."""


def _guarded(app: WSGIApplication, key: str) -> WSGIApplication:
    """``app`` for requests that carry the API key as a Bearer token; 401 for the rest."""
    def guarded(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if bearer_matches(environ.get("HTTP_AUTHORIZATION", ""), key):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("WWW-Authenticate", "Bearer"),
                                            ("Content-Type", "text/plain; charset=utf-8")])
        return [b"the metrics endpoint needs the API key: send 'Authorization: Bearer <key>'\n"]
    return guarded


def serve_metrics(host: str, port: int, snapshot: Callable[[], ClusterStatus],
                  loop: asyncio.AbstractEventLoop, key: str | None, *,
                  reserved: Collection[int] = ()) -> MetricsServer:
    """Serve /metrics on host:port (port 0: one the kernel picks, none of ``reserved``); with ``key``, only to
    requests that send it as a Bearer token. Snapshots are taken on ``loop`` (the controller's state lives there).
    Raises OSError when it cannot listen."""

    def on_loop() -> ClusterStatus:
        async def take() -> ClusterStatus:
            return snapshot()
        return asyncio.run_coroutine_threadsafe(take(), loop).result(timeout=10)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(on_loop))
    app = make_wsgi_app(registry)
    # As prometheus_client's start_http_server, with the key checked in front: the family the address needs
    # (an IPv6 host), a thread per scrape.
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    server_class = type("MetricsHTTPServer", (ThreadingWSGIServer,), {"address_family": family})
    served = app if key is None else _guarded(app, key)
    server: WSGIServer = open_clear_of(
        reserved if port == 0 else (),
        lambda: make_server(str(address[0]), port, served, server_class, handler_class=_QuietHandler),
        lambda server: server.server_port, WSGIServer.server_close)
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    return MetricsServer(server, thread)
