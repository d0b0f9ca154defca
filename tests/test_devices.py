"""A worker's devices as it lists them, and a worker without its backend's device: named in one line, never started.

Captured on this kind of machine (Debian 12, Mesa 25.0.7 lavapipe from bookworm-backports, the pinned llama.cpp's
Vulkan worker), each with the command `WorkerSpec.devices_command("vulkan")` renders, output and errors together:
``rpc-server_list-devices_v7.0.0_vulkan-*`` (lavapipe-visible: GGML_VK_VISIBLE_DEVICES=0; lavapipe-not-visible:
unset; no-icd: VK_ICD_FILENAMES=/nonexistent.json; invalid-index: GGML_VK_VISIBLE_DEVICES=1), the worker's start-up
``rpc-server_startup_v7.0.0_vulkan-lavapipe_debian12.txt`` (under `stdbuf -oL`, killed after 3 s) and
``vulkaninfo_summary_lavapipe-only_mesa-25.0.7-bpo12_debian12.txt``; and the CUDA 13 worker (built from PyPI's
toolkit for sm_90) listing its devices on this machine, which has no NVIDIA driver
(``rpc-server_list-devices_v7.0.0_cuda13-no-driver_debian12.txt``). The CUDA start-up is the maintainers' example
from ../shared/fixtures/probe.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from core.errors import MissingDevice
from core.inventory import parse_inventory
from core.nodes import worker
from core.nodes.devices import (
    LIST_DEVICE,
    Device,
    backend_devices,
    backend_environment,
    describe,
    device_problem,
    explanation,
    parse_devices,
    vulkan_device,
)
from core.nodes.gpus import MIB, parse_vulkaninfo_summary
from core.nodes.probe import choose_backend, parse_node
from core.nodes.shell import CommandResult
from core.nodes.testing import FakeRemote
from core.status import NodeState
from tests.test_recovery import cluster, model  # noqa: F401 (model: the fixture `cluster` needs)
from tests.test_render import HEADER, healthy, screen, utc, when  # noqa: F401 (utc: times in UTC)

FIXTURES = Path(__file__).parent / "fixtures" / "probe"
LLVMPIPE = "llvmpipe (LLVM 15.0.6, 256 bits)"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def listing(case: str) -> str:
    return fixture(f"rpc-server_list-devices_v7.0.0_vulkan-{case}_debian12.txt")


def test_a_vulkan_worker_shown_lavapipe_lists_it_before_its_cpu() -> None:
    devices = parse_devices(listing("lavapipe-visible"))
    assert devices == (Device("Vulkan0", LLVMPIPE, 24105 * MIB, 22760 * MIB),
                       Device("CPU", "AMD EPYC", 24105 * MIB, 24105 * MIB))
    assert backend_devices("vulkan", devices) == devices[:1] and backend_devices("cuda", devices) == ()
    assert device_problem("vulkan", 1, listing("lavapipe-visible")) is None
    assert describe(devices[0]) == f"{LLVMPIPE} (software Vulkan)"


def test_the_devices_a_started_worker_serves() -> None:
    vulkan = parse_devices(fixture("rpc-server_startup_v7.0.0_vulkan-lavapipe_debian12.txt"))
    assert vulkan == (Device("Vulkan0", LLVMPIPE, 24105 * MIB, 22705 * MIB),)
    cuda = parse_devices(fixture("rpc-server_startup_v3.0.0_cuda-rtx5090_llama.cpp-tools-rpc-README.txt"))
    assert cuda == (Device("CUDA0", "NVIDIA GeForce RTX 5090", 32109 * MIB, 31588 * MIB),)
    assert describe(cuda[0]) == "NVIDIA GeForce RTX 5090"
    # v2.0.0 printed no device list: nothing to judge by.
    assert parse_devices(fixture("rpc-server_startup_v2.0.0_vulkan-radeon-8060s-strix-halo_lhl-strix-halo-"
                                 "testing.txt")) is None


@pytest.mark.parametrize(("case", "why"), [
    ("lavapipe-not-visible", "ggml_vulkan: No devices found."),
    ("invalid-index", "ggml_vulkan: Invalid device index 1 in GGML_VK_VISIBLE_DEVICES."),
    # ggml-vulkan says nothing when the loader finds no driver; the loader's first error (VK_LOADER_DEBUG) says why.
    ("no-icd", "ERROR: loader_get_json: Failed to open JSON file /nonexistent.json"),
])
def test_a_vulkan_worker_without_a_vulkan_device_says_why_in_its_own_words(case: str, why: str) -> None:
    assert device_problem("vulkan", 1, listing(case)) == f"the vulkan worker has no Vulkan device (it lists CPU): {why}"


def test_a_cuda_worker_without_a_driver_quotes_ggml_cuda() -> None:
    output = fixture("rpc-server_list-devices_v7.0.0_cuda13-no-driver_debian12.txt")
    assert device_problem("cuda", 1, output) == (
        "the cuda worker has no CUDA device (it lists CPU): ggml_cuda_init: failed to initialize CUDA: CUDA driver "
        "version is insufficient for CUDA runtime version")


def test_a_worker_that_cannot_list_its_devices_is_no_worker_of_its_backend() -> None:
    gone = "sh: 1: /nonexistent/ggml-rpc-server: not found\n"  # dash, the binary missing
    assert device_problem("cuda", 127, gone) == (
        "the cuda worker could not list its devices (exit status 127): sh: 1: /nonexistent/ggml-rpc-server: not "
        "found")


def test_the_explanation_is_never_what_the_worker_says_about_the_device_asked_for() -> None:
    # "error: unknown device: ggml-cluster-list-devices" and "No devices found" are our request's doing.
    assert explanation("vulkan", listing("lavapipe-visible")) is None
    assert LIST_DEVICE in listing("lavapipe-visible")


def test_lavapipe_is_made_visible_only_to_a_vulkan_worker_on_a_node_without_a_vulkan_gpu() -> None:
    lavapipe = parse_vulkaninfo_summary(fixture("vulkaninfo_summary_lavapipe-only_mesa-25.0.7-bpo12_debian12.txt"))
    assert [(device.index, device.name, device.device_type) for device in lavapipe] == [(0, LLVMPIPE, "cpu")]
    assert backend_environment("vulkan", lavapipe) == {"GGML_VK_VISIBLE_DEVICES": "0"}
    assert backend_environment("cpu", lavapipe) == {} and backend_environment("vulkan", ()) == {}
    assert vulkan_device(lavapipe) == f"{LLVMPIPE} (software Vulkan)"
    # A real GPU beside llvmpipe: ggml-vulkan picks the GPUs by itself, and llvmpipe stays out.
    laptop = parse_vulkaninfo_summary(fixture("vulkaninfo_summary_intel-igpu+rtx4070-laptop+llvmpipe_yzma.txt"))
    assert backend_environment("vulkan", laptop) == {} and vulkan_device(laptop) == "Intel(R) Graphics (RPL-S)"


def test_auto_never_picks_a_software_vulkan_device() -> None:
    facts = parse_node("==uname==\nLinux x86_64\n==vulkaninfo==\n"
                       + fixture("vulkaninfo_summary_lavapipe-only_mesa-25.0.7-bpo12_debian12.txt"))
    assert facts.vulkan_devices[0].name == LLVMPIPE and not facts.vulkan and facts.gpus == ()
    assert choose_backend(facts)[0] == "cpu"


def test_the_node_env_wins_over_what_its_backend_needs_and_the_listing_asks_the_loader_why() -> None:
    node = parse_inventory("cluster: c\nnodes: [{name: a, kind: local, env: {GGML_VK_VISIBLE_DEVICES: '1', B: x}}]\n",
                           "inventory.yaml").nodes[0]
    env = worker.environment(node, {"GGML_VK_VISIBLE_DEVICES": "0"})
    assert env == (("B", "x"), ("GGML_VK_VISIBLE_DEVICES", "1"))
    spec = worker.WorkerSpec(node="a", workdir="/w", binary="/bin/ggml-rpc-server", port=1, env=env)
    assert spec.devices_command("vulkan") == ("env VK_LOADER_DEBUG=error B=x GGML_VK_VISIBLE_DEVICES=1 "
                                              f"/bin/ggml-rpc-server -d {LIST_DEVICE}")
    assert spec.devices_command("cuda") == f"env B=x GGML_VK_VISIBLE_DEVICES=1 /bin/ggml-rpc-server -d {LIST_DEVICE}"
    assert "VK_LOADER_DEBUG" not in spec.command()


def test_backend_device_names_the_node_and_raises_missing_device() -> None:
    remote = FakeRemote("n1")
    spec = worker.WorkerSpec(node="n1", workdir="/w", binary="/bin/ggml-rpc-server", port=1)
    remote.on(LIST_DEVICE, CommandResult(1, listing("lavapipe-not-visible"), ""))
    with pytest.raises(MissingDevice) as caught:
        asyncio.run(worker.backend_device(remote, spec, "vulkan"))
    assert caught.value.message == ("node n1: the vulkan worker has no Vulkan device (it lists CPU): ggml_vulkan: No "
                                    "devices found.")
    assert asyncio.run(worker.backend_device(remote, spec, "cpu")) is None  # nothing to check: no command run
    assert len(remote.commands) == 1


def test_up_fails_a_node_whose_worker_lacks_its_backend_device_once_and_starts_no_worker(
        tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811 (the fixture)
    def nodes(remotes: dict[str, FakeRemote]) -> None:
        remotes["n1"].on(LIST_DEVICE, CommandResult(1, listing("lavapipe-visible"), ""))
        remotes["n2"].on(LIST_DEVICE, CommandResult(1, listing("no-icd"), ""))

    async def scenario() -> None:
        async with cluster(tmp_path, model, monkeypatch, nodes=3,
                           fields={1: "backend: vulkan", 2: "backend: vulkan"}, prepare=nodes) as fake:
            n1, n2 = fake.controller.nodes["n1"], fake.controller.nodes["n2"]
            await fake.until(lambda: n2.status.state == NodeState.FAILED and n1.status.state == NodeState.READY,
                             "n2 to fail and n1 to be ready")
            assert n1.status.device == f"{LLVMPIPE} (software Vulkan)"
            assert fake.controller.nodes["n0"].status.device == ""  # a CPU worker: nothing to list
            assert n2.status.last_error.startswith(
                "node n2: the vulkan worker has no Vulkan device (it lists CPU): ERROR: loader_get_json: Failed to "
                "open JSON file /nonexistent.json (fix: install the node's Vulkan driver")
            # Held for the next `up`: no timer retries it, and no worker was ever started there.
            assert n2.status.retry_at is None
            await asyncio.sleep(0.3)
            assert n2.status.failures == 1
            assert not [command for command in fake.remotes["n2"].commands if "supervise.sh.partial" in command]

    asyncio.run(scenario())


def test_the_dashboard_shows_a_vulkan_nodes_device_under_its_row_and_says_it_is_software() -> None:
    status = when(healthy(), pi5={"arch": "x86_64", "backend": "vulkan", "device": f"{LLVMPIPE} (software Vulkan)"})
    assert screen(status)[len(HEADER):len(HEADER) + 4] == [
        "NODE    BACKEND       STATE LAYERS MEMORY         LOAD MS/TOK COMPUTES RESTARTS",
        "rtx4090 x86_64/cuda   ready 0-19   ███░ 18G/24G    88%   9.12     1210        0",
        "pi5     x86_64/vulkan ready 20-27  █▎░░ 2.4G/8.0G 398%   4.25     1209        0",
        f"  └ {LLVMPIPE} (software Vulkan)",
    ]
