"""Rendering is a pure function of a snapshot: exact text at a fixed width."""

from __future__ import annotations

from cli.render import duration, run_summary, size, status_view, to_text
from core.status import ClusterStatus, CoordinatorState, CoordinatorStatus, Event, NodeState, NodeStatus

GIB = 1 << 30
T0 = 1_800_000_000.0


def snapshot() -> ClusterStatus:
    return ClusterStatus(
        cluster="lab", model="demo.gguf",
        coordinator=CoordinatorStatus(state=CoordinatorState.READY, endpoint="unix:/s", restarts=1),
        nodes=[
            NodeStatus(name="a", host="localhost", kind="local", rpc_port=50152, arch="x86_64", backend="cpu",
                       state=NodeState.READY, layers=(0, 4), mem_total=24 * GIB, mem_free=20 * GIB,
                       computes=3, recomputes=120, compute_ms=4.25),
            NodeStatus(name="b", host="localhost", kind="local", rpc_port=50153, arch="x86_64", backend="cpu",
                       state=NodeState.RESTARTING, layers=(5, 7), mem_total=24 * GIB, mem_free=24 * GIB,
                       restarts=2, last_status="killed by SIGKILL"),
            NodeStatus(name="c", host="localhost", kind="local", rpc_port=50154, arch="x86_64", backend="cpu",
                       state=NodeState.FAILED, restarts=5, last_error="crash loop: exit code 1"),
        ],
        events=[Event(time=T0 + 5, kind="worker-exit", message="worker exited after 3s: killed by SIGKILL",
                      node="b")],
        started_at=T0, predicted_ms=9.5,
    )


def test_status_view_exact_text() -> None:
    text = to_text(status_view(snapshot(), now=T0 + 125), width=100)
    lines = text.splitlines()
    assert lines[0].rstrip() == "lab  model demo.gguf  coordinator ready (restarts 1)  up 2m05s  plan 9.5 ms/tok"
    assert [line.rstrip() for line in lines[1:5]] == [
        "NODE BACKEND    STATE      LAYERS FREE/MEM  MS/TOK COMPUTES RESTARTS LAST STATUS",
        "a    x86_64/cpu ready      0-4    20/24 GiB 4.25   123      0        ok",
        "b    x86_64/cpu restarting 5-7    24/24 GiB -      0        2        killed by SIGKILL",
        "c    x86_64/cpu failed     -      -         -      0        5        crash loop: exit code 1",
    ]
    assert lines[5] == "events"
    assert lines[6].endswith("[b] worker-exit: worker exited after 3s: killed by SIGKILL")


def test_status_view_fits_80_columns() -> None:
    text = to_text(status_view(snapshot(), now=T0), width=80)
    assert all(len(line) <= 80 for line in text.splitlines())
    for expected in ("a ", "restarting", "failed", "5-7", "LAST STATUS", "killed by SIGKILL"):
        assert expected in text


def test_round_trip_through_json() -> None:
    original = snapshot()
    assert ClusterStatus.from_dict(original.to_dict()) == original


def test_small_formatters() -> None:
    assert size(512) == "512 B" and size(3 * GIB // 2) == "1.5 GiB"
    assert duration(59) == "59s" and duration(3725) == "1h02m"
    assert run_summary({"completion_tokens": 3, "timings": {"decode_tokens_per_s": 10.0, "first_token_s": 0.25},
                        "recoveries": [{}]}) == "3 tokens, 10.0 tok/s, first token 250 ms, 1 recovery"
