"""GPUs as their vendors' tools report them: nvidia-smi (CSV, or the human table), rocm-smi, vulkaninfo and
macOS system_profiler, parsed into one shape for the backend choice, the planner and the dashboard."""

from __future__ import annotations

import csv
import re
from collections.abc import Sequence
from dataclasses import dataclass

MIB = 2**20
GIB = 2**30
NVIDIA_SMI_FIELDS = ("index", "name", "memory.total", "memory.free")

_SOFTWARE_RENDERER = re.compile(r"llvmpipe|lavapipe|swiftshader", re.IGNORECASE)
_PCI_VENDORS = {0x10DE: "nvidia", 0x1002: "amd", 0x1022: "amd", 0x8086: "intel", 0x106B: "apple"}
_UNITS = {"b": 1, "kib": 2**10, "kb": 2**10, "mib": MIB, "mb": MIB, "gib": GIB, "gb": GIB}


@dataclass(frozen=True)
class Gpu:
    """One GPU. Memory in bytes, None where the tool does not report it."""

    vendor: str  # nvidia | amd | intel | apple | other
    name: str
    memory_total: int | None
    memory_free: int | None
    index: int | None = None
    unified: bool = False  # memory shared with the CPU (Apple silicon, GB10, Jetson, integrated GPUs)
    utilization: float | None = None  # percent busy, where the tool was asked for it


@dataclass(frozen=True)
class VulkanDevice:
    """One device listed by `vulkaninfo --summary`."""

    index: int
    name: str
    device_type: str  # discrete | integrated | virtual | cpu | other
    vendor: str

    @property
    def is_gpu(self) -> bool:
        """False for software rasterisers (llvmpipe, lavapipe, SwiftShader), which Vulkan lists as devices."""
        return self.device_type != "cpu" and not software_renderer(self.name)


def software_renderer(name: str) -> bool:
    """Whether a Vulkan device name is a software rasteriser's (llvmpipe, lavapipe, SwiftShader): the CPU."""
    return _SOFTWARE_RENDERER.search(name) is not None


@dataclass(frozen=True)
class DisplayAdapter:
    """One GPU from macOS `system_profiler SPDisplaysDataType`, with its Metal support line."""

    gpu: Gpu
    metal: str | None


def parse_nvidia_smi_csv(text: str, columns: Sequence[str] = NVIDIA_SMI_FIELDS) -> tuple[Gpu, ...]:
    """GPUs from `nvidia-smi --query-gpu=... --format=csv[,noheader][,nounits]`.

    A header line, when present, names the columns (units such as ``[MiB]`` dropped); otherwise ``columns``
    does. Rows with the wrong number of cells (error messages) are skipped. Without memory.free, free is
    total - used. ``[N/A]`` / ``[Not Supported]`` memory means memory shared with the CPU (GB10, Jetson).
    """
    lines = [line for line in text.splitlines() if line.strip()]
    if lines and {_drop_unit(cell) for cell in lines[0].split(",")} & {"index", "name", "memory.total"}:
        columns = [_drop_unit(cell) for cell in lines[0].split(",")]
        lines = lines[1:]
    gpus = []
    for line in lines:
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != len(columns):
            continue
        row = dict(zip(columns, cells, strict=True))
        total, free, used = (_parse_size(row.get(f"memory.{field}", ""), "mib") for field in ("total", "free", "used"))
        if free is None and total is not None and used is not None:
            free = total - used
        index = row.get("index", "")
        gpus.append(Gpu("nvidia", row.get("name", ""), total, free, int(index) if index.isdigit() else None,
                        unified=_is_unreported(row.get("memory.total", "")),
                        utilization=_percent(row.get("utilization.gpu", ""))))
    return tuple(gpus)


def _drop_unit(header: str) -> str:
    return header.partition("[")[0].strip()


def _is_unreported(cell: str) -> bool:
    return cell.strip().strip("[]").lower() in {"n/a", "not supported"}


def _percent(cell: str) -> float | None:
    """50.0 from "50", "50 %" or "50%"; None for "[N/A]" and the like."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*%?", cell.strip())
    return float(match.group(1)) if match else None


def _parse_size(cell: str, default_unit: str) -> int | None:
    """Bytes from "24564", "12288 MiB" or "16 GB" (binary units, as the GPU tools mean them)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?", cell.strip(), re.IGNORECASE)
    if not match:
        return None
    return int(float(match.group(1)) * _UNITS[(match.group(2) or default_unit).lower()])


def parse_nvidia_smi_table(text: str) -> tuple[Gpu, ...]:
    """GPUs from the human `nvidia-smi` table: name and "used / total MiB" of each GPU row.

    Names may be cut short by the table ("NVIDIA GeForce RTX 4080 ..."). MIG instances are not listed:
    the physical GPU row carries the whole memory. "Not Supported" memory means unified memory.
    """
    gpus: list[Gpu] = []
    pending: tuple[int, str] | None = None
    in_gpu_table = False
    for line in text.splitlines():
        if "Persistence-M" in line:
            in_gpu_table = True
            continue
        if "MIG devices" in line or "Processes:" in line:
            in_gpu_table = False  # their rows look like GPU rows (e.g. a process using "N/A" memory)
        if not in_gpu_table or not line.lstrip().startswith("|"):
            continue
        cells = line.strip().strip("|").split("|")
        gpu_row = re.fullmatch(r"\s*(\d+)\s+(.*?)\s+(?:On|Off|N/A)\s*", cells[0])
        if gpu_row:
            if pending:
                gpus.append(Gpu("nvidia", pending[1], None, None, pending[0]))
            pending = (int(gpu_row.group(1)), gpu_row.group(2))
        elif pending and len(cells) > 1:
            usage = re.search(r"(\d+)MiB\s*/\s*(\d+)MiB", cells[1])
            if usage:
                used, total = int(usage.group(1)) * MIB, int(usage.group(2)) * MIB
                gpus.append(Gpu("nvidia", pending[1], total, total - used, pending[0]))
            else:
                gpus.append(Gpu("nvidia", pending[1], None, None, pending[0], unified=_is_unreported(cells[1])))
            pending = None
    if pending:  # a capture cut off after the GPU's first row
        gpus.append(Gpu("nvidia", pending[1], None, None, pending[0]))
    return tuple(gpus)


def parse_rocm_smi_csv(text: str) -> tuple[Gpu, ...]:
    """AMD GPUs from `rocm-smi --showproductname --showmeminfo vram --csv` (any warnings before the header skipped)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("device,")), None)
    if start is None:
        return ()
    gpus = []
    for raw in csv.DictReader(lines[start:]):
        row = {str(key).strip().lower(): str(value).strip() for key, value in raw.items() if key and value}
        total = used = None
        for key, value in row.items():
            vram = re.fullmatch(r"vram total (used )?memory \((\w+)\)", key)
            if vram and vram.group(2) in _UNITS:
                if vram.group(1):
                    used = _parse_size(value, vram.group(2))
                else:
                    total = _parse_size(value, vram.group(2))
        card = re.search(r"(\d+)$", row.get("device", ""))
        name = row.get("card series") or row.get("device name") or row.get("card model") or ""
        gpus.append(Gpu("amd", name, total, total - used if total is not None and used is not None else None,
                        int(card.group(1)) if card else None, utilization=_percent(row.get("gpu use (%)", ""))))
    return tuple(gpus)


def parse_vulkaninfo_summary(text: str) -> tuple[VulkanDevice, ...]:
    """Every device in the "Devices:" part of `vulkaninfo --summary`, software ones included (see `is_gpu`)."""
    blocks: list[tuple[int, dict[str, str]]] = []
    for line in text.splitlines():
        header = re.fullmatch(r"GPU(\d+):", line.strip())
        if header:
            blocks.append((int(header.group(1)), {}))
        elif blocks:
            key, sep, value = line.partition("=")
            if sep:
                blocks[-1][1].setdefault(key.strip(), value.strip())
    devices = []
    for index, fields in blocks:
        if "deviceName" not in fields:
            continue
        kind = fields.get("deviceType", "").removeprefix("PHYSICAL_DEVICE_TYPE_").removesuffix("_GPU").lower()
        vendor_id = fields.get("vendorID", "")
        pci_id = int(vendor_id, 16) if re.fullmatch(r"0x[0-9a-fA-F]+", vendor_id) else None
        kind = kind if kind in {"discrete", "integrated", "virtual", "cpu"} else "other"
        devices.append(VulkanDevice(index, fields["deviceName"], kind, _PCI_VENDORS.get(pci_id or 0, "other")))
    return tuple(devices)


def parse_system_profiler_displays(text: str) -> tuple[DisplayAdapter, ...]:
    """GPUs from macOS `system_profiler SPDisplaysDataType`: chipset model, vendor, VRAM if listed, Metal support.

    Apple GPUs are marked unified (no VRAM of their own).
    """
    adapters: list[dict[str, str]] = []
    for line in text.splitlines():
        key, sep, value = line.strip().partition(":")
        if not sep:
            continue
        if key == "Chipset Model":
            adapters.append({})
        if adapters:
            adapters[-1].setdefault(key, value.strip())
    found = []
    for fields in adapters:
        vendor = _guess_display_vendor(fields.get("Vendor", ""), fields["Chipset Model"])
        vram = next((fields[key] for key in fields if key.startswith("VRAM")), "")
        gpu = Gpu(vendor, fields["Chipset Model"], _parse_size(vram, "b"), None, unified=vendor == "apple")
        found.append(DisplayAdapter(gpu, fields.get("Metal Support") or fields.get("Metal")))
    return tuple(found)


def _guess_display_vendor(vendor: str, chipset: str) -> str:
    pci_id = re.search(r"0x([0-9a-fA-F]{4})", vendor)
    if pci_id and int(pci_id.group(1), 16) in _PCI_VENDORS:
        return _PCI_VENDORS[int(pci_id.group(1), 16)]
    # Whole words: "ati" is inside "NVIDIA Corporation".
    word = re.search(r"\b(apple|amd|ati|radeon|intel|nvidia)\b", f"{vendor} {chipset}", re.IGNORECASE)
    return {"ati": "amd", "radeon": "amd"}.get(word.group(1).lower(), word.group(1).lower()) if word else "other"
