"""The memory guard's reading with front ends: their resident memory counts with the
engine's against the budget; a front end gone between listing and reading counts nothing."""

from __future__ import annotations

import os

from model_server.core.memory import ProcessMemory
from model_server.frontends.engine import FamilyMemory, resident_bytes


def test_front_ends_count_against_the_budget() -> None:
    alone = ProcessMemory(1 << 40)
    family = FamilyMemory(alone, lambda: [os.getpid(), 2**22 + 1])  # itself, and no such pid
    base, both = alone.read(), family.read()
    assert both.total_bytes == base.total_bytes and both.source == "process"
    assert both.used_bytes >= base.used_bytes + resident_bytes(os.getpid()) // 2
    assert resident_bytes(2**22 + 1) == 0
    assert family.device_class == "cpu"
