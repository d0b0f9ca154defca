"""The event log: what `status` keeps, what events.jsonl gets, and what a waiting request has not seen yet."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from core.controller.events import EventLog


def test_events_are_kept_written_and_counted(tmp_path: Path) -> None:
    async def scenario() -> None:
        log = EventLog(tmp_path / "events.jsonl", memory=3)
        seen = log.count
        for index in range(5):
            log.record("kind", f"message {index}", node="n0" if index % 2 else None)
        assert [event.message for event in log.recent] == ["message 2", "message 3", "message 4"]
        assert [event.message for event in log.since(seen)] == ["message 2", "message 3", "message 4"]
        assert [event.message for event in log.since(log.count - 1)] == ["message 4"]
        assert log.since(log.count) == []
        lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
        assert [line["message"] for line in lines] == [f"message {index}" for index in range(5)]
        assert lines[1]["node"] == "n0" and lines[0]["node"] is None

    asyncio.run(scenario())


def test_a_watcher_wakes_on_the_next_change_not_before(tmp_path: Path) -> None:
    async def scenario() -> None:
        log = EventLog(tmp_path / "events.jsonl")
        waiter = asyncio.ensure_future(log.wait_change(10))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        log.notify()
        await asyncio.wait_for(waiter, 1)
        await log.wait_change(0.01)  # no change: returns after the timeout

    asyncio.run(scenario())
