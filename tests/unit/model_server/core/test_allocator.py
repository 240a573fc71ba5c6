"""Freed memory stays in the heap: a model run's large arrays stop faulting in fresh pages."""

from __future__ import annotations

import subprocess
import sys

import pytest

from model_server.core import allocator

# Allocates and writes four 4 MiB arrays, then frees them, 50 times (as each generation step does
# with the gathered KV cache, a tensor per layer) and prints the minor page faults it took.
FAULTS = """
import resource, sys
import numpy as np
from model_server.core import allocator
applied = allocator.keep_freed_memory(int(sys.argv[1]))
np.ones(1 << 20, np.float32)  # numpy's own first-use allocations, outside the count
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    arrays = [np.ones(1 << 20, np.float32) for _ in range(4)]
    del arrays
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(keep_mib: int) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", FAULTS, str(keep_mib)],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.split()  # fmt: skip
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_kept_memory_is_reused_instead_of_faulted_in_again() -> None:
    applied, kept = faults(allocator.DEFAULT_KEEP_MIB)
    default, fresh = faults(0)
    assert (applied, default) == ("True", "False")
    # With glibc's defaults about half of the 50 x 4 x 1,024 pages of 4 KiB are faulted in again
    # (100-130 thousand here); with memory kept about one round's (1,000-1,600).
    assert fresh > 15 * 4 * 1024, fresh
    assert kept < 2 * 4 * 1024, kept


def test_zero_leaves_the_allocator_alone() -> None:
    assert allocator.keep_freed_memory(0) is False
