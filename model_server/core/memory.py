"""Accelerator memory and the memory guard that refuses a load instead of dying to the OOM killer.

On a GPU host memory comes from NVML (``pynvml`` from nvidia-ml-py) per device. On a CPU host it
is the process's resident memory against a budget: ``--memory-budget``, else 90% of the cgroup
(container) limit, else a share of physical memory. A host without NVML is normal, not an error.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from model_server.core.errors import MemoryBudgetExceeded

log = logging.getLogger(__name__)

# Share of physical memory used as the budget when neither a flag nor a cgroup limit says.
DEFAULT_PHYSICAL_SHARE = 0.8
# Share of a cgroup (container) limit used as the budget. The kernel's OOM killer acts on the
# cgroup's whole charge (RSS, plus kernel memory and the page cache it cannot reclaim in
# time), not on RSS alone: with the whole limit as the budget, the control plane's ejection
# (at 95% of the budget) would come within 5% of the kill.
CGROUP_LIMIT_SHARE = 0.9
# ONNX Runtime's working memory on top of the weights (arena, optimised copies of initializers).
MODEL_MEMORY_FACTOR = 1.5
MODEL_MEMORY_OVERHEAD = 32 * 1024 * 1024

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}


def parse_bytes(text: str) -> int:
    """Parses "512MiB", "4G", "1.5GiB" or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size (expected e.g. 512MiB, 4GiB, 2G or bytes)")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value <= 0:
        raise ValueError(f"{text!r}: a size must be positive")
    return int(value)


def format_bytes(value: int | float) -> str:
    return f"{value / 1024**2:.1f} MiB"


@dataclass(frozen=True)
class MemoryReading:
    """Memory of one device: ``source`` is "nvml" (accelerator) or "process" (CPU host)."""

    device: str
    source: str
    used_bytes: int
    total_bytes: int

    @property
    def free_bytes(self) -> int:
        return max(0, self.total_bytes - self.used_bytes)


class MemorySource(Protocol):
    def read(self) -> MemoryReading: ...

    @property
    def device_class(self) -> str: ...  # a routing label: "cpu", "a100", "h200"...


def cgroup_memory_limit() -> int | None:
    """The memory limit of this process's cgroup (v2, else v1), None when unlimited."""
    for path in (
        Path("/sys/fs/cgroup/memory.max"),
        Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
    ):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        limit = int(text)
        # cgroup v1 reports "unlimited" as a huge number near 2**63.
        return limit if limit < 2**60 else None
    return None


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_memory_budget() -> int:
    limit = cgroup_memory_limit()
    share = int(physical_memory() * DEFAULT_PHYSICAL_SHARE)
    return min(int(limit * CGROUP_LIMIT_SHARE), share) if limit else share


def process_rss() -> int:
    with open("/proc/self/statm") as statm:
        resident_pages = int(statm.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


_VENDOR_WORDS = frozenset({"nvidia", "tesla", "geforce", "quadro"})


def device_class_name(device_name: str) -> str:
    """A short device class from an NVML device name, for routing labels:
    "NVIDIA A100-SXM4-80GB" -> "a100", "NVIDIA H200" -> "h200", "Tesla T4" -> "t4",
    "NVIDIA GeForce RTX 4090" -> "rtx4090"; "" -> "unknown"."""
    words = [w for w in device_name.lower().split() if w not in _VENDOR_WORDS]
    if not words:
        return "unknown"
    first = words[0].split("-")[0]
    if first in ("rtx", "gtx") and len(words) > 1:  # the model number is the next word
        first += words[1].split("-")[0]
    return re.sub(r"[^a-z0-9_.]", "", first) or "unknown"


class ProcessMemory:
    """CPU host: this process's resident memory against its budget."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes

    def read(self) -> MemoryReading:
        return MemoryReading("cpu", "process", process_rss(), self.budget_bytes)

    @property
    def device_class(self) -> str:
        return "cpu"


class DeviceUnavailable(Exception):
    """The device the server was started for cannot be used here (said at start, exit 2)."""


class NvmlMemory:
    """GPU host: device memory as NVML reports it (all processes on the device)."""

    def __init__(self, device_index: int) -> None:
        import pynvml

        try:
            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        except pynvml.NVMLError as exc:
            # Seen in the gpu image on a host without a GPU: a traceback from deep in pynvml.
            raise DeviceUnavailable(
                f"--device cuda:{device_index}: NVML cannot see that GPU ({exc}); this host has "
                "no NVIDIA driver or no such device, or the container was given no GPU "
                "(compose.gpu.yaml reserves one; the NVIDIA Container Toolkit brings the driver)"
            ) from None
        self._nvml = pynvml
        self.device = f"cuda:{device_index}"

    def read(self) -> MemoryReading:
        info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        return MemoryReading(self.device, "nvml", int(info.used), int(info.total))

    @property
    def device_class(self) -> str:
        name = self._nvml.nvmlDeviceGetName(self._handle)
        return device_class_name(name.decode() if isinstance(name, bytes) else str(name))


def nvml_device_count() -> int:
    """Number of NVIDIA devices NVML sees; 0 on a host without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no library: a CPU host
        return 0


def estimate_model_bytes(model_path: Path) -> int:
    """Expected resident cost of a model: its files (weights, external data) with overhead."""
    files = [model_path] + [
        p for p in model_path.parent.iterdir() if p != model_path and p.is_file()
    ]
    size = sum(p.stat().st_size for p in files)
    return int(size * MODEL_MEMORY_FACTOR) + MODEL_MEMORY_OVERHEAD


class MemoryGuard:
    """Admits a load only when its expected memory fits what is left of the budget.

    Loads admitted but not finished are reserved, so two concurrent loads cannot both
    take the same headroom.
    """

    def __init__(self, source: MemorySource) -> None:
        self.source = source
        self._reserved = 0
        self._lock = threading.Lock()

    def reserve(self, what: str, expected_bytes: int) -> None:
        """Reserves ``expected_bytes`` for loading ``what`` or raises MemoryBudgetExceeded."""
        reading = self.source.read()
        with self._lock:
            left = reading.free_bytes - self._reserved
            if expected_bytes > left:
                raise MemoryBudgetExceeded(
                    f"{what} needs about {format_bytes(expected_bytes)} but only "
                    f"{format_bytes(max(left, 0))} is left on {reading.device} "
                    f"({reading.source}: {format_bytes(reading.used_bytes)} used of "
                    f"{format_bytes(reading.total_bytes)}"
                    + (
                        f", {format_bytes(self._reserved)} reserved by loads in progress"
                        if self._reserved
                        else ""
                    )
                    + "); load refused"
                )
            self._reserved += expected_bytes

    def release(self, expected_bytes: int) -> None:
        with self._lock:
            self._reserved = max(0, self._reserved - expected_bytes)
