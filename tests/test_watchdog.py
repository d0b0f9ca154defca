"""What the watchdog counts as a pipeline still at work: pure comparisons of two readings."""

from __future__ import annotations

import os
import subprocess
import time

from core.controller.watchdog import Reading, moved
from core.nodes.sample import process_cpu_seconds


def test_nothing_moving_is_a_hang() -> None:
    still = Reading(relay_bytes=10, coordinator_cpu_s=1.0, worker_cpu_s={"a": 2.0, "b": None})
    assert moved(still, still) == []
    assert moved(still, Reading(10, 1.01, {"a": 2.01, "b": None})) == []  # the sampling's own noise


def test_bytes_or_cpu_anywhere_is_work() -> None:
    before = Reading(relay_bytes=10, coordinator_cpu_s=1.0, worker_cpu_s={"a": 2.0, "b": 3.0})
    assert moved(before, Reading(4106, 1.0, {"a": 2.0, "b": 3.0})) == ["4096 bytes through the relays"]
    assert moved(before, Reading(10, 1.5, {"a": 2.0, "b": 3.0})) == ["the coordinator's CPU"]
    assert moved(before, Reading(10, 1.0, {"a": 2.0, "b": 3.9})) == ["worker b's CPU"]


def test_a_worker_that_was_restarted_or_could_not_be_read_counts_as_not_moving() -> None:
    before = Reading(worker_cpu_s={"a": 50.0, "b": None})
    assert moved(before, Reading(worker_cpu_s={"a": 0.1, "b": 7.0})) == []


def test_cpu_seconds_of_a_process_grow_while_it_works_and_stop_when_it_is_stopped() -> None:
    busy = subprocess.Popen(["sh", "-c", "while :; do :; done"])
    try:
        first = process_cpu_seconds(busy.pid)
        time.sleep(0.3)
        second = process_cpu_seconds(busy.pid)
        assert first is not None and second is not None and second > first
        os.kill(busy.pid, 19)  # SIGSTOP
        time.sleep(0.05)
        stopped = process_cpu_seconds(busy.pid)
        time.sleep(0.3)
        assert process_cpu_seconds(busy.pid) == stopped
    finally:
        busy.kill()
        busy.wait()
    assert process_cpu_seconds(busy.pid) is None
