"""Load and validate the cluster inventory (YAML) into frozen models, with located one-line errors."""

from __future__ import annotations

import difflib
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, model_validator

from core.api_key import API_KEY_ENV, environment_key, is_loopback, read_api_key
from core.errors import InventoryError
from core.inventory_errors import SHORT, Locator, unconstructible, validate
from core.inventory_fields import (
    DRAFT_P_MIN,
    Environment,
    Host,
    Name,
    PathText,
    Port,
    Size,
    Slots,
    User,
    speculative_switch,
)

INVENTORY_ENV = "GGML_CLUSTER_INVENTORY"
DEFAULT_INVENTORY_FILE = "inventory.yaml"
EMBEDDED_SOURCE = "<embedded default>"
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})

Backend = Literal["auto", "cpu", "cuda", "rocm", "vulkan", "metal"]
# How layers are placed (the planner's strategies and objectives: the one list of them).
Strategy = Literal["compute", "memory", "equal"]
Objective = Literal["latency", "throughput"]
# llama-cpp-python's built-in chat formats: those that render a prompt (its function-calling handlers generate by
# themselves and are not formats). tests/test_coordinator.py checks the list against the pinned llama-cpp-python.
CHAT_FORMATS = ("alpaca", "baichuan", "baichuan-2", "chatglm3", "chatml", "gemma", "intel", "llama-2", "llama-3",
                "mistral-instruct", "mistrallite", "oasst_llama", "open-orca", "openbuddy", "openchat", "phind",
                "pygmalion", "qwen", "redpajama-incite", "saiga", "snoozy", "vicuna", "zephyr")
MAX_CHAT_TEMPLATE_BYTES = 1 << 20  # chat templates are a few KB; more is the wrong file


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BuildPath(_Frozen):
    """``build: {path: …}``: use an installed ggml-rpc-server."""

    path: PathText


Build = Literal["auto", "remote", "push"] | BuildPath


class NodeDefaults(_Frozen):
    """Fields that ``defaults:`` may set for every node."""

    kind: Literal["local", "ssh"] | None = None
    port: Port | None = None
    user: User | None = None
    identity: PathText | None = None
    rpc_port: Port | None = None
    threads: Annotated[int, Field(ge=1, le=1024, strict=True)] | None = None
    backend: Backend | None = None
    memory: Size | None = None
    workdir: PathText | None = None
    transport: Literal["ssh", "direct"] | None = None
    build: Build | None = None
    host_key: Literal["strict", "accept-new"] | None = None
    labels: dict[str, str] | None = None
    env: Environment | None = None


class Node(_Frozen):
    """One worker node. ``kind: local`` runs the worker on this machine without SSH."""

    name: Name
    kind: Literal["local", "ssh"] = "ssh"
    host: Host = ""
    port: Port | None = None  # None: ~/.ssh/config's Port for the host, else 22
    user: User | None = None
    identity: PathText | None = None
    rpc_port: Port = 50052
    threads: Annotated[int, Field(ge=1, le=1024, strict=True)] | None = None
    backend: Backend = "auto"
    memory: Size | None = None
    workdir: PathText | None = None
    transport: Literal["ssh", "direct"] = "ssh"
    build: Build = "auto"
    host_key: Literal["strict", "accept-new"] = "strict"
    labels: dict[str, str] = Field(default_factory=dict)
    # The worker process's environment (CUDA_VISIBLE_DEVICES, GGML_RPC_DEBUG, …): part of its command line,
    # so a change restarts it.
    env: Environment = Field(default_factory=dict)

    @model_validator(mode="after")
    def _host_for_kind(self) -> Node:
        if self.kind == "ssh" and not self.host:
            raise ValueError("an ssh node needs 'host' (an address or ~/.ssh/config alias); "
                             "or set 'kind: local' to run the worker on this machine")
        if self.kind == "ssh" and self.transport == "direct":
            try:
                ipaddress.ip_address(self.host)
            except ValueError:
                raise ValueError(f"transport: direct binds the worker to 'host', so it must be the node's IP "
                                 f"address on the private network, not {self.host!r}") from None
        return self

    @property
    def address(self) -> str:
        """The host that the worker's port lives on, for clash checks."""
        return "localhost" if self.kind == "local" or self.host in LOOPBACK_HOSTS else self.host


class Api(_Frozen):
    """Where the OpenAI-compatible HTTP API listens, who may use it, and how many requests it takes at once."""

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535, strict=True)] = 8080  # 0: any free port (`status` shows it)
    # A file that holds the API key (mode 0600, as ssh wants of a private key); else $GGML_CLUSTER_API_KEY.
    key_file: PathText | None = None
    # Requests that may wait for a slot; one more is refused at once (503 with Retry-After, `run` exits 1).
    queue: Annotated[int, Field(ge=0, le=4096, strict=True)] = 16
    # Requests generated at once (slots), each with its own KV cache of `context` tokens. auto: the most of 4, 2
    # and 1 whose KV cache fits with the model (core.planner.choose_slots), chosen at the first plan.
    parallel: Slots = "auto"


class DraftModelSpec(_Frozen):
    """``speculative: {draft_model: PATH}``: drafts from a small model with the model's vocabulary, run on this
    machine's CPU in the coordinator (core.engine.draft_model)."""

    draft_model: PathText
    # The draft model's CPU threads: it decodes between the cluster's steps, while this machine waits for nothing.
    threads: Annotated[int, Field(ge=1, le=1024, strict=True)] = 1
    # llama-server's --draft-p-min: a draft ends at a token the draft model gives less than this probability.
    p_min: Annotated[float, Field(ge=0, le=1)] = DRAFT_P_MIN


class Metrics(_Frozen):
    """The controller's Prometheus endpoint (GET /metrics)."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535, strict=True)] = 9464  # 0: any free port (`status` shows it)


class Inventory(_Frozen):
    """A validated cluster description."""

    cluster: Name
    model: PathText | None = None
    context: Annotated[int, Field(ge=64, le=1 << 20, strict=True)] = 2048
    # Seconds a request may go without progress before a worker counts as hung.
    watchdog: Annotated[int, Field(ge=1, le=3600, strict=True)] = 60
    # How layers are placed: by measured speed (compute), by free memory as llama.cpp does, or equally.
    strategy: Strategy = "compute"
    # compute: least time per token (one request at a time) or the least bottleneck (a pipeline).
    objective: Objective = "latency"
    # How chat messages become a prompt: one of CHAT_FORMATS, or a Jinja template file. Used instead of the GGUF's
    # tokenizer.chat_template, and where the GGUF has none (a base model; some conversions drop it).
    chat_template: PathText | None = None
    # Where tokens are sampled: node: on the node that holds the output layer, so one token per sequence crosses
    # the network instead of every logit (n_vocab * 4 bytes); coordinator: here, from the logits (requests that
    # need them, a JSON schema, are sampled here either way).
    sampling: Literal["node", "coordinator"] = "node"
    # Speculative decoding: ngram: each slot drafts from its own tokens (core.engine.speculation) and one step
    # verifies them, so text that repeats what came before costs one network wait per several tokens; off: one
    # token per step; {draft_model: PATH}: a small model with the same vocabulary drafts, on this machine.
    speculative: Annotated[Literal["ngram", "off"] | DraftModelSpec, BeforeValidator(speculative_switch)] = "ngram"
    api: Api = Field(default_factory=Api)
    metrics: Metrics = Field(default_factory=Metrics)
    defaults: NodeDefaults = Field(default_factory=NodeDefaults)
    nodes: tuple[Node, ...]
    source: str = EMBEDDED_SOURCE
    # Read from api.key_file or $GGML_CLUSTER_API_KEY as the inventory is loaded. Private: never dumped (the state
    # dir's inventory.json holds the file's name only), never in a repr, and not settable from the YAML.
    _api_key: str | None = PrivateAttr(default=None)

    @property
    def api_key(self) -> str | None:
        """The key the API and the metrics endpoint require as a Bearer token; None: they are open (loopback)."""
        return self._api_key

    @property
    def worker_ports(self) -> frozenset[int]:
        """Every node's RPC port: on this machine, no listener of the controller's may take one."""
        return frozenset(node.rpc_port for node in self.nodes)

    @property
    def speculates(self) -> bool:
        """Whether the coordinator verifies drafted tokens."""
        return self.speculative != "off"

    @property
    def draft(self) -> DraftModelSpec | None:
        """``speculative: {draft_model: …}``, if that is what it says."""
        return self.speculative if isinstance(self.speculative, DraftModelSpec) else None

    @property
    def draft_model_path(self) -> Path | None:
        """The draft model's file (resolved like every path), if ``speculative`` names one."""
        return self.resolve(self.draft.draft_model) if self.draft is not None else None

    @property
    def model_path(self) -> Path | None:
        """The model file, resolved against the inventory's folder; None means the built-in demo model."""
        if self.model is None:
            return None
        return self.resolve(self.model)

    @property
    def chat_format(self) -> str | None:
        """The built-in chat format that ``chat_template`` names, if it names one."""
        return self.chat_template if self.chat_template in CHAT_FORMATS else None

    @property
    def chat_template_file(self) -> Path | None:
        """The Jinja template file that ``chat_template`` names (resolved like every path), if not a format."""
        if self.chat_template is None or self.chat_format is not None:
            return None
        return self.resolve(self.chat_template)

    @property
    def location(self) -> str:
        """The inventory file's absolute path, or the embedded marker: what identifies it wherever the
        command runs (``source`` stays as the user wrote it, for messages)."""
        return self.source if self.source == EMBEDDED_SOURCE else str(Path(self.source).resolve())

    def workdir(self, node: Node) -> Path | None:
        """The node's work dir, resolved like every other path in the inventory."""
        return self.resolve(node.workdir) if node.workdir else None

    def resolve(self, path: str) -> Path:
        """A path from the inventory: ``~`` expanded, relative to the inventory's folder."""
        return _resolve(path, self.source)


def _resolve(path: str, source: str) -> Path:
    resolved = Path(os.path.expanduser(path))
    if not resolved.is_absolute() and source != EMBEDDED_SOURCE:
        resolved = Path(source).resolve().parent / resolved
    return resolved


def find_inventory(option: str | None) -> Path | None:
    """The inventory to use: the option, else $GGML_CLUSTER_INVENTORY, else ./inventory.yaml, else None."""
    if option:
        return Path(option)
    env = os.environ.get(INVENTORY_ENV)
    if env:
        return Path(env)
    local = Path(DEFAULT_INVENTORY_FILE)
    return local if local.is_file() else None


def load_inventory(path: Path | None) -> Inventory:
    """Read and validate an inventory file; None gives the embedded default."""
    if path is None:
        return embedded_inventory()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InventoryError(f"{path}: no such inventory file",
                             f"fix: pass -i PATH, set ${INVENTORY_ENV}, or copy inventory.example.yaml") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InventoryError(f"{path}: cannot read the inventory: {exc}") from None
    return parse_inventory(text, str(path))


def parse_inventory(text: str, source: str) -> Inventory:
    """Validate inventory YAML text; ``source`` names the file in every error."""
    try:
        raw = yaml.safe_load(text)
        tree = yaml.compose(text)
    except RecursionError:
        raise InventoryError(f"{source}: the YAML is nested too deeply", "fix: see inventory.example.yaml") from None
    except ValueError:  # a scalar PyYAML parses but cannot construct: too many digits, an impossible date
        raise InventoryError(unconstructible(text, source), "fix: correct it, or quote it to make it text") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InventoryError(f"{source}:{where}: YAML syntax error: {problem}",
                             "fix: check indentation and quoting near that line") from None
    locate = Locator(source, tree)
    if raw is None:
        raise InventoryError(f"{source}: the inventory is empty", "fix: see inventory.example.yaml")
    if not isinstance(raw, dict):
        raise InventoryError(f"{source}: the inventory must be a mapping with 'cluster' and 'nodes'",
                             "fix: see inventory.example.yaml")
    return _build(raw, source, locate)


def _build(raw: dict[str, Any], source: str, locate: Locator) -> Inventory:
    raw_defaults = raw.get("defaults") or {}
    defaults = validate(NodeDefaults, raw_defaults, ("defaults",), locate)
    raw_nodes = raw.get("nodes")
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise InventoryError(locate.at(("nodes",), "needs a list with at least one node"),
                             "fix: add nodes, each with at least 'name' (see inventory.example.yaml)")
    set_defaults = defaults.model_dump(exclude_none=True)
    nodes = []
    for index, raw_node in enumerate(raw_nodes):
        where: tuple[str | int, ...] = ("nodes", index)
        if not isinstance(raw_node, dict):
            raise InventoryError(locate.at(where, "each node must be a mapping with at least 'name'"))
        merged = {**set_defaults, **raw_node}
        for mapping in ("labels", "env"):  # merged per key, the node's own winning
            if mapping in set_defaults and mapping in raw_node and isinstance(raw_node[mapping], dict):
                merged[mapping] = {**set_defaults[mapping], **raw_node[mapping]}
        nodes.append(validate(Node, merged, where, locate, raw_node.get("name")))
    _check_unique(nodes, locate)
    top = {key: value for key, value in raw.items() if key not in ("defaults", "nodes")}
    top.update(defaults=defaults, nodes=tuple(nodes), source=source)
    if "source" in raw:
        raise InventoryError(locate.at(("source",), "unknown key 'source'"), "fix: remove it")
    inventory: Inventory = validate(Inventory, top, (), locate)
    _check_local_ports(inventory, locate)
    _check_chat_template(inventory, locate)
    inventory._api_key = read_api_key(inventory.resolve(inventory.api.key_file)
                                      if inventory.api.key_file is not None else None, locate)
    _check_exposure(inventory, locate)
    return inventory


def _check_unique(nodes: Sequence[Node], locate: Locator) -> None:
    names: dict[str, int] = {}
    ports: dict[tuple[str, int], int] = {}
    for index, node in enumerate(nodes):
        if node.name in names:
            raise InventoryError(
                locate.at(("nodes", index, "name"), f"duplicate node name '{node.name}' "
                          f"(also nodes[{names[node.name]}])"), "fix: give every node a unique name")
        names[node.name] = index
        key = (node.address, node.rpc_port)
        if key in ports:
            other = nodes[ports[key]].name
            raise InventoryError(
                locate.at(("nodes", index, "rpc_port"),
                          f"port {node.rpc_port} clashes with node '{other}' on the same host ({node.address})"),
                "fix: give each node on one host its own rpc_port")
        ports[key] = index


def _check_local_ports(inventory: Inventory, locate: Locator) -> None:
    """The API and metrics ports on this machine must not be a local worker's port, nor each other."""
    # A listener on another address of this machine does not take the workers' loopback ports.
    local = LOOPBACK_HOSTS | {"0.0.0.0", "::"}
    listeners = {("api", "port"): inventory.api.port} if inventory.api.host in local and inventory.api.port else {}
    if inventory.metrics.enabled and inventory.metrics.port and inventory.metrics.host in local:
        listeners[("metrics", "port")] = inventory.metrics.port
        if inventory.metrics.port == inventory.api.port and inventory.api.host in local:
            raise InventoryError(locate.at(("metrics", "port"), f"port {inventory.metrics.port} is also api.port"),
                                 "fix: give the metrics endpoint and the API their own ports")
    for index, node in enumerate(inventory.nodes):
        for (section, field), port in listeners.items():
            if node.address == "localhost" and node.rpc_port == port:
                raise InventoryError(
                    locate.at(("nodes", index, "rpc_port"),
                              f"port {node.rpc_port} clashes with {section}.{field} on this machine"),
                    f"fix: use another rpc_port or {section}.{field}")


def _check_chat_template(inventory: Inventory, locate: Locator) -> None:
    """A ``chat_template`` that is not a built-in format must be a Jinja template file that reads and parses."""
    path = inventory.chat_template_file
    if path is None:
        return
    value = inventory.chat_template
    at = ("chat_template",)
    try:
        size = path.stat().st_size if path.is_file() else None
    except OSError as exc:  # a path too long, a folder without permission
        raise InventoryError(locate.at(at, f"cannot read {path}: {exc.strerror or exc}")) from None
    if size is None:
        close = difflib.get_close_matches(str(value), CHAT_FORMATS, n=1)
        hint = f"did you mean '{close[0]}'? Otherwise name" if close else "name"
        raise InventoryError(locate.at(at, f"{SHORT.repr(value)} is neither a built-in chat format nor a file"),
                             f"fix: {hint} one of llama-cpp-python's chat formats ({', '.join(CHAT_FORMATS)}), "
                             "or the path of a Jinja template file")
    if size > MAX_CHAT_TEMPLATE_BYTES:
        raise InventoryError(locate.at(at, f"{path} has {size} bytes: not a chat template"),
                             "fix: point it at a Jinja chat template (a few KB)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8 text"
        raise InventoryError(locate.at(at, f"cannot read {path}: {reason}")) from None
    import jinja2

    try:
        # With loop controls, as llama-cpp-python's Jinja2ChatFormatter renders it (its pass-through for Hugging
        # Face's training-only {% generation %} tag aside).
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise InventoryError(locate.at(at, f"{path} line {exc.lineno} is not a Jinja template: {exc.message}"),
                             "fix: correct the template, or name a built-in chat format such as chatml") from None


def _check_exposure(inventory: Inventory, locate: Locator) -> None:
    """Without a key, the API and the metrics endpoint listen on loopback only."""
    if inventory.api_key is not None:
        return
    key_fix = f"set api.key_file to a file that holds a key (chmod 600), or ${API_KEY_ENV}"
    if not is_loopback(inventory.api.host):
        raise InventoryError(locate.at(("api", "host"), f"{SHORT.repr(inventory.api.host)} is beyond loopback and "
                                       "the API has no key: anyone who reaches it could use the cluster"),
                             f"fix: {key_fix}; or set api.host: 127.0.0.1")
    if inventory.metrics.enabled and not is_loopback(inventory.metrics.host):
        raise InventoryError(locate.at(("metrics", "host"), f"{SHORT.repr(inventory.metrics.host)} is beyond "
                                       "loopback and there is no key for the metrics endpoint"),
                             f"fix: {key_fix} (Prometheus then sends it as a Bearer token); or set metrics.host: "
                             "127.0.0.1, or metrics.enabled: false")


def direct_warnings(inventory: Inventory) -> list[str]:
    """One warning per node whose unauthenticated RPC port is reachable from its network."""
    return [f"node {node.name}: transport: direct exposes the worker's unauthenticated RPC port on "
            f"{node.host}:{node.rpc_port}; anyone who can reach it can use or crash the worker"
            for node in inventory.nodes if node.kind == "ssh" and node.transport == "direct"]


# Neither demo worker holds the demo model with the KV cache of its 4 slots (api.parallel: auto), so the demo is a
# cluster; the two together do.
DEMO_WORKER_MEMORY = 82 << 20
# Below Linux's ephemeral range (32768-60999): there an outgoing connection, or its TIME_WAIT, can hold the port.
DEMO_PORTS = (29152, 29153)


def embedded_inventory() -> Inventory:
    """The built-in default: two local workers on this machine and the demo model, which needs both."""
    threads = max(1, (os.cpu_count() or 2) // 2)
    inventory = Inventory(
        cluster="demo",
        context=512,
        nodes=(
            Node(name="local-a", kind="local", rpc_port=DEMO_PORTS[0], threads=threads, memory=DEMO_WORKER_MEMORY),
            Node(name="local-b", kind="local", rpc_port=DEMO_PORTS[1], threads=threads, memory=DEMO_WORKER_MEMORY),
        ),
    )
    inventory._api_key = environment_key()
    return inventory
