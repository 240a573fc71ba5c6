"""Garbage-collector settings for the control plane's processes.

The control plane allocates in bursts: a shard's push of 10,000 endpoints makes a few
hundred thousand tuples and objects, nearly all long-lived and none in cycles. With
CPython's default thresholds (700, 10, 10) such a burst runs hundreds of young collections
and several full ones, each traversing every endpoint's telemetry: receiving one push cost
572 ms, 277 ms with the settings below (``bench/bench_control_plane_steps.py`` prints both).
Collection stays on: cycles are still freed, a little later."""

from __future__ import annotations

import gc

# Young collections every 50,000 allocations (about 5 MB of small objects), a middle one every
# 20 of those and a full one every 100 middle ones (and only when enough survived, as always).
THRESHOLDS = (50_000, 20, 100)


def tune_gc() -> None:
    """Apply ``THRESHOLDS`` and move what exists now (modules, configuration) out of the
    collector's sight for good (``gc.freeze``). Call once the process has started."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
