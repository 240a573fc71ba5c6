"""The control plane's processes collect garbage rarely enough for bursts of telemetry, and
still collect it."""

from __future__ import annotations

import subprocess
import sys

from tests.support import ROOT

# In a child process, so the test process keeps its own settings: young collections during a
# burst like a shard's push (300,000 tuples kept), and whether a cycle made afterwards is
# still freed by the collector on its own.
CHILD = """
import gc, sys, weakref
from control_plane.gc_tuning import tune_gc
runs = [0]
gc.callbacks.append(lambda phase, info: runs.__setitem__(0, runs[0] + (phase == "start")))
if sys.argv[1] == "tuned":
    tune_gc()
kept = [(i, str(i)) for i in range(300_000)]
burst_collections = runs[0]

class Node:
    pass

a, b = Node(), Node()
a.other, b.other = b, a
gone = weakref.ref(a)
del a, b
churn = [[i] for i in range(200_000)]  # allocations only: no explicit gc.collect()
print(burst_collections, gc.isenabled(), gone() is None)
"""


def run_child(mode: str) -> tuple[int, bool, bool]:
    done = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                          timeout=120, check=True, cwd=ROOT)  # fmt: skip
    collections, enabled, freed = done.stdout.split()
    return int(collections), enabled == "True", freed == "True"


def test_a_burst_runs_few_collections_and_cycles_are_still_freed() -> None:
    default, _, _ = run_child("default")
    tuned, enabled, freed = run_child("tuned")
    assert default >= 100  # CPython's 700-allocation young generation
    assert tuned <= default / 20, (tuned, default)
    assert enabled and freed  # collection is on: a dropped cycle is freed without being asked
