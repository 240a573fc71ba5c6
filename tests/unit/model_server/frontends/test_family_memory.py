"""The memory guard's reading with front ends: their private memory counts with the engine's
against the budget (not their shared pool pages, which the engine maps too); a front end gone
between listing and reading counts nothing. And each front end's share of the RPC limit."""

from __future__ import annotations

import os

from model_server.core.memory import ProcessMemory
from model_server.frontends.engine import (
    FamilyMemory,
    frontend_rpc_limit,
    private_bytes,
    resident_bytes,
)


def test_front_ends_count_against_the_budget() -> None:
    alone = ProcessMemory(1 << 40)
    family = FamilyMemory(alone, lambda: [os.getpid(), 2**22 + 1])  # itself, and no such pid
    base, both = alone.read(), family.read()
    assert both.total_bytes == base.total_bytes and both.source == "process"
    assert both.used_bytes >= base.used_bytes + private_bytes(os.getpid()) // 2
    assert 0 < private_bytes(os.getpid()) < resident_bytes(os.getpid())  # libraries: shared
    assert private_bytes(2**22 + 1) == 0 and resident_bytes(2**22 + 1) == 0
    assert family.device_class == "cpu"


def test_front_ends_share_the_rpc_limit_instead_of_each_taking_it_whole() -> None:
    assert frontend_rpc_limit(0, 4) == 0  # no limit stays none
    assert frontend_rpc_limit(64, 4) == 16
    assert frontend_rpc_limit(10, 4) == 3  # rounded up: never 0, which would mean no limit
    assert frontend_rpc_limit(1, 4) == 1
