"""The devices a worker serves, as ggml-rpc-server lists them, and whether they include the backend it was built for.

Started, ggml-rpc-server prints the devices it serves after ``Devices:``; asked for a device it does not have
(``-d <name>``), it prints ``available devices:`` and every device it has, then exits 1 without serving: a cheap way
to list a node's devices before its worker starts. Each device line reads
``  Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (24105 MiB, 22760 MiB free)``. A worker built for a GPU backend whose
GPU its driver cannot reach still starts, and serves its CPU alone: that must not pass for the GPU worker.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from core.nodes.gpus import MIB, VulkanDevice, software_renderer

# A device no worker has: asked for it, the worker lists its own and exits.
LIST_DEVICE = "ggml-cluster-list-devices"
# ggml's device names, by backend (GGML_CUDA_NAME is "ROCm" in a HIP build; Metal's devices are MTL0, MTL1, ...).
DEVICE_PREFIX = {"cuda": "CUDA", "rocm": "ROCm", "vulkan": "Vulkan", "metal": "MTL"}
# How each backend's own log lines begin (ggml_cuda_init: ..., ggml_vulkan: ..., ggml_metal_init: ...).
LOG_PREFIX = {"cuda": "ggml_cuda", "rocm": "ggml_cuda", "vulkan": "ggml_vulkan", "metal": "ggml_metal"}
VK_VISIBLE_DEVICES = "GGML_VK_VISIBLE_DEVICES"
# Added to the worker's environment for the listing only: where ggml-vulkan finds no driver at all it says nothing,
# and the Vulkan loader's errors say why ("vkCreateInstance: Found no drivers!", "Failed to open JSON file ...").
LISTING_ENV = {"vulkan": {"VK_LOADER_DEBUG": "error"}}

_DEVICE = re.compile(r"\s+(?P<name>[A-Za-z_]+\d*): (?P<description>.*) \((?P<total>\d+) MiB, (?P<free>\d+) MiB free\)")
_LISTS = ("Devices:", "available devices:")
# What the worker says only because it was asked for LIST_DEVICE: not why a backend is missing.
_OURS = (f"error: unknown device: {LIST_DEVICE}", "No devices found")
# A line that says why something is missing ("failed to initialize CUDA: ...", "No devices found.").
_WHY = re.compile(r"fail|error|no \w* ?devices? found|invalid|insufficient|not found|unable|cannot|required|"
                  r"not supported", re.IGNORECASE)


@dataclass(frozen=True)
class Device:
    """One device a worker lists: ggml's name for it (``CUDA0``, ``Vulkan0``, ``CPU``) and its description."""

    name: str
    description: str
    memory_total: int
    memory_free: int


def parse_devices(text: str) -> tuple[Device, ...] | None:
    """The devices listed after ``Devices:`` or ``available devices:``; None when the output has no such list.

    The lines need not follow the header at once: the worker writes the header to stderr and the devices to stdout,
    which a pipe buffers until it exits, so its stderr lines in between come first."""
    devices: list[Device] = []
    found = False
    for line in text.splitlines():
        found = found or line.strip() in _LISTS
        match = _DEVICE.fullmatch(line.rstrip()) if found else None
        if match:
            devices.append(Device(match["name"], match["description"], int(match["total"]) * MIB,
                                  int(match["free"]) * MIB))
    return tuple(devices) if found else None


def backend_devices(backend: str, devices: Sequence[Device]) -> tuple[Device, ...]:
    """The devices of ``backend`` among ``devices`` (none for cpu, whose one device every worker has)."""
    prefix = DEVICE_PREFIX.get(backend)
    if prefix is None:
        return ()
    return tuple(device for device in devices if re.fullmatch(rf"{prefix}\d+", device.name))


def explanation(backend: str, text: str) -> str | None:
    """The worker's own line on why a device is missing: the backend's (``ggml_vulkan: No devices found.``) first,
    else the first line that names a failure (the cause; later ones tend to be its consequences), except what the
    worker says about the device we asked for to get the list. Runs of spaces are closed up."""
    lines = [" ".join(line.split()) for line in text.splitlines()
             if _WHY.search(line) and line.strip() not in _OURS and not _DEVICE.fullmatch(line.rstrip())]
    prefix = LOG_PREFIX.get(backend)
    own = [line for line in lines if prefix and line.startswith(prefix)]
    return next(iter(own or lines), None)


def device_problem(backend: str, code: int, text: str) -> str | None:
    """Why the worker whose device list (``-d LIST_DEVICE``) exited with ``code`` and printed ``text`` cannot serve
    as a ``backend`` worker, in one line with its own explanation; None when it has a device of that backend."""
    devices = parse_devices(text)
    why = explanation(backend, text)
    if devices is None:
        last = next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "no output")
        return f"the {backend} worker could not list its devices (exit status {code}): {why or last}"
    if backend_devices(backend, devices) or backend not in DEVICE_PREFIX:
        return None
    listed = ", ".join(device.name for device in devices) or "none"
    return f"the {backend} worker has no {DEVICE_PREFIX[backend]} device (it lists {listed})" + (
        f": {why}" if why else "")


def describe(device: Device) -> str:
    """A device for people: its description, and for a software Vulkan device (llvmpipe) that it is one."""
    if device.name.startswith(DEVICE_PREFIX["vulkan"]) and software_renderer(device.description):
        return f"{device.description} (software Vulkan)"
    return device.description


def backend_environment(backend: str, vulkan: Sequence[VulkanDevice]) -> dict[str, str]:
    """What a worker of ``backend`` needs in its environment on a node with these Vulkan devices (`vulkaninfo
    --summary`): nothing, except for a Vulkan worker on a node whose only Vulkan devices are software ones.

    ggml-vulkan uses GPUs only, unless GGML_VK_VISIBLE_DEVICES names devices by their index in the Vulkan loader's
    list, which is vulkaninfo's GPU<index>. Only the first software device is named: several would each compute
    on the same CPU cores. This runs only where `backend: vulkan` was asked for; `auto` never picks a software
    device (core.nodes.probe.choose_backend)."""
    if backend != "vulkan" or not vulkan or any(device.is_gpu for device in vulkan):
        return {}
    return {VK_VISIBLE_DEVICES: str(vulkan[0].index)}


def vulkan_device(devices: Sequence[VulkanDevice]) -> str:
    """The Vulkan device a worker would use, as `vulkaninfo --summary` names it (before there is a worker to ask):
    the first GPU, else the first software device (see `backend_environment`), said to be one; "" for none."""
    gpus = [device for device in devices if device.is_gpu]
    if gpus:
        return gpus[0].name
    return f"{devices[0].name} (software Vulkan)" if devices else ""
