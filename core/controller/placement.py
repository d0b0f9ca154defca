"""Where the layers go: each node's measured speed for the model, the plan over the nodes that can serve, its
record in plan.json and on the nodes' statuses, and llama.cpp's own placement checked against it."""

from __future__ import annotations

import json
import platform
import re
from collections.abc import Callable, Mapping
from pathlib import Path

from core.controller.events import EventLog
from core.controller.health import NodeRuntime
from core.engine.coordinator import FLASH_ATTENTION
from core.engine.profile import NodeProfile, ProfileCache, Profiles, Target, measure, model_fingerprint, profile_key
from core.errors import PlanError, ProfileError
from core.inventory import Inventory
from core.model import ModelFacts
from core.planner import NodeCapacity, Plan, assign_layers, choose_slots, slots_note, with_prediction
from core.state import StateDir
from core.version import Version


class Placement:
    """The plan of the running cluster, the profiles it was made from, its slots, and a flag to measure again."""

    def __init__(self, inventory: Inventory, model: ModelFacts, *, model_path: Path, protocol: Version,
                 state: StateDir, log: EventLog, cache: ProfileCache, slots_chosen: Callable[[int], None]) -> None:
        """``slots_chosen``: told the slots that ``api.parallel: auto`` came to, once, at the first plan."""
        self.inventory = inventory
        self.model = model
        self.protocol = protocol
        self.state = state
        self.log = log
        self.cache = cache
        self.plan: Plan | None = None
        self.profiles: Profiles | None = None
        self.remeasure = False  # set by `profile`: measure again before the next plan
        self.keys: dict[str, str] = {}  # each measured node's profile cache key
        self.capacities: list[NodeCapacity] = []  # what the plan was made on
        # Each relayed node's count of timed computes when the plan was made: later ones ran under this plan.
        self.since: dict[str, int] = {}
        # Requests decoded together: the inventory's number, or (auto) the first plan's choice, kept for the
        # controller's life: requests were admitted to that many, and every later plan reserves KV cells for as
        # many (one that no longer fits them fails as any plan that does not fit, rather than shrink them).
        self.slots = inventory.api.parallel if isinstance(inventory.api.parallel, int) else None
        self._slots_chosen = slots_chosen
        self._model_id = model_fingerprint(model_path)

    async def place(self, usable: list[NodeRuntime], every: Mapping[str, NodeRuntime]) -> Plan:
        """Plan the model over ``usable`` (measured first, by the compute strategy or when asked) and show the
        plan on ``every`` node's status."""
        measure_now = self.inventory.strategy == "compute" or self.remeasure
        profiles = await self._measure(usable) if measure_now else self.profiles
        return self._apply(usable, profiles, every)

    def uses(self, name: str) -> bool:
        """Whether the plan gives node ``name`` layers (the coordinator connects only to those)."""
        return self.plan is not None and name in self.plan.used

    def left_out(self, name: str) -> bool:
        """Whether there is a plan and it was made without node ``name`` (failed or away then)."""
        return self.plan is not None and name not in self.plan.nodes

    def check(self, log_text: str) -> None:
        """Compare llama.cpp's own layer placement (its log from this load) with the plan."""
        if self.plan is None:
            return
        seen = parse_layer_devices(log_text)
        expected = assign_layers(self.plan.used_split, self.model.n_layers)
        if seen and [seen.get(layer) for layer in range(len(expected))] != expected:
            self.log.record("plan-mismatch", f"llama.cpp placed layers as {seen}, the plan expected {expected}")

    def describe(self) -> str:
        """The plan in one line, for the event log."""
        plan = self.plan
        if plan is None:
            return "no plan"
        layout = ", ".join(f"{name} {_layers(layers)}" for name, layers in zip(plan.nodes, plan.layers, strict=True))
        total = plan.predicted_total_s
        predicted = "" if total is None else f"; predicted {total * 1000:.1f} ms/token"
        slots = slots_note(plan.slots, self.inventory.api.parallel)
        return f"{plan.strategy} split {list(plan.tensor_split)}: {layout}; {slots}{predicted}"

    @staticmethod
    def _capacities(usable: list[NodeRuntime]) -> list[NodeCapacity]:
        return [NodeCapacity(runtime.name, runtime.status.mem_free, runtime.node.memory) for runtime in usable]

    def _target(self, runtime: NodeRuntime, capacity: NodeCapacity) -> Target:
        node, spec = runtime.node, runtime.spec
        # Same node, same path to it, same worker build and settings, same graph, same model file, tokens sampled
        # in the same place: same speed.
        identity = [node.name, node.kind, node.host, node.port, node.user, node.transport, runtime.status.backend,
                    spec.binary if spec else "", spec.threads if spec else None, self.protocol,
                    f"flash_attn={FLASH_ATTENTION}", f"sampling={self.inventory.sampling}"]
        endpoint = runtime.relayed or ("", 0)  # timed on the coordinator's own path to the worker
        rtt_ms = runtime.status.rtt_ms
        return Target(node.name, f"{endpoint[0]}:{endpoint[1]}", profile_key(identity, self._model_id),
                      capacity.usable, 0.0 if rtt_ms is None else rtt_ms / 1000)

    async def _measure(self, usable: list[NodeRuntime]) -> Profiles | None:
        """Each usable node's speed for this model (cached, or timed now); None when that fails."""
        capacities = self._capacities(usable)
        targets = [self._target(runtime, capacity) for runtime, capacity in zip(usable, capacities, strict=True)]
        self.keys = {target.name: target.key for target in targets}
        refresh, self.remeasure = self.remeasure, False
        overhead_key = profile_key(["coordinator", platform.node(), 1, self.inventory.sampling], self._model_id)
        try:
            profiles = await measure(self.model, targets, self.cache, overhead_key, self.state.profile_log,
                                     refresh=refresh, sampling=self.inventory.sampling)
        except ProfileError as exc:
            self.log.record("profile-failed", f"{exc}; placing layers by free memory instead")
            return None
        if profiles.measured:
            self.log.record("profile", "measured " + ", ".join(profiles.measured) + "; coordinator "
                            f"{profiles.overhead_s * 1000:.2f} ms/token")
        return profiles

    def _apply(self, usable: list[NodeRuntime], profiles: Profiles | None, every: Mapping[str, NodeRuntime]) -> Plan:
        """The inventory's strategy over the usable nodes, shown on every node's status and in plan.json."""
        capacities = self._capacities(usable)
        names = [runtime.name for runtime in usable]
        strategy = self.inventory.strategy
        # Only measured nodes have a speed; a node that could not hold a layer was never timed.
        measured = {} if profiles is None else {
            name: speed for name, speed in zip(every, profiles.speeds(self.model, list(every)), strict=True)
            if profiles.nodes.get(name)}
        if strategy == "compute" and profiles is None:
            strategy = "memory"  # the measurement failed, and said so: llama.cpp's own split meanwhile
        plan = choose_slots(strategy, self.model, capacities, self.inventory.context,
                            self.inventory.api.parallel if self.slots is None else self.slots,
                            objective=self.inventory.objective,
                            speeds=profiles.speeds(self.model, names) if profiles else None)
        if profiles is not None and all(name in measured for name in plan.used):
            plan = with_prediction(plan, profiles.speeds(self.model, names), self.model, profiles.overhead_s)
        self.plan, self.profiles, self.capacities = plan, profiles, capacities
        self.since = {name: runtime.relay.stats.computes_timed for name, runtime in every.items() if runtime.relay}
        for name, runtime in every.items():
            status, speed = runtime.status, measured.get(name)
            status.layers = status.predicted_ms = None
            status.fixed_ms = speed.fixed_s * 1000 if speed else None
            status.layer_ms = speed.per_layer_s * 1000 if speed else None
            status.output_ms = speed.output_s * 1000 if speed else None
            profile = profiles.nodes.get(name) if profiles is not None else None
            status.profiled_at = profile.measured_at if profile is not None else None
            status.profile_source = profile.source if profile is not None else ""
        for index, (name, layers) in enumerate(zip(plan.nodes, plan.layers, strict=True)):
            every[name].status.layers = layers
            if plan.predicted_s and layers:
                every[name].status.predicted_ms = plan.predicted_s[index] * 1000
        self.state.plan.write_text(json.dumps(plan.to_dict(), indent=2))
        if self.slots is None:
            self.slots = plan.slots
            self._slots_chosen(plan.slots)
        return plan

    def correct(self, name: str, profile: NodeProfile, every: Mapping[str, NodeRuntime]) -> None:
        """Replace node ``name``'s profile (cached too, for later plans) and the running plan's predictions."""
        if self.profiles is None or self.plan is None:
            return
        self.profiles.nodes[name] = profile
        if name in self.keys:
            self.cache.save(self.keys[name], profile)
        speeds = self.profiles.speeds(self.model, list(self.plan.nodes))
        self.plan = with_prediction(self.plan, speeds, self.model, self.profiles.overhead_s)
        relay = every[name].relay
        if relay is not None:
            self.since[name] = relay.stats.computes_timed  # the old times led here: judge the new profile afresh
        for index, plan_name in enumerate(self.plan.nodes):
            status = every[plan_name].status
            status.predicted_ms = self.plan.predicted_s[index] * 1000 if self.plan.layers[index] else None
        speed = speeds[self.plan.nodes.index(name)] if name in self.plan.nodes else None
        status = every[name].status
        status.profiled_at, status.profile_source = profile.measured_at, profile.source
        if speed is not None:
            status.fixed_ms, status.layer_ms = speed.fixed_s * 1000, speed.per_layer_s * 1000
            status.output_ms = speed.output_s * 1000
        self.state.plan.write_text(json.dumps(self.plan.to_dict(), indent=2))

    def best(self) -> Plan | None:
        """The plan the compute strategy gives now on the same nodes, memory and slots, with its prediction; None
        without profiles, under another strategy, or when nothing fits."""
        if self.profiles is None or self.plan is None or self.inventory.strategy != "compute":
            return None
        speeds = self.profiles.speeds(self.model, list(self.plan.nodes))
        try:
            plan = choose_slots("compute", self.model, self.capacities, self.inventory.context, self.plan.slots,
                                objective=self.inventory.objective, speeds=speeds)
        except PlanError:
            return None
        return with_prediction(plan, speeds, self.model, self.profiles.overhead_s)


def parse_layer_devices(log_text: str) -> dict[int, int]:
    """llama.cpp's 'layer N assigned to device RPCk' lines → {layer: k} (RPC devices only)."""
    seen: dict[int, int] = {}
    for match in re.finditer(r"layer\s+(\d+) assigned to device RPC(\d+)", log_text):
        seen[int(match.group(1))] = int(match.group(2))
    return seen


def _layers(layers: tuple[int, int] | None) -> str:
    return f"layers {layers[0]}-{layers[1]}" if layers else "no layers"
