"""Cluster state as plain, JSON-serialisable data: what `status` shows and the controller publishes."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

DASHBOARD_PATH = "/dashboard/"  # the web dashboard's page on the API's port (core.endpoints.dashboard serves it)


class NodeState(StrEnum):
    """Where a node's worker is in its life."""

    PENDING = "pending"        # known from the inventory, not started yet
    CONNECTING = "connecting"  # reaching it over SSH and probing its hardware
    DEPLOYING = "deploying"    # getting a worker binary onto it (cached, pushed or built there)
    STARTING = "starting"      # process started, not yet answering HELLO
    READY = "ready"            # answered HELLO with the right protocol version
    RESTARTING = "restarting"  # exited; the supervisor is restarting it
    RECONNECTING = "reconnecting"  # the connection to its node was lost; its worker may run on
    FAILED = "failed"          # crash loop or unrecoverable error; excluded, tried again later (retry_at)
    STOPPED = "stopped"


class CoordinatorState(StrEnum):
    """Where the coordinator (llama-cpp-python process) is in its life."""

    STOPPED = "stopped"
    LOADING = "loading"
    READY = "ready"
    GENERATING = "generating"
    FAILED = "failed"


@dataclass
class Event:
    """Something that happened, for the event log and the dashboard."""

    time: float
    kind: str
    message: str
    node: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return asdict(self)


@dataclass
class SessionStatus:
    """The coordinator's latest connection to a node's worker, as its relay saw it go by (none for a direct node).

    ``commands`` and ``digest`` leave out COMPUTE_STATUS (the opt-in that only a patched client sends, once), so
    two runs that sent the worker the same requests in the same order have the same digest with the compute
    status negotiated or not; ``counts`` has it."""

    commands: int = 0                 # requests on this connection
    digest: str = ""                  # blake2b-64 (hex) of their command bytes, in order
    counts: dict[str, int] = field(default_factory=dict)  # requests by command name
    bytes_to: int = 0                 # coordinator → worker on this connection
    bytes_from: int = 0               # worker → coordinator


@dataclass
class NodeStatus:
    """One node as the controller sees it."""

    name: str
    host: str
    kind: str
    rpc_port: int
    arch: str = ""
    backend: str = ""
    state: NodeState = NodeState.PENDING
    layers: tuple[int, int] | None = None  # [first, last] inclusive, None when the node holds none
    mem_total: int = 0
    mem_free: int = 0
    mem_cap: int | None = None      # the inventory's `memory:`, bytes: the most the planner uses there (None: no cap)
    restarts: int = 0
    pid: int | None = None
    last_status: str = ""
    last_error: str = ""
    failures: int = 0               # failed tries in a row (0 once ready again)
    retry_at: float | None = None   # when a failed node is tried again (epoch seconds)
    detail: str = ""                # backend choice and how the worker got there
    # The backend's device the worker serves, as the worker names it; a software one says so, e.g. "llvmpipe (LLVM
    # 15.0.6, 256 bits) (software Vulkan)". "" for a CPU worker (and until the worker's devices were listed).
    device: str = ""
    progress: float | None = None   # of the current deployment step, 0..1
    fixed_ms: float | None = None     # measured cost per token of using this node at all
    layer_ms: float | None = None     # measured cost per token of one (mean-sized) layer here
    output_ms: float | None = None    # measured cost per token of the output layer here
    predicted_ms: float | None = None  # this node's predicted share of a token under the current plan
    profiled_at: float | None = None  # when the profile behind those numbers was measured (epoch seconds)
    profile_source: str = ""          # timed (by the profiler) | live (corrected from the relay's times)
    rtt_ms: float | None = None       # a request's round trip to its worker (probed before each plan): its link
    live_ms: float | None = None      # measured under the running plan: the median of its latest computes
    drift: float | None = None        # live_ms against predicted_ms, as a fraction (+0.3: 30 % slower)
    computes: int = 0                 # graph computes the coordinator sent it (seen by the relay; none direct)
    recomputes: int = 0               # re-runs of a graph it already holds
    bytes_to: int = 0
    bytes_from: int = 0
    compute_ms: float | None = None   # measured: GRAPH_COMPUTE to its answer, moving average
    compute_ms_total: float = 0.0     # the sum of those times, and how many: a mean over any window
    computes_timed: int = 0
    link: str = ""                    # the coordinator's connection: connected | idle | direct (not observed)
    connections: int = 0              # coordinator connections the relay has carried (a reconnect adds one)
    endpoint: str = ""                # the worker as the controller reaches it (an SSH forward, or direct)
    cpu_percent: float | None = None  # the worker process, sampled on its node (100 = one core)
    rss: int | None = None            # the worker's resident memory, bytes
    gpu_percent: float | None = None  # GPU busy, mean over the node's GPUs (GPU backends only)
    gpu_mem_used: int | None = None   # GPU memory in use on the node, bytes
    gpu_mem_total: int | None = None
    session: SessionStatus | None = None  # the coordinator's latest connection to it (seen by the relay)
    # Patched workers report a failed graph compute on their next answer, and the coordinator retries the step in
    # place; stock ones (e.g. `build: {path}`) abort instead. None: not probed yet.
    compute_status: bool | None = None
    compute_failures: int = 0         # failed graph computes it reported (each report may cover several)
    compute_retries: int = 0          # steps retried in place after its failures that then succeeded
    compute_retry_ms_total: float = 0.0  # their time, failure seen to the retried step's logits, summed
    last_compute_failure: str = ""    # the latest, e.g. "device 0: GGML_STATUS_FAILED (-1)"
    last_compute_failure_at: float | None = None  # when (epoch seconds)

    @property
    def left_out(self) -> bool:
        """Failed, or being tried again after failing: no plan counts on it until it is ready again."""
        return self.state == NodeState.FAILED or (self.failures > 0 and self.state != NodeState.READY)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        data = asdict(self)
        data["state"] = str(self.state)
        data["layers"] = list(self.layers) if self.layers else None
        return data


@dataclass
class CoordinatorStatus:
    """The coordinator as the controller sees it."""

    state: CoordinatorState = CoordinatorState.STOPPED
    endpoint: str = ""
    pid: int | None = None
    restarts: int = 0
    last_error: str = ""
    progress: str = ""  # what it is evaluating before the next token: a long prompt, a replay

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        data = asdict(self)
        data["state"] = str(self.state)
        return data


@dataclass
class ClusterStatus:
    """A snapshot of the whole cluster."""

    cluster: str
    model: str
    coordinator: CoordinatorStatus
    nodes: list[NodeStatus]
    events: list[Event] = field(default_factory=list)
    n_layers: int = 0
    tensor_split: list[float] = field(default_factory=list)
    controller_pid: int | None = None
    started_at: float = field(default_factory=time.time)
    requests_served: int = 0
    strategy: str = ""
    predicted_ms: float | None = None  # per token under the current plan, when the nodes were measured
    overhead_ms: float | None = None   # the coordinator's own share of a token, measured with the nodes
    requests_in_flight: int = 0        # generating, or waiting for the one that is
    recoveries: int = 0                # requests resumed after a fault, since the controller started
    prompt_tokens_per_s: float | None = None  # of the last request
    decode_tokens_per_s: float | None = None  # of the running request, else of the last one
    aggregate_decode_tokens_per_s: float = 0.0  # of every request generating now, together
    request_decode_tokens_per_s: list[float] = field(default_factory=list)  # each request generating now, oldest first
    slots: int = 1                     # requests generated at once
    slots_busy: int = 0                # of them, generating now
    queue_length: int = 0              # requests waiting for a slot
    queue_limit: int = 0               # api.queue: how many may wait; one more is refused (503, `run` exit 1)
    requests_deferred: int = 0         # requests that waited for a slot, since the controller started
    requests_rejected: int = 0         # requests refused because the queue was full
    prompt_tokens_shared: int = 0      # prompt tokens copied from another request's KV cells instead of evaluated
    # requests sampled from the whole vocabulary's logits on the coordinator, not where the output layer is
    # (inventory sampling: coordinator, or a request that needs the logits: a JSON schema, top_k 0)
    requests_sampled_on_coordinator: int = 0
    completion_tokens: int = 0         # tokens generated, since the controller started
    completion_tokens_batched: int = 0  # of them, decoded in a step that carried another sequence's tokens too
    tokens_drafted: int = 0            # drafted and verified in a step (speculative decoding), of finished requests
    tokens_accepted: int = 0           # of them, kept: tokens that took no step of their own
    metrics_endpoint: str = ""         # host:port of the Prometheus endpoint, when it serves
    api_endpoint: str = ""             # host:port of the OpenAI-compatible API, when it serves

    @property
    def dashboard_url(self) -> str:
        """The web dashboard's address: served on the API's port, so "" while the API does not serve."""
        if not self.api_endpoint:
            return ""
        host, _, port = self.api_endpoint.rpartition(":")
        return f"http://{f'[{host}]' if ':' in host else host}:{port}{DASHBOARD_PATH}"

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON (`status --json`)."""
        data: dict[str, Any] = {
            "cluster": self.cluster,
            "model": self.model,
            "coordinator": self.coordinator.to_dict(),
            "nodes": [node.to_dict() for node in self.nodes],
            "events": [event.to_dict() for event in self.events],
            "n_layers": self.n_layers,
            "tensor_split": self.tensor_split,
            "controller_pid": self.controller_pid,
            "started_at": self.started_at,
            "requests_served": self.requests_served,
            "strategy": self.strategy,
            "predicted_ms": self.predicted_ms,
            "overhead_ms": self.overhead_ms,
            "requests_in_flight": self.requests_in_flight,
            "recoveries": self.recoveries,
            "prompt_tokens_per_s": self.prompt_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "aggregate_decode_tokens_per_s": self.aggregate_decode_tokens_per_s,
            "request_decode_tokens_per_s": self.request_decode_tokens_per_s,
            "slots": self.slots,
            "slots_busy": self.slots_busy,
            "queue_length": self.queue_length,
            "queue_limit": self.queue_limit,
            "requests_deferred": self.requests_deferred,
            "requests_rejected": self.requests_rejected,
            "prompt_tokens_shared": self.prompt_tokens_shared,
            "requests_sampled_on_coordinator": self.requests_sampled_on_coordinator,
            "completion_tokens": self.completion_tokens,
            "completion_tokens_batched": self.completion_tokens_batched,
            "tokens_drafted": self.tokens_drafted,
            "tokens_accepted": self.tokens_accepted,
            "metrics_endpoint": self.metrics_endpoint,
            "api_endpoint": self.api_endpoint,
        }
        data["dashboard_url"] = self.dashboard_url  # derived from api_endpoint: from_dict has nothing to read back
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterStatus:
        """Rebuild a snapshot received as JSON."""
        coordinator = dict(data["coordinator"])
        coordinator["state"] = CoordinatorState(coordinator["state"])
        nodes = []
        for raw in data["nodes"]:
            node = dict(raw)
            node["state"] = NodeState(node["state"])
            node["layers"] = tuple(node["layers"]) if node.get("layers") else None
            node["session"] = SessionStatus(**node["session"]) if node.get("session") else None
            nodes.append(NodeStatus(**node))
        return cls(
            cluster=data["cluster"],
            model=data["model"],
            coordinator=CoordinatorStatus(**coordinator),
            nodes=nodes,
            events=[Event(**event) for event in data.get("events", [])],
            n_layers=data.get("n_layers", 0),
            tensor_split=list(data.get("tensor_split", [])),
            controller_pid=data.get("controller_pid"),
            started_at=data.get("started_at", 0.0),
            requests_served=data.get("requests_served", 0),
            strategy=data.get("strategy", ""),
            predicted_ms=data.get("predicted_ms"),
            overhead_ms=data.get("overhead_ms"),
            requests_in_flight=data.get("requests_in_flight", 0),
            recoveries=data.get("recoveries", 0),
            prompt_tokens_per_s=data.get("prompt_tokens_per_s"),
            decode_tokens_per_s=data.get("decode_tokens_per_s"),
            aggregate_decode_tokens_per_s=data.get("aggregate_decode_tokens_per_s", 0.0),
            request_decode_tokens_per_s=list(data.get("request_decode_tokens_per_s", [])),
            slots=data.get("slots", 1),
            slots_busy=data.get("slots_busy", 0),
            queue_length=data.get("queue_length", 0),
            queue_limit=data.get("queue_limit", 0),
            requests_deferred=data.get("requests_deferred", 0),
            requests_rejected=data.get("requests_rejected", 0),
            prompt_tokens_shared=data.get("prompt_tokens_shared", 0),
            requests_sampled_on_coordinator=data.get("requests_sampled_on_coordinator", 0),
            completion_tokens=data.get("completion_tokens", 0),
            completion_tokens_batched=data.get("completion_tokens_batched", 0),
            tokens_drafted=data.get("tokens_drafted", 0),
            tokens_accepted=data.get("tokens_accepted", 0),
            metrics_endpoint=data.get("metrics_endpoint", ""),
            api_endpoint=data.get("api_endpoint", ""),
        )


def percent(drift: float) -> str:
    """A departure from the plan as `plan` and the dashboards show it: ``+12%``, ``-86%``."""
    return f"{drift:+.0%}"


def age(seconds: float) -> str:
    """An age as `plan` says it: ``45 s``, ``3 min``, ``2 h``, ``3 days``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} days"
