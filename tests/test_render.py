"""Rendering is a pure function of a snapshot: exact text at a fixed width."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator

import pytest

from cli.render import bar, compact, duration, profile, run_summary, size, status_view, to_text
from core.plan_explained import live_note
from core.status import (
    ClusterStatus,
    CoordinatorState,
    CoordinatorStatus,
    Event,
    NodeState,
    NodeStatus,
    SessionStatus,
)

GIB = 1 << 30
MIB = 1 << 20
T0 = 1_800_000_000.0


@pytest.fixture(autouse=True)
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Event times print in local time; these tests print them in UTC."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def node(name: str, layers: tuple[int, int] | None, **fields: object) -> NodeStatus:
    values: dict[str, object] = {
        "host": "localhost", "kind": "local", "rpc_port": 50152, "arch": "x86_64", "backend": "cpu",
        "state": NodeState.READY, "layers": layers, "mem_total": 23 * GIB + 512 * MIB, "mem_free": 20 * GIB,
        "rss": 850 * MIB, "cpu_percent": 97.4, "computes": 1210, "compute_ms": 4.25, **fields}
    return NodeStatus(name=name, **values)  # type: ignore[arg-type]


def healthy() -> ClusterStatus:
    return ClusterStatus(
        cluster="homelab", model="qwen2.5-7b-q4_k_m.gguf",
        coordinator=CoordinatorStatus(state=CoordinatorState.GENERATING, endpoint="unix:/s"),
        nodes=[
            node("rtx4090", (0, 19), arch="x86_64", backend="cuda", mem_total=24 * GIB, rss=300 * MIB,
                 gpu_mem_used=18 * GIB + 300 * MIB, gpu_mem_total=24 * GIB, gpu_percent=88.0, compute_ms=9.12),
            node("pi5", (20, 27), arch="aarch64", mem_total=8 * GIB, rss=int(2.4 * GIB), cpu_percent=398.2,
                 computes=1209),
        ],
        events=[Event(time=T0 + 5, kind="worker", message="worker started", node="pi5"),
                Event(time=T0 + 9, kind="plan", message="compute (latency): layers on 2 of 2 worker(s)")],
        started_at=T0, requests_served=12, requests_in_flight=1, decode_tokens_per_s=41.26,
        prompt_tokens_per_s=512.3, predicted_ms=23.5, tensor_split=[0.7, 0.3], slots_busy=1, queue_limit=16,
        aggregate_decode_tokens_per_s=41.26)


def when(status: ClusterStatus, **nodes: dict[str, object]) -> ClusterStatus:
    """The snapshot with some nodes' fields changed."""
    changed = [dataclasses.replace(each, **nodes.get(each.name, {})) for each in status.nodes]
    return dataclasses.replace(status, nodes=changed)


def screen(status: ClusterStatus, width: int = 80) -> list[str]:
    return [line.rstrip() for line in to_text(status_view(status, now=T0 + 125), width=width).splitlines()]


HEADER = [
    "homelab  model qwen2.5-7b-q4_k_m.gguf  coordinator generating  up 2m05s",
    "decode 41.3 tok/s  prompt 512 tok/s  requests 12 (1 in flight)  plan 23.5 ms/tok",
    "slots 1/1  queue 0/16  deferred 0  rejected 0",
    "",
]
EVENTS = [
    "",
    "events",
    "08:00:05 [pi5] worker: worker started",
    "08:00:09 plan: compute (latency): layers on 2 of 2 worker(s)",
]


def test_healthy_cluster() -> None:
    assert screen(healthy()) == [
        *HEADER,
        "NODE    BACKEND     STATE LAYERS MEMORY         LOAD MS/TOK COMPUTES RESTARTS",
        "rtx4090 x86_64/cuda ready 0-19   ███░ 18G/24G    88%   9.12     1210        0",
        "pi5     aarch64/cpu ready 20-27  █▎░░ 2.4G/8.0G 398%   4.25     1209        0",
        *EVENTS,
    ]


def test_a_node_restarting() -> None:
    status = when(healthy(), pi5={"state": NodeState.RESTARTING, "restarts": 1, "rss": None, "cpu_percent": None,
                                  "last_status": "killed by SIGKILL", "last_error": "killed by SIGKILL"})
    status.events.append(Event(time=T0 + 120, kind="worker-exit", message="worker exited after 111s: killed by "
                                                                           "SIGKILL", node="pi5"))
    assert screen(status) == [
        *HEADER,
        "NODE    BACKEND     STATE      LAYERS MEMORY       LOAD MS/TOK COMPUTES RESTARTS",
        "rtx4090 x86_64/cuda ready      0-19   ███░ 18G/24G  88%   9.12     1210        0",
        "pi5     aarch64/cpu restarting 20-27  ░░░░ -/8.0G     -   4.25     1209        1",
        "  └ killed by SIGKILL",
        *EVENTS,
        "08:02:00 [pi5] worker-exit: worker exited after 111s: killed by SIGKILL",
    ]


def test_a_failed_node() -> None:
    status = when(healthy(), pi5={"state": NodeState.FAILED, "restarts": 5, "layers": None, "rss": None,
                                  "cpu_percent": None, "compute_ms": None,
                                  "last_status": "out of memory (ggml_aligned_malloc failed)",
                                  "last_error": "crash loop: out of memory (ggml_aligned_malloc failed)"})
    status.coordinator.state = CoordinatorState.READY
    status.requests_in_flight = status.slots_busy = 0
    status.recoveries = 1
    status.requests_sampled_on_coordinator = 2
    assert screen(status) == [
        "homelab  model qwen2.5-7b-q4_k_m.gguf  coordinator ready  up 2m05s",
        "decode 41.3 tok/s  prompt 512 tok/s  requests 12  recoveries 1  plan 23.5 ms/tok",
        "slots 0/1  queue 0/16  deferred 0  rejected 0  sampled here 2",
        "",
        "NODE    BACKEND     STATE  LAYERS MEMORY       LOAD MS/TOK COMPUTES RESTARTS",
        "rtx4090 x86_64/cuda ready  0-19   ███░ 18G/24G  88%   9.12     1210        0",
        "pi5     aarch64/cpu failed -      ░░░░ -/8.0G     -      -     1209        5",
        "  └ crash loop: out of memory (ggml_aligned_malloc failed)",
        *EVENTS,
    ]


def test_a_node_with_no_layers() -> None:
    status = when(healthy(), pi5={"layers": None, "computes": 0, "compute_ms": None, "cpu_percent": 0.0,
                                  "rss": 12 * MIB})
    assert screen(status) == [
        *HEADER,
        "NODE    BACKEND     STATE LAYERS MEMORY        LOAD MS/TOK COMPUTES RESTARTS",
        "rtx4090 x86_64/cuda ready 0-19   ███░ 18G/24G   88%   9.12     1210        0",
        "pi5     aarch64/cpu ready -      ░░░░ 12M/8.0G   0%      -        0        0",
        "  └ no layers in this plan; `ggml-cluster plan` says why",
        *EVENTS,
    ]


def test_a_direct_node_shows_no_traffic_counts() -> None:
    status = when(healthy(), pi5={"link": "direct", "computes": 0, "compute_ms": None})
    assert screen(status) == [
        *HEADER,
        "NODE    BACKEND     STATE LAYERS MEMORY         LOAD MS/TOK COMPUTES RESTARTS",
        "rtx4090 x86_64/cuda ready 0-19   ███░ 18G/24G    88%   9.12     1210        0",
        "pi5     aarch64/cpu ready 20-27  █▎░░ 2.4G/8.0G 398%      -        -        0",
        *EVENTS,
    ]


def test_a_node_with_a_memory_cap_shows_its_use_against_the_cap() -> None:
    """The inventory's `memory:` is what the planner may use there: that, not the machine's memory, is the total."""
    status = when(healthy(), rtx4090={"mem_cap": 20 * GIB}, pi5={"mem_cap": 6 * GIB})
    assert screen(status) == [
        *HEADER,
        "NODE    BACKEND     STATE LAYERS MEMORY         LOAD MS/TOK COMPUTES RESTARTS",
        "rtx4090 x86_64/cuda ready 0-19   ███▋ 18G/20G    88%   9.12     1210        0",
        "pi5     aarch64/cpu ready 20-27  █▋░░ 2.4G/6.0G 398%   4.25     1209        0",
        *EVENTS,
    ]
    # A cap above what the node has caps nothing.
    assert screen(when(healthy(), pi5={"mem_cap": 64 * GIB}))[6] == screen(healthy())[6]
    assert ClusterStatus.from_dict(status.to_dict()) == status


def test_narrow_screens_drop_the_load_column_first_and_never_overflow() -> None:
    wide = screen(healthy(), width=120)
    assert "LOAD" in wide[4]
    long_name = when(healthy(), pi5={"name": "raspberry-pi-5"})
    narrow = screen(long_name, width=80)
    assert "LOAD" not in narrow[4] and "MS/TOK" in narrow[4]
    assert all(len(line) <= 80 for line in narrow)


def test_live_screen_uptime_moves_with_the_clock() -> None:
    view = status_view(dataclasses.replace(healthy(), started_at=time.time() - 65))
    assert "up 1m05s" in to_text(view, width=80) or "up 1m06s" in to_text(view, width=80)


def test_round_trip_through_json() -> None:
    original = healthy()
    assert ClusterStatus.from_dict(original.to_dict()) == original


def test_small_formatters() -> None:
    assert size(512) == "512 B" and size(3 * GIB // 2) == "1.5 GiB"
    assert compact(512) == "512B" and compact(3_460_000) == "3.3M" and compact(23 * GIB + 512 * MIB) == "24G"
    assert bar(0) == "░░░░" and bar(1) == "████" and bar(0.5) == "██░░" and bar(0.6) == "██▍░"
    assert duration(59) == "59s" and duration(3725) == "1h02m"
    assert run_summary({"completion_tokens": 3, "timings": {"decode_tokens_per_s": 10.0, "first_token_s": 0.25},
                        "recoveries": [{}]}) == "3 tokens, 10.0 tok/s, first token 250 ms, 1 recovery"


def test_a_reconnecting_node_and_the_coordinators_progress_are_shown() -> None:
    status = when(healthy(), pi5={"state": NodeState.RECONNECTING, "rss": None, "cpu_percent": None,
                                  "last_error": "node pi5: cannot reach root@pi5.lan: Connection refused"})
    status = dataclasses.replace(status, coordinator=CoordinatorStatus(
        state=CoordinatorState.GENERATING, endpoint="unix:/s", progress="prompt 1024/2881 tokens"))
    lines = screen(status)
    assert lines[0] == "homelab  model qwen2.5-7b-q4_k_m.gguf  coordinator generating (prompt 1024/2881"
    assert any(line.startswith("pi5") and "reconnecting" in line for line in lines)
    assert "  └ node pi5: cannot reach root@pi5.lan: Connection refused" in lines


def test_a_failed_node_says_when_it_is_tried_again() -> None:
    status = when(healthy(), pi5={"state": NodeState.FAILED, "layers": None, "failures": 2, "retry_at": T0 + 145,
                                  "last_error": "crash loop: killed by SIGKILL"})
    assert "  └ crash loop: killed by SIGKILL (failed 2 times; next try in 20s)" in screen(status)


def test_failed_computes_retried_in_place_are_counted_and_the_latest_is_under_the_row() -> None:
    status = when(healthy(), rtx4090={"compute_status": True},
                  pi5={"compute_status": True, "compute_failures": 2, "compute_retries": 1,
                       "last_compute_failure": "device 0: GGML_STATUS_FAILED (-1)",
                       "last_compute_failure_at": T0 + 100})
    assert screen(status, width=100)[4:8] == [
        "NODE    BACKEND     STATE LAYERS MEMORY         LOAD MS/TOK COMPUTES CFAIL RESTARTS",
        "rtx4090 x86_64/cuda ready 0-19   ███░ 18G/24G    88%   9.12     1210     0        0",
        "pi5     aarch64/cpu ready 20-27  █▎░░ 2.4G/8.0G 398%   4.25     1209     2        0",
        "  └ 2 failed computes retried in place; last 08:01:40 device 0: FAILED (-1)",
    ]
    # 80 columns: the count goes first (before LOAD); the line under the row stays.
    assert screen(status)[4:8] == [
        "NODE    BACKEND     STATE LAYERS MEMORY         LOAD MS/TOK COMPUTES RESTARTS",
        "rtx4090 x86_64/cuda ready 0-19   ███░ 18G/24G    88%   9.12     1210        0",
        "pi5     aarch64/cpu ready 20-27  █▎░░ 2.4G/8.0G 398%   4.25     1209        0",
        "  └ 2 failed computes retried in place; last 08:01:40 device 0: FAILED (-1)",
    ]


def test_a_stock_worker_or_one_not_probed_yet_has_no_failed_computes_to_show() -> None:
    status = when(healthy(), rtx4090={"compute_status": False})  # pi5: not probed yet (None)
    lines = screen(status, width=100)
    assert lines[4].split()[-2:] == ["CFAIL", "RESTARTS"]
    assert [line.split()[-2] for line in lines[5:7]] == ["-", "-"]


def test_round_trip_through_json_with_the_relay_session_and_failed_computes() -> None:
    original = when(healthy(), pi5={
        "compute_status": True, "compute_failures": 1, "compute_retries": 1, "compute_retry_ms_total": 4.2,
        "last_compute_failure": "device 0: GGML_STATUS_ABORTED (1)", "last_compute_failure_at": T0,
        "session": SessionStatus(commands=12, digest="00112233aabbccdd", counts={"HELLO": 1, "GRAPH_COMPUTE": 11},
                                 bytes_to=4096, bytes_from=512)})
    data = json.loads(json.dumps(original.to_dict()))  # what `status --json` prints and a client reads back
    assert data["nodes"][1]["session"]["digest"] == "00112233aabbccdd"
    assert data["nodes"][1]["compute_status"] is True and data["nodes"][0]["compute_status"] is None
    assert ClusterStatus.from_dict(data) == original


def test_a_full_queue_and_parallel_slots_are_on_the_third_line() -> None:
    status = dataclasses.replace(healthy(), slots=4, slots_busy=4, queue_length=16, requests_deferred=40,
                                 requests_rejected=3, aggregate_decode_tokens_per_s=131.04,
                                 request_decode_tokens_per_s=[33.0, 32.96, 32.5, 32.58])
    assert screen(status)[2] == "slots 4/4  queue 16/16  deferred 40  rejected 3  all decode 131.0 tok/s"
    data = json.loads(json.dumps(status.to_dict()))
    assert (data["slots"], data["slots_busy"], data["queue_length"], data["queue_limit"]) == (4, 4, 16, 16)
    assert (data["requests_deferred"], data["requests_rejected"]) == (40, 3)
    assert data["request_decode_tokens_per_s"] == [33.0, 32.96, 32.5, 32.58]
    assert ClusterStatus.from_dict(data) == status
    shared = dataclasses.replace(status, prompt_tokens_shared=117)  # in --json and /metrics, not on the header
    assert ClusterStatus.from_dict(json.loads(json.dumps(shared.to_dict()))).prompt_tokens_shared == 117


def learning() -> ClusterStatus:
    """A compute plan checked against the relay: rtx4090's profile timed 3 h ago and holding (-5%), pi5's corrected
    from live times 3 min ago and drifting again (+42%)."""
    return when(healthy(),
                rtx4090={"predicted_ms": 9.5, "live_ms": 9.02, "drift": 9.02 / 9.5 - 1, "profile_source": "timed",
                         "profiled_at": T0 + 125 - 3 * 3600, "compute_status": True},
                pi5={"predicted_ms": 3.0, "live_ms": 4.25, "drift": 4.25 / 3.0 - 1, "profile_source": "live",
                     "profiled_at": T0 + 125 - 180, "compute_status": True})


def test_live_time_against_the_plan_with_its_drift_and_the_profiles_age_fit_120_columns() -> None:
    lines = screen(learning(), width=120)
    assert lines[4:7] == [
        "NODE    BACKEND     STATE LAYERS MEMORY         LOAD MS/TOK PLAN LIVE DRIFT PROFILE    "
        "COMPUTES CFAIL RESTARTS",
        "rtx4090 x86_64/cuda ready 0-19   ███░ 18G/24G    88%   9.12 9.50 9.02   -5% timed 3 h  "
        "    1210     0        0",
        "pi5     aarch64/cpu ready 20-27  █▎░░ 2.4G/8.0G 398%   4.25 3.00 4.25  +42% live 3 min"
        "     1209     0        0",
    ]
    assert all(len(line) <= 120 for line in lines)
    # Narrower: the profile's age goes first, then the drift, the live time and the plan; then CFAIL and LOAD, as
    # before, so at 80 columns the table is what it was.
    assert screen(learning(), width=100)[4] == ("NODE    BACKEND     STATE LAYERS MEMORY         LOAD MS/TOK PLAN LIVE "
                                                "DRIFT COMPUTES CFAIL RESTARTS")
    assert screen(learning(), width=90)[4].split()[6:8] == ["MS/TOK", "PLAN"]
    assert screen(learning(), width=80)[4:7] == screen(healthy(), width=80)[4:7]
    data = json.loads(json.dumps(learning().to_dict()))
    assert data["nodes"][1]["profile_source"] == "live" and data["nodes"][1]["drift"] == pytest.approx(0.41667, 1e-4)
    assert ClusterStatus.from_dict(data) == learning()


def test_columns_nothing_fills_are_left_out() -> None:
    """Under the memory strategy nothing is profiled or predicted: the live time alone, once there is one; and a
    node without layers (or live times yet) shows '-' among those that have them."""
    memory = when(healthy(), rtx4090={"live_ms": 9.02}, pi5={"live_ms": 4.31})
    assert screen(memory, width=120)[4:7] == [
        "NODE    BACKEND     STATE LAYERS MEMORY         LOAD MS/TOK LIVE COMPUTES CFAIL RESTARTS",
        "rtx4090 x86_64/cuda ready 0-19   ███░ 18G/24G    88%   9.12 9.02     1210     -        0",
        "pi5     aarch64/cpu ready 20-27  █▎░░ 2.4G/8.0G 398%   4.25 4.31     1209     -        0",
    ]
    assert "LIVE" not in screen(healthy(), width=120)[4]  # too few computes under the plan so far
    resting = when(learning(), pi5={"layers": None, "live_ms": None, "drift": None, "predicted_ms": None})
    assert screen(resting, width=120)[6].split()[7:12] == ["-", "-", "-", "-", "live"]  # MS/TOK to PROFILE


def test_a_profiles_age_and_source_as_plan_words_them() -> None:
    pi5 = learning().nodes[1]
    assert profile(pi5, T0 + 125) == "live 3 min" and profile(pi5, T0 + 125 - 135) == "live 45 s"
    assert profile(dataclasses.replace(pi5, profile_source="timed"), T0 + 125 + 2 * 86400) == "timed 2 days"
    assert profile(dataclasses.replace(pi5, profiled_at=None), T0) == "-"
    # `plan` says the same of it: its age, whether it was corrected, and the drift in percent.
    assert live_note(180, 4.25, 3.0, corrected=True) == ("corrected from live times 3 min ago; live 4.25 ms per "
                                                         "compute against 3.00 planned (+42%)")
