"""The queue bound: requests wait first come, first served up to `api.queue`; one more is refused at once with
an estimate of when to come back, through the controller (stub coordinator) and the control socket that `run`
uses."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from core.client import run
from core.controller.requests import Admission
from core.endpoints.control import serve_control
from core.errors import Busy, ClusterError
from core.service import GenerateRequest
from tests.test_recovery import cluster, expected, model  # noqa: F401 (model: the fixture cluster uses)

pytestmark = pytest.mark.timeout(60)


def test_one_slot_two_places_then_refused_in_order() -> None:
    async def scenario() -> None:
        changes: list[tuple[int, int]] = []
        admission = Admission(1, 2, lambda: changes.append((admission.busy, admission.queued)))
        order: list[str] = []
        release = {name: asyncio.Event() for name in "abc"}

        async def request(name: str) -> None:
            async with admission.place():
                order.append(name)
                await release[name].wait()

        tasks = {name: asyncio.create_task(request(name)) for name in "abc"}
        await asyncio.sleep(0)
        assert (order, admission.busy, admission.queued, admission.deferred) == (["a"], 1, 2, 2)
        with pytest.raises(Busy) as caught:
            async with admission.place():
                pytest.fail("a request beyond the queue was let in")
        assert admission.rejected == 1 and caught.value.retry_after == 1  # nothing finished yet: no estimate
        assert str(caught.value) == "the cluster is busy: 1/1 slots generating, 2/2 queued (api.queue) (retry in 1s)"
        release["a"].set()
        await asyncio.sleep(0)
        # The slot went to the first waiter: a newcomer arriving now waits behind c, it does not take it.
        newcomer = asyncio.create_task(request("a"))
        await asyncio.sleep(0)
        assert admission.busy == 1 and admission.queued == 2
        for name in "bca":
            release[name].set()
        await asyncio.gather(*tasks.values(), newcomer)
        assert order == ["a", "b", "c", "a"] and (admission.busy, admission.queued) == (0, 0)
        assert changes[-1] == (0, 0) and (1, 2) in changes  # every change woke the watchers

    asyncio.run(scenario())


def test_a_waiter_that_gives_up_leaves_the_queue_and_a_slot_handed_to_it_passes_on() -> None:
    async def scenario() -> None:
        admission = Admission(1, 2, lambda: None)
        held, gone = asyncio.Event(), asyncio.Event()

        async def hold(until: asyncio.Event) -> None:
            async with admission.place():
                await until.wait()

        first = asyncio.create_task(hold(held))
        leaving = asyncio.create_task(hold(gone))
        await asyncio.sleep(0)
        leaving.cancel()  # a client gone while it waits
        await asyncio.sleep(0)
        assert admission.queued == 0 and admission.busy == 1
        second = asyncio.create_task(hold(gone))
        third = asyncio.create_task(hold(gone))
        await asyncio.sleep(0)
        held.set()
        await asyncio.sleep(0)  # `first` has left its slot to `second`, which has not resumed yet
        assert first.done() and admission.busy == 1 and admission.queued == 1
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        assert admission.busy == 1 and admission.queued == 0  # `third` holds the slot `second` never used
        gone.set()
        await third
        assert admission.busy == 0

    asyncio.run(scenario())


def test_the_slots_the_plan_chose_go_to_those_waiting_first_come_first_served() -> None:
    """api.parallel: auto admits one request until the first plan has chosen the slots, then that many."""
    async def scenario() -> None:
        admission = Admission(1, 8, lambda: None)
        order: list[str] = []
        release = asyncio.Event()

        async def request(name: str) -> None:
            async with admission.place():
                order.append(name)
                await release.wait()

        tasks = [asyncio.create_task(request(name)) for name in "abcde"]
        await asyncio.sleep(0)
        assert (order, admission.busy, admission.queued) == (["a"], 1, 4)
        admission.resize(4)
        assert (admission.slots, admission.busy, admission.queued) == (4, 4, 1)
        await asyncio.sleep(0)
        assert order == ["a", "b", "c", "d"]  # e still waits: four slots, all held
        newcomer = asyncio.create_task(request("f"))
        await asyncio.sleep(0)
        assert admission.queued == 2 and order == ["a", "b", "c", "d"]
        release.set()
        await asyncio.gather(*tasks, newcomer)
        assert order == ["a", "b", "c", "d", "e", "f"] and (admission.busy, admission.queued) == (0, 0)

    asyncio.run(scenario())


def test_retry_after_is_what_the_running_request_has_left_of_the_recent_mean() -> None:
    async def scenario() -> None:
        admission = Admission(1, 0, lambda: None)
        async with admission.place():
            await asyncio.sleep(1.3)  # requests take 1.3 s: the estimate rounds up
        with pytest.raises(ClusterError):  # a failed request says nothing about how long requests take
            async with admission.place():
                raise ClusterError("refused")
        started = time.monotonic()
        async with admission.place():
            with pytest.raises(Busy) as caught:
                async with admission.place():
                    pass
            assert caught.value.retry_after == 2
            await asyncio.sleep(1.5 - (time.monotonic() - started))
            with pytest.raises(Busy) as caught:  # it runs over the mean: a place may free up any moment
                async with admission.place():
                    pass
            assert caught.value.retry_after == 1

    asyncio.run(scenario())


def test_the_controller_queues_up_to_the_bound_and_refuses_beyond(
        tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    async def scenario() -> None:
        # One slot (not auto's four): the second request waits, the third is refused.
        async with cluster(tmp_path, model, monkeypatch, api="{queue: 1, parallel: 1}") as fake:
            controller = fake.controller
            first = asyncio.Event()
            texts: dict[str, list[str]] = {"a": [], "b": []}

            def sender(name: str) -> Any:
                async def send(event: dict[str, Any]) -> None:
                    if event["event"] == "token":
                        texts[name].append(event["text"])
                        first.set()
                return send

            running = asyncio.create_task(controller.generate(GenerateRequest(prompt="long", max_tokens=400),
                                                              sender("a")))
            await first.wait()
            waiting = asyncio.create_task(controller.generate(GenerateRequest(prompt="next", max_tokens=8),
                                                              sender("b")))
            await asyncio.sleep(0)
            status = controller.snapshot()
            assert (status.slots, status.slots_busy, status.queue_length, status.queue_limit) == (1, 1, 1, 1)
            assert (status.requests_in_flight, status.requests_deferred) == (2, 1)
            with pytest.raises(Busy):
                await fake.run("refused", 8)
            await asyncio.gather(running, waiting)
            assert "".join(texts["a"]) == expected("long", 400) and "".join(texts["b"]) == expected("next", 8)
            status = controller.snapshot()
            assert (status.slots_busy, status.queue_length, status.requests_in_flight) == (0, 0, 0)
            assert (status.requests_served, status.requests_deferred, status.requests_rejected) == (2, 1, 1)
            assert status.aggregate_decode_tokens_per_s == 0.0 and status.decode_tokens_per_s

    asyncio.run(scenario())


def test_run_is_told_the_cluster_is_busy_and_when_to_retry(
        tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    async def scenario() -> None:
        # One slot (not auto's four): the second request is refused at once.
        async with cluster(tmp_path, model, monkeypatch, api="{queue: 0, parallel: 1}") as fake:
            controller = fake.controller
            server = await serve_control(controller, controller.state.socket)
            first = asyncio.Event()
            rate: list[float] = []

            async def send(event: dict[str, Any]) -> None:
                if event["event"] == "token":
                    first.set()
                    if len(rate) < 1 and controller.requests.current and \
                            len(controller.requests.current[0].generated) > 3:
                        rate.append(controller.snapshot().aggregate_decode_tokens_per_s)

            try:
                running = asyncio.create_task(controller.generate(GenerateRequest(prompt="long", max_tokens=400),
                                                                  send))
                await first.wait()
                with pytest.raises(ClusterError) as caught:
                    async for _ in run(controller.state, {"prompt": "refused", "max_tokens": 8}):
                        pass
                assert caught.value.exit_code == 1  # `run` exits 1, with this one line
                assert str(caught.value) == ("the cluster is busy: 1/1 slots generating, 0/0 queued (api.queue) "
                                             "(retry in 1s)")
                await running
                assert rate and rate[0] > 0  # while it generated, the aggregate rate was its own
            finally:
                server.close()

    asyncio.run(scenario())
