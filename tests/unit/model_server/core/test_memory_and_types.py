"""Sizes, the memory guard's arithmetic, and KServe BYTES framing (pure functions)."""

from __future__ import annotations

import numpy as np
import pytest

from model_server.core.datatypes import deserialize_bytes, serialize_bytes, to_onnx_strings
from model_server.core.errors import MemoryBudgetExceeded
from model_server.core.memory import MemoryGuard, MemoryReading, ProcessMemory, parse_bytes

MiB = 1024**2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1024", 1024),
        ("512MiB", 512 * MiB),
        ("4GiB", 4 * 1024**3),
        ("2G", 2 * 10**9),
        ("1.5 GiB", int(1.5 * 1024**3)),
        ("64k", 64_000),
        ("10mb", 10 * 10**6),
    ],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "-1GiB", "0", "12 parsecs", "1e9"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_bytes(text)


class FixedMemory:
    """A memory source with fixed readings: the guard's arithmetic without a real device."""

    def __init__(self, used: int, total: int) -> None:
        self.reading = MemoryReading("cuda:0", "nvml", used, total)

    def read(self) -> MemoryReading:
        return self.reading

    @property
    def device_class(self) -> str:
        return "a100"


def test_guard_admits_what_fits_and_reserves_it() -> None:
    guard = MemoryGuard(FixedMemory(used=600 * MiB, total=1000 * MiB))
    guard.reserve("a", 300 * MiB)
    with pytest.raises(MemoryBudgetExceeded) as caught:
        guard.reserve("model 'b' version 1", 200 * MiB)
    message = str(caught.value)
    assert "model 'b' version 1 needs about 200.0 MiB but only 100.0 MiB is left on cuda:0" in (
        message
    )
    assert "300.0 MiB reserved by loads in progress" in message
    guard.release(300 * MiB)
    guard.reserve("b", 200 * MiB)  # fits once the first load has finished


def test_process_memory_reads_this_process() -> None:
    reading = ProcessMemory(budget_bytes=64 * 1024**3).read()
    assert reading.source == "process" and 10 * MiB < reading.used_bytes < reading.total_bytes


def test_bytes_framing_round_trip() -> None:
    items = np.array([b"", b"abc", "é".encode(), b"\0" * 70000], dtype=object)
    decoded = deserialize_bytes(serialize_bytes(items), 4)
    assert list(decoded) == list(items)


def test_onnx_strings_decode_utf8_and_name_the_bad_element() -> None:
    assert list(to_onnx_strings(np.array([b"a", b"\xc3\xa9"], dtype=object))) == ["a", "é"]
    with pytest.raises(ValueError, match="element 1 is not valid UTF-8"):
        to_onnx_strings(np.array([b"a", b"\xff"], dtype=object))


def test_a_containers_limit_leaves_headroom_below_the_oom_killer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a container the budget is 90% of the cgroup limit, so the control plane's ejection
    (95% of the budget) comes at 85.5% of what the kernel kills at."""
    from model_server.core import memory

    monkeypatch.setattr(memory, "physical_memory", lambda: 64 * 2**30)
    monkeypatch.setattr(memory, "cgroup_memory_limit", lambda: 1000 * 2**20)
    assert memory.default_memory_budget() == int(1000 * 2**20 * 0.9)
    monkeypatch.setattr(memory, "cgroup_memory_limit", lambda: None)
    assert memory.default_memory_budget() == int(64 * 2**30 * 0.8)


def test_a_gpu_asked_for_on_a_host_without_one_is_refused_by_name() -> None:
    """The gpu image on a CPU host: a clear start-up error, not a traceback from pynvml."""
    from model_server.core import memory

    if memory.nvml_device_count() > 0:
        pytest.skip("this host has a GPU NVML can see")
    with pytest.raises(memory.DeviceUnavailable, match=r"--device cuda:0: NVML cannot see"):
        memory.NvmlMemory(0)
