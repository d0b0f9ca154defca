"""Recovery decisions, fast: the real controller in this process, over fake nodes (core.nodes.testing) and a
stand-in coordinator that dies, stalls or fails on cue (tests/stub_coordinator.py). No worker, no SSH, no
model: what is under test is what the controller decides and that the client's stream stays whole."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from core.controller.compute import ComputeFaults
from core.controller.daemon import Controller, Seams
from core.controller.events import EventLog
from core.engine.protocol import ComputeFailed, ComputeRetried
from core.errors import ConnectError, WorkerDown
from core.inventory import parse_inventory
from core.model import write_demo_model
from core.nodes.shell import CommandResult
from core.nodes.testing import FakeRemote, FakeWorker
from core.rpc.wire import DeviceMemory, WorkerInfo
from core.service import GenerateRequest
from core.state import Launch, StateDir
from core.status import ClusterStatus, CoordinatorState, NodeState
from core.version import Version
from tests.stub_coordinator import token_at

pytestmark = pytest.mark.timeout(60)

GIB = 1 << 30


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("model") / "demo.gguf")


@dataclass
class Harness:
    controller: Controller
    remotes: dict[str, FakeRemote]
    workers: dict[str, FakeWorker]
    hello: dict[str, str]  # node → ok | down | silent: how its worker answers HELLO

    def kinds(self) -> list[str]:
        return [event.kind for event in self.controller.log.recent]

    async def until(self, condition: Any, what: str, timeout: float = 10.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not condition():
            assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}: {self.kinds()}"
            await self.controller.log.wait_change(0.05)

    async def run(self, prompt: str, tokens: int, leave_after: int | None = None,
                  stop: tuple[str, ...] = ()) -> tuple[str, dict[str, Any]]:
        """A request's streamed text and its done event; ``leave_after``: the client goes away after that many
        tokens (a ConnectionError from its send); ``stop``: its stop strings."""
        texts: list[str] = []
        done: dict[str, Any] = {}

        async def send(event: dict[str, Any]) -> None:
            if event["event"] == "token":
                if leave_after is not None and len(texts) >= leave_after:
                    raise ConnectionResetError("the client went away")
                texts.append(event["text"])
            elif event["event"] == "done":
                done.update(event)

        await self.controller.generate(GenerateRequest(prompt=prompt, max_tokens=tokens, stop=stop), send)
        return "".join(texts), done


def expected(prompt: str, tokens: int) -> str:
    """What the stub generates for ``prompt``, uninterrupted."""
    ids = [1] + [byte % 50 + 3 for byte in prompt.encode()]
    return "".join(f" t{token_at(ids, index)}" for index in range(tokens))


@asynccontextmanager
async def cluster(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch, cues: dict[str, Any] | None = None,
                  nodes: int = 2, memory: str = "", *, adopt: Harness | None = None,
                  keep_workers: bool = False, stock: tuple[str, ...] = (), api: str = "",
                  fields: dict[int, str] | None = None,
                  prepare: Callable[[dict[str, FakeRemote]], None] | None = None) -> AsyncIterator[Harness]:
    """A running controller over ``nodes`` fake nodes (each ``memory`` capped) and the stub coordinator.

    ``adopt``: the nodes (and their workers) of an earlier cluster, which a new controller adopts;
    ``keep_workers``: the controller leaves its workers running when it stops (`down --keep-workers`);
    ``stock``: nodes whose workers do not report failed computes (the others' HELLO says they do);
    ``api``: the inventory's ``api:`` mapping (a queue bound); ``fields``: more inventory fields of a node
    (``backend: vulkan``), by index; ``prepare``: scripts the new nodes before the controller starts."""
    (tmp_path / "cues.json").write_text(json.dumps(cues or {}))
    monkeypatch.setenv("GGML_STUB_CUES", str(tmp_path / "cues.json"))
    lines = ["cluster: fake", "context: 512", "strategy: memory", *([f"api: {api}"] if api else []), "nodes:"]
    for index in range(nodes):
        more = ([f"memory: {memory}"] if memory else []) + ([fields[index]] if fields and index in fields else [])
        lines += [f"  - {{name: n{index}, host: 127.0.0.{index + 1}, transport: direct, rpc_port: {50100 + index},"
                  f" build: {{path: /opt/rpc/ggml-rpc-server}}{''.join(', ' + field for field in more)}}}"]
    inventory = parse_inventory("\n".join(lines) + "\n", str(tmp_path / "inventory.yaml"))
    if adopt is None:
        remotes = {f"n{index}": FakeRemote(f"n{index}") for index in range(nodes)}
        workers = {name: FakeWorker(remote, f"/home/fake/.ggml-cluster/fake/{name}")
                   for name, remote in remotes.items()}
        hello = dict.fromkeys(remotes, "ok")
        if prepare is not None:
            prepare(remotes)
    else:
        remotes, workers, hello = adopt.remotes, adopt.workers, adopt.hello
    by_host = {f"127.0.0.{index + 1}": f"n{index}" for index in range(nodes)}

    async def probe(host: str, port: int) -> WorkerInfo:
        name = by_host[host]
        if hello[name] == "silent" or workers[name].stopped:
            raise ConnectError(f"{host}:{port} did not answer HELLO")
        if hello[name] == "down" or not workers[name].answering:
            raise WorkerDown(f"{host}:{port}: connection refused")
        return WorkerInfo(Version(7, 0, 0), (DeviceMemory(8 * GIB, 8 * GIB),), compute_status=name not in stock)

    state = StateDir(tmp_path / ("state" if adopt is None else "adopting")).create()
    launch = Launch(binary="/opt/rpc/ggml-rpc-server", protocol=Version(7, 0, 0), model=str(model))
    controller = Controller(inventory, launch, state, Seams(
        reach=lambda node: remotes[node.name], probe=probe, coordinator="tests.stub_coordinator", watchdog_s=0.3,
        liveness_s=0.1))
    harness = Harness(controller, remotes, workers, hello)
    controller.start()
    try:
        await harness.until(controller.supervisor.ready.is_set, "the first coordinator")
        yield harness
    finally:
        await controller.shutdown(stop_workers=not keep_workers)


def test_a_failed_node_shows_the_backend_it_would_run(tmp_path: Path, model: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Never an empty backend: the inventory's, or the one the node's probe chose; a node whose inventory says auto
    and that was never probed shows "auto"."""
    def break_nodes(remotes: dict[str, FakeRemote]) -> None:
        remotes["n2"].reachable = remotes["n3"].reachable = False
        remotes["n4"].on("test -f /opt/rpc/ggml-rpc-server", CommandResult(1, "", ""))  # probed, then no worker

    async def scenario() -> None:
        async with cluster(tmp_path, model, monkeypatch, nodes=5, fields={3: "backend: vulkan"},
                           prepare=break_nodes) as fake:
            await fake.until(lambda: all(fake.controller.nodes[name].status.state == NodeState.FAILED
                                         for name in ("n2", "n3", "n4")), "the broken nodes to fail")
            nodes = fake.controller.snapshot().to_dict()["nodes"]
            assert {node["name"]: (node["state"], node["backend"]) for node in nodes} == {
                "n0": ("ready", "cpu"), "n1": ("ready", "cpu"), "n2": ("failed", "auto"), "n3": ("failed", "vulkan"),
                "n4": ("failed", "cpu")}
            assert "build.path /opt/rpc/ggml-rpc-server is not an executable file" in nodes[4]["last_error"]

    asyncio.run(scenario())


def test_a_worker_that_exits_while_idle_is_restarted_and_the_coordinator_reconnects(
        tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path, model, monkeypatch) as fake:
            fake.workers["n1"].exit(137)
            await fake.until(lambda: fake.controller.supervisor.loads == 2, "the coordinator's reload")
            assert fake.controller.nodes["n1"].status.restarts == 1
            assert {"worker-exit", "coordinator-restart"} <= set(fake.kinds())
            assert (await fake.run("hello", 12))[0] == expected("hello", 12)

    asyncio.run(scenario())


def test_a_worker_that_is_down_is_waited_for_and_one_that_is_hung_is_killed(
        tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path, model, monkeypatch) as fake:
            health, n1 = fake.controller.fleet.health, fake.controller.nodes["n1"]
            fake.hello["n1"] = "down"  # nothing listens: its supervisor's restart is on the way
            assert not await health.verify(n1)
            assert n1.status.state == NodeState.RESTARTING and fake.workers["n1"].kills == 0
            n1.status.state = NodeState.READY
            fake.hello["n1"] = "silent"  # it listens, and does not answer: hung
            assert not await health.verify(n1)
            assert fake.workers["n1"].kills == 1 and "worker-hung" in fake.kinds()
            fake.workers["n1"].vanish()  # neither worker nor supervisor: the node is failed
            assert not await health.verify(n1)
            assert n1.status.state == NodeState.FAILED and "supervisor are gone" in n1.status.last_error

    asyncio.run(scenario())


def test_a_crash_loop_fails_the_node_and_the_cluster_replans_on_the_rest(
        tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path, model, monkeypatch, nodes=3) as fake:
            assert fake.controller.placement.plan is not None
            assert fake.controller.placement.plan.used == ("n0", "n1", "n2")
            fake.workers["n2"].crash_loop()
            await fake.until(lambda: fake.controller.supervisor.loads == 2, "the re-plan")
            plan = fake.controller.placement.plan
            assert plan is not None and plan.nodes == ("n0", "n1") and plan.used == ("n0", "n1")
            n2 = fake.controller.nodes["n2"].status
            assert n2.left_out and "crash loop" in n2.last_error and n2.layers is None
            assert (await fake.run("hello", 8))[0] == expected("hello", 8)

    asyncio.run(scenario())


def test_a_lost_coordinator_resumes_the_request_with_the_exact_replay(
        tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path, model, monkeypatch, {"die_at": {"1": 5}}) as fake:
            text, done = await fake.run("The cluster", 20)
            assert text == expected("The cluster", 20)  # the stub fails any replay that is not its own tokens
            assert [recovery["at_token"] for recovery in done["recoveries"]] == [5]
            assert "exited with 134" in done["recoveries"][0]["cause"]
            assert fake.controller.supervisor.status.restarts == 1

    asyncio.run(scenario())


def test_a_stop_string_across_a_coordinator_restart_ends_the_request_and_is_never_sent(
        tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path, model, monkeypatch, {"die_at": {"1": 5}}) as fake:
            whole = expected("The cluster", 20)
            before = expected("The cluster", 5)  # the coordinator dies after the 5th token's text is out
            # The stop string ends the 5th token's text and begins the 6th's: its start is held back over the restart.
            stop = before[-2:] + whole[len(before):len(before) + 3]
            assert whole.find(stop) == len(before) - 2
            pieces: list[str] = []

            async def send(event: dict[str, Any]) -> None:
                if event["event"] == "token":
                    pieces.append(event["text"])
                elif event["event"] == "done":
                    pieces.append(json.dumps(event))

            await fake.controller.generate(GenerateRequest(prompt="The cluster", max_tokens=20, stop=(stop, "zz")),
                                           send)
            done = json.loads(pieces.pop())
            assert "".join(pieces) == done["text"] == before[:-2]
            assert done["reason"] == "stop" and done["completion_tokens"] == 6
            assert [recovery["at_token"] for recovery in done["recoveries"]] == [5]
            # The stopped request was cancelled in the coordinator, which serves the next one whole.
            text, done = await fake.run("the next", 10)
            assert text == expected("the next", 10) and done["reason"] == "length"

    asyncio.run(scenario())


def test_a_cancel_reaches_only_the_request_whose_client_left(
        tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path, model, monkeypatch) as fake:
            with pytest.raises(ConnectionResetError):
                await fake.run("a long one", 400, leave_after=3)
            for prompt in ("the next", "and the one after"):
                text, done = await fake.run(prompt, 10)
                assert text == expected(prompt, 10) and done["reason"] == "length"
            assert fake.kinds().count("cancelled") == 1
            assert fake.controller.supervisor.status.state == CoordinatorState.READY

    asyncio.run(scenario())


def test_a_prompt_longer_than_the_watchdog_is_not_a_hang_and_a_stall_is(
        tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        # Each 512-token batch of this prompt keeps the coordinator busy 0.35 s: longer than the 0.3 s bound.
        cues = {"prompt_s": 0.35, "stall_at": {"2": 3}}
        async with cluster(tmp_path, model, monkeypatch, cues) as fake:
            prompt = "x" * 600
            text, done = await fake.run(prompt, 6)
            assert text == expected(prompt, 6) and done["recoveries"] == []
            fake.controller.supervisor.restart("a fresh coordinator, which stalls after 3 tokens")
            await fake.until(lambda: fake.controller.supervisor.loads == 2, "the second coordinator")
            text, done = await fake.run("short", 8)
            assert text == expected("short", 8)
            assert [recovery["at_token"] for recovery in done["recoveries"]] == [3]
            assert "nothing moved" in done["recoveries"][0]["cause"]

    asyncio.run(scenario())


def test_a_stopped_worker_is_named_and_killed_by_the_watchdog(
        tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path, model, monkeypatch, {"stall_at": {"1": 4}}) as fake:
            runner = asyncio.ensure_future(fake.run("stop", 10))
            await fake.until(lambda: fake.controller.requests.current
                             and len(fake.controller.requests.current[0].generated) == 4, "four tokens")
            fake.workers["n1"].stopped = True  # SIGSTOP: the pipeline waits on it forever
            await fake.until(lambda: fake.workers["n1"].kills == 1, "the watchdog's kill")
            text, done = await runner
            assert text == expected("stop", 10)
            assert "worker n1 is stopped" in done["recoveries"][0]["cause"]

    asyncio.run(scenario())


def test_an_adopted_worker_has_its_pid_and_when_stopped_is_named_by_the_watchdog(
        tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path, model, monkeypatch, keep_workers=True) as first:
            pids = {name: worker.pid for name, worker in first.workers.items()}
        # A new controller (`up` after `down --keep-workers`); its coordinator, the second one, stalls.
        async with cluster(tmp_path, model, monkeypatch, {"stall_at": {"2": 4}}, adopt=first) as fake:
            assert [event.message for event in fake.controller.log.recent if event.kind == "worker"] == [
                "adopted the running worker"] * 2
            assert {name: runtime.status.pid for name, runtime in fake.controller.nodes.items()} == pids
            runner = asyncio.ensure_future(fake.run("stop", 10))
            await fake.until(lambda: fake.controller.requests.current
                             and len(fake.controller.requests.current[0].generated) == 4, "four tokens")
            fake.workers["n1"].stopped = True
            await fake.until(lambda: fake.workers["n1"].kills == 1, "the watchdog's kill")
            text, done = await runner
            assert text == expected("stop", 10)
            assert "worker n1 is stopped" in done["recoveries"][0]["cause"]

    asyncio.run(scenario())


def test_a_coordinator_that_dies_again_during_its_reload_is_restarted_once_by_its_one_owner(
        tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path, model, monkeypatch, {"die_at": {"1": 4}, "loading": {"2": "die"}}) as fake:
            text, done = await fake.run("again", 12)
            assert text == expected("again", 12) and len(done["recoveries"]) == 1
            assert fake.kinds().count("coordinator-exit") == 2
            assert "coordinator-retry" not in fake.kinds()
            assert fake.controller.supervisor.status.restarts == 2
            assert int((tmp_path / "cues.json.starts").read_text()) == 3  # three starts, no more

    asyncio.run(scenario())


def compute_events(fake: Harness) -> list[tuple[str, str | None, str]]:
    return [(event.kind, event.node, event.message) for event in fake.controller.log.recent
            if event.kind.startswith("compute-")]


def test_a_failed_compute_is_retried_in_place_with_no_restart_of_anything(
        tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        cues = {"compute_fail": {"1": {"at": 4, "node": 1, "attempts": 2}}}
        async with cluster(tmp_path, model, monkeypatch, cues, stock=("n0",)) as fake:
            supervisor = fake.controller.supervisor
            pid = supervisor.pid()
            text, done = await fake.run("in place", 10)
            assert text == expected("in place", 10) and done["recoveries"] == []
            assert supervisor.pid() == pid and supervisor.status.restarts == 0 and supervisor.loads == 1
            assert compute_events(fake) == [
                ("compute-failed", "n1", "compute failed on device 0: GGML_STATUS_FAILED (-1); retrying in place "
                                         "(attempt 1)"),
                ("compute-failed", "n1", "compute failed on device 0: GGML_STATUS_FAILED (-1); retrying in place "
                                         "(attempt 2)"),
                ("compute-retried", "n1", "retried in place in 4.2 ms after 2 attempts")]
            assert not {"coordinator-exit", "coordinator-restart", "worker-exit", "watchdog"} & set(fake.kinds())
            assert fake.workers["n1"].kills == 0 and fake.controller.requests.recoveries == 0
            n0, n1 = (ClusterStatus.from_dict(fake.controller.snapshot().to_dict())).nodes  # as `status --json`
            assert (n0.compute_status, n1.compute_status) == (False, True)
            assert (n1.state, n1.restarts, n1.compute_failures, n1.compute_retries) == (NodeState.READY, 0, 2, 1)
            assert n1.compute_retry_ms_total == pytest.approx(4.2)
            assert n1.last_compute_failure == "device 0: GGML_STATUS_FAILED (-1)"
            assert n1.last_compute_failure_at is not None
            assert (n0.compute_failures, n0.compute_retries, n0.last_compute_failure) == (0, 0, "")
            # The next request runs on the same coordinator.
            assert (await fake.run("next", 6))[0] == expected("next", 6) and supervisor.pid() == pid

    asyncio.run(scenario())


def test_a_persistent_compute_failure_restarts_that_worker_and_the_coordinator_and_resumes_exactly(
        tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        cues = {"compute_fail": {"1": {"at": 5, "node": 1, "attempts": 3, "persistent": True}}}
        async with cluster(tmp_path, model, monkeypatch, cues) as fake:
            supervisor = fake.controller.supervisor
            first = supervisor.pid()
            text, done = await fake.run("persistent", 12)
            assert text == expected("persistent", 12)  # the stub fails any replay that is not its own tokens
            assert [recovery["at_token"] for recovery in done["recoveries"]] == [5]
            assert done["recoveries"][0]["cause"] == ("coordinator exited with 3 (it gave up on a persistent "
                                                      "compute failure on n1) after 5 tokens")
            assert supervisor.pid() != first and supervisor.status.restarts == 1 and supervisor.loads == 2
            assert (fake.workers["n1"].kills, fake.workers["n0"].kills) == (1, 0)  # through its supervisor
            n1 = fake.controller.nodes["n1"].status
            assert (n1.state, n1.restarts, n1.compute_failures, n1.compute_retries) == (NodeState.READY, 1, 3, 0)
            assert [kind for kind, _, _ in compute_events(fake)] == ["compute-failed"] * 3
            assert compute_events(fake)[-1] == (
                "compute-failed", "n1", "compute failed on device 0: GGML_STATUS_FAILED (-1); persistent (attempt 3): "
                "the coordinator gives up, its worker and the coordinator are restarted")
            exits = [event.message for event in fake.controller.log.recent if event.kind == "coordinator-exit"]
            assert exits == ["coordinator exited: exit 3 (it gave up on a persistent compute failure on n1); "
                             "restarting it"]
            assert "worker-exit" in fake.kinds()

    asyncio.run(scenario())


def test_a_report_from_an_endpoint_the_plan_does_not_know_is_logged_with_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        log = EventLog(tmp_path / "events.jsonl")
        faults = ComputeFaults(SimpleNamespace(nodes={}), log)  # type: ignore[arg-type]
        faults.connect({"127.0.0.1:50100": "n0"})
        faults.seen(ComputeFailed("10.0.0.9:50052", 1, -2, 3, 1, persistent=True))
        faults.seen(ComputeRetried("10.0.0.9:50052", 1, 0.5))
        assert [(event.kind, event.node, event.message) for event in log.recent] == [
            ("compute-failed", None, "compute failed at 10.0.0.9:50052 on device 1: GGML_STATUS_ALLOC_FAILED (-2) "
                                     "(3 failed computes); persistent (attempt 1): the coordinator gives up, its "
                                     "worker and the coordinator are restarted"),
            ("compute-retried", None, "retried in place at 10.0.0.9:50052 in 0.5 ms after 1 attempt")]
        assert faults.cause(3) == "it gave up on a persistent compute failure on the worker at 10.0.0.9:50052"
        assert faults.cause(134) == ""
        await faults.restart_worker()  # no node to restart: nothing happens

    asyncio.run(scenario())
