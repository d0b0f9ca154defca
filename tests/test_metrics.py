"""Node metrics: the sample script and its parsers, CPU use from two samples, and the Prometheus families."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from core.endpoints.prometheus import families, serve_metrics
from core.nodes.gpus import Gpu, parse_nvidia_smi_csv, parse_rocm_smi_csv
from core.nodes.sample import Sample, Usage, cpu_percent, parse_proc, parse_ps, parse_sample, sample_command, usage
from core.state import PidRecord
from core.status import ClusterStatus, CoordinatorState, CoordinatorStatus, NodeState, NodeStatus
from tests.harness import FIXTURES

GIB = 1 << 30
NOW = 1_800_000_600.0


def fixture(name: str) -> str:
    return (FIXTURES / "metrics" / name).read_text()


def test_sample_of_a_real_process_on_this_machine(tmp_path: Path) -> None:
    busy = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.time()"])
    try:
        (tmp_path / "worker.pid").write_text(PidRecord.of(busy.pid).text())  # as the supervisor writes it
        command = sample_command(str(tmp_path), "cpu")
        first = parse_sample(subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=False).stdout)
        started = time.monotonic()
        time.sleep(0.5)
        second = parse_sample(subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=False).stdout)
        seconds = time.monotonic() - started
    finally:
        busy.kill()
        busy.wait()
    assert first is not None and second is not None
    assert first.pid == busy.pid and second.rss is not None and second.rss > 1 << 20
    used = cpu_percent(first, second, seconds)
    assert used is not None and 20 < used <= 120  # one busy thread, on a shared machine
    assert second.gpus == ()


def test_no_worker_running_is_no_sample(tmp_path: Path) -> None:
    result = subprocess.run(["sh", "-c", sample_command(str(tmp_path / "it's not here"), "cuda")],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0 and parse_sample(result.stdout) is None


def test_linux_proc_fields_after_a_command_name_with_spaces() -> None:
    text = fixture("proc_python-with-spaces.txt")
    assert parse_proc(text) == (pytest.approx(1.23), 8228 * 1024)  # 21 + 102 ticks at 100/s


def test_procps_ps_output() -> None:
    assert parse_ps(fixture("ps_procps.txt")) == (1.0, 8228 * 1024)  # the same process, at 00:00:01
    assert parse_ps("") == (None, None)


def test_gpu_use_from_nvidia_smi_and_rocm_smi() -> None:
    probe = FIXTURES / "probe"
    nvidia = parse_nvidia_smi_csv((probe / "nvidia-smi_csv_header_2gpu_gtx1080ti-gtx1060_bpytop-issue26.csv")
                                  .read_text())
    assert [gpu.utilization for gpu in nvidia] == [36.0, 0.0]
    rocm = parse_rocm_smi_csv((probe / "rocm-smi_csv_showproductname-showuse-showmeminfo-vram_"
                                                    "rx7900xt-gfx1100_marimo-issue9237.csv").read_text())
    assert [gpu.utilization for gpu in rocm] == [0.0]


def test_gpu_tools_are_asked_only_for_their_backend() -> None:
    assert "nvidia-smi" in sample_command("/w", "cuda") and "rocm-smi" not in sample_command("/w", "cuda")
    assert "rocm-smi" in sample_command("/w", "rocm")
    assert "smi" not in sample_command("/w", "cpu") and "smi" not in sample_command("/w", "metal")


def test_cpu_use_needs_the_same_process_twice() -> None:
    assert cpu_percent(Sample(1, 10.0, None), Sample(1, 11.5, None), 2.0) == 75.0
    assert cpu_percent(Sample(1, 10.0, None), Sample(2, 0.1, None), 2.0) is None  # restarted in between
    assert cpu_percent(Sample(1, None, None), Sample(1, 1.0, None), 2.0) is None


def test_usage_of_a_two_gpu_node() -> None:
    gpus = (Gpu("nvidia", "a", 24 * GIB, 4 * GIB, 0, utilization=90.0),
            Gpu("nvidia", "b", 24 * GIB, 20 * GIB, 1, utilization=10.0),
            Gpu("nvidia", "GB10", None, None, 2, unified=True))  # unreported memory: left out of the sums
    after = Sample(7, 12.0, GIB, gpus)
    assert usage(Sample(7, 11.0, GIB), after, 4.0) == Usage(25.0, GIB, (90.0 + 10.0) / 2, 24 * GIB, 48 * GIB)
    assert usage(None, after, 0.0).cpu_percent is None  # the first sample has nothing to compare with
    assert usage(Sample(7, 11.0, GIB), None, 2.0) == Usage()  # the worker is gone: nothing is shown


def snapshot() -> ClusterStatus:
    return ClusterStatus(
        cluster="lab", model="demo.gguf", coordinator=CoordinatorStatus(state=CoordinatorState.GENERATING),
        nodes=[NodeStatus(name="a", host="localhost", kind="local", rpc_port=1, state=NodeState.READY,
                          layers=(0, 4), mem_total=24 * GIB, computes=7, bytes_to=1000, compute_ms=2.5,
                          cpu_percent=97.0, rss=GIB, gpu_percent=40.0, gpu_mem_used=2 * GIB, compute_status=True,
                          compute_failures=3, compute_retries=2, compute_retry_ms_total=8.5, predicted_ms=2.0,
                          live_ms=2.5, drift=0.25, rtt_ms=0.4, profiled_at=NOW - 180, profile_source="live"),
               NodeStatus(name="b", host="localhost", kind="local", rpc_port=2, state=NodeState.FAILED,
                          restarts=5, link="direct")],
        started_at=1_800_000_000.0, requests_served=3, requests_in_flight=3, decode_tokens_per_s=12.5,
        aggregate_decode_tokens_per_s=12.5, slots_busy=1, queue_length=2, queue_limit=2, requests_deferred=9,
        requests_rejected=4, prompt_tokens_shared=117, requests_sampled_on_coordinator=5, completion_tokens=128,
        completion_tokens_batched=120)


def test_prometheus_exposition_of_a_snapshot() -> None:
    registry = CollectorRegistry(auto_describe=False)

    class Fixed:
        def collect(self):
            return families(snapshot(), now=NOW)

    registry.register(Fixed())  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in text_string_to_metric_families(text) for sample in family.samples}
    a, b = (("cluster", "lab"), ("node", "a")), (("cluster", "lab"), ("node", "b"))
    assert samples[("ggml_cluster_node_layers", a)] == 5 and samples[("ggml_cluster_node_layers", b)] == 0
    assert samples[("ggml_cluster_node_computes_total", a)] == 7
    assert samples[("ggml_cluster_node_sent_bytes_total", a)] == 1000
    assert samples[("ggml_cluster_node_compute_seconds", a)] == 0.0025
    assert samples[("ggml_cluster_node_cpu_percent", a)] == 97
    assert samples[("ggml_cluster_node_gpu_utilization_percent", a)] == 40
    assert samples[("ggml_cluster_node_state", (*b, ("state", "failed")))] == 1
    assert samples[("ggml_cluster_node_state", (*b, ("state", "ready")))] == 0
    assert samples[("ggml_cluster_node_restarts_total", b)] == 5
    assert ("ggml_cluster_node_cpu_percent", b) not in samples  # unknown is absent, not zero
    assert ("ggml_cluster_node_computes_total", b) not in samples  # a direct node's traffic is not seen
    assert ("ggml_cluster_node_sent_bytes_total", b) not in samples
    assert samples[("ggml_cluster_node_compute_failures_total", a)] == 3
    assert samples[("ggml_cluster_node_compute_retries_total", a)] == 2
    assert samples[("ggml_cluster_node_compute_retry_seconds_total", a)] == 0.0085
    assert ("ggml_cluster_node_compute_failures_total", b) not in samples  # a stock worker reports none
    # What the controller learns from the relay: the live time against the plan, the link, the profile.
    assert samples[("ggml_cluster_node_predicted_compute_seconds", a)] == 0.002
    assert samples[("ggml_cluster_node_live_compute_seconds", a)] == 0.0025
    assert samples[("ggml_cluster_node_drift_ratio", a)] == 0.25
    assert samples[("ggml_cluster_node_rtt_seconds", a)] == 0.0004
    assert samples[("ggml_cluster_node_profile_age_seconds", a)] == 180
    assert samples[("ggml_cluster_node_profile_source", (*a, ("source", "live")))] == 1
    assert samples[("ggml_cluster_node_profile_source", (*a, ("source", "timed")))] == 0
    for name in ("predicted_compute_seconds", "live_compute_seconds", "drift_ratio", "rtt_seconds",
                 "profile_age_seconds"):  # b was never profiled, holds no layers and was not probed
        assert (f"ggml_cluster_node_{name}", b) not in samples
    assert not [key for key in samples if key[0] == "ggml_cluster_node_profile_source" and key[1][:2] == b]
    assert samples[("ggml_cluster_coordinator_state", (("cluster", "lab"), ("state", "generating")))] == 1
    assert samples[("ggml_cluster_requests_total", (("cluster", "lab"),))] == 3
    assert samples[("ggml_cluster_decode_tokens_per_second", (("cluster", "lab"),))] == 12.5
    assert ("ggml_cluster_prompt_tokens_per_second", (("cluster", "lab"),)) not in samples
    lab = (("cluster", "lab"),)
    assert samples[("ggml_cluster_requests_in_flight", lab)] == 3
    assert (samples[("ggml_cluster_slots", lab)], samples[("ggml_cluster_slots_busy", lab)]) == (1, 1)
    assert (samples[("ggml_cluster_queue_length", lab)], samples[("ggml_cluster_queue_limit", lab)]) == (2, 2)
    assert samples[("ggml_cluster_requests_deferred_total", lab)] == 9
    assert samples[("ggml_cluster_requests_rejected_total", lab)] == 4
    assert samples[("ggml_cluster_prompt_tokens_shared_total", lab)] == 117
    assert samples[("ggml_cluster_completion_tokens_total", lab)] == 128
    assert samples[("ggml_cluster_requests_sampled_on_coordinator_total", lab)] == 5
    assert samples[("ggml_cluster_completion_tokens_batched_total", lab)] == 120
    assert samples[("ggml_cluster_aggregate_decode_tokens_per_second", lab)] == 12.5


def test_a_profile_age_is_taken_at_the_scrape_and_never_negative() -> None:
    def age(now: float) -> float:
        found = [family for family in families(snapshot(), now=now)
                 if family.name == "ggml_cluster_node_profile_age_seconds"]
        return found[0].samples[0].value

    assert (age(NOW), age(NOW + 60)) == (180, 240)
    assert age(NOW - 600) == 0  # the clock stepped back past the profile's stamp


KEY = "k" * 8 + "0123456789abcdef"


def test_with_a_key_the_metrics_endpoint_answers_only_a_bearer_that_carries_it() -> None:
    def scrape(address: str, authorization: str | None) -> tuple[int, str, str | None]:
        request = urllib.request.Request(f"http://{address}/metrics")
        if authorization is not None:
            request.add_header("Authorization", authorization)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.read().decode(), None
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode(), error.headers["WWW-Authenticate"]

    async def main() -> list[tuple[int, str, str | None]]:
        server = serve_metrics("127.0.0.1", 0, snapshot, asyncio.get_running_loop(), KEY)
        open_server = serve_metrics("127.0.0.1", 0, snapshot, asyncio.get_running_loop(), None)
        try:
            return [await asyncio.to_thread(scrape, server.address, header)
                    for header in (None, "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}", f"bearer  {KEY}")] + \
                   [await asyncio.to_thread(scrape, open_server.address, None)]
        finally:
            server.close()
            open_server.close()

    missing, wrong, basic, right, any_case, unguarded = asyncio.run(main())
    for refused in (missing, wrong, basic):
        assert refused[0] == 401 and refused[2] == "Bearer" and "ggml_cluster" not in refused[1]
    for answered in (right, any_case, unguarded):
        assert answered[0] == 200 and 'ggml_cluster_slots{cluster="lab"} 1.0' in answered[1]
