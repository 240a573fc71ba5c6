"""When a pool's recompute can be skipped: it is at rest and its inputs have not moved.

A recompute is a pure function of the pool's signals, its policy, what the previous one left
(smoothed scores, weights, ejection states, slow-start ramps) and the time. A pool is at rest
when its last recompute changed nothing and nothing in it waits on the clock (an ejection's
back-off, latency strikes, a slow-start ramp, probation): the same signals would give the
same result again.
At fleet scale most pools are at rest most of the time, so a telemetry change costs the
recompute of its own pool, not of all of them.

"Moved" allows a tolerance (``PoolPolicy.recompute_tolerance``, relative, 5% by default):
percentiles move with every report's rounding, and rates of an exporter that sends no start
time are measured over arrival times, which wobble with the receiver's queues (at 2%, exports
arriving up to 0.3 s late made most pools look changed at every tick). The reference
is the signals of the last recompute, not of the last tick, so a slow drift cannot creep past
the tolerance unnoticed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from control_plane.scoring.ejection import EjectionState
from control_plane.scoring.pipeline import PoolState
from control_plane.scoring.types import EndpointSignals, PoolPolicy

SCORE_EPSILON = 1e-4  # smoothed scores closer than this have converged (scores are in [0, 1])
_NUMBERS = (
    "qps",
    "p99_ms",
    "error_rate",
    "abandoned_rate",
    "memory_used_bytes",
    "memory_total_bytes",
    "kv_blocks_used",
    "kv_blocks_total",
    "queue_depth",
)


def near(a: float | None, b: float | None, tolerance: float) -> bool:
    """Equal within ``tolerance`` of the larger magnitude (None only equals None)."""
    if a is None or b is None:
        return a is b
    return a == b or abs(a - b) <= tolerance * max(abs(a), abs(b))


def signals_moved(
    before: Sequence[EndpointSignals], now: Sequence[EndpointSignals], tolerance: float
) -> bool:
    """True when the pool's members, a flag or label, or a number beyond ``tolerance`` moved."""
    if len(before) != len(now):
        return True
    for old, new in zip(before, now, strict=True):
        if old is new or old == new:
            continue
        if (old.endpoint, old.ready, old.stale, old.draining, old.labels) != (
            new.endpoint,
            new.ready,
            new.stale,
            new.draining,
            new.labels,
        ):
            return True
        if not all(near(getattr(old, f), getattr(new, f), tolerance) for f in _NUMBERS):
            return True
    return False


def at_rest(
    before: tuple[PoolState | None, Mapping[str, EjectionState]],
    after: tuple[PoolState, Mapping[str, EjectionState]],
    joined_at: Mapping[str, float],
    on_probation: Iterable[str],
    policy: PoolPolicy,
    now: float,
) -> bool:
    """True when a recompute (``before`` -> ``after``: pool state, ejection states) changed
    nothing and nothing in the pool moves with time alone."""
    state_before, ejections_before = before
    state, ejections = after
    if state_before is None or state.weights != state_before.weights:
        return False
    old_scores = state_before.scores
    if old_scores.keys() != state.scores.keys() or any(
        abs(v - old_scores[k]) > SCORE_EPSILON for k, v in state.scores.items()
    ):
        return False  # the EWMA is still converging
    if dict(ejections) != dict(ejections_before) or any(on_probation):
        return False
    for e in ejections.values():
        if e.ejected or e.latency_strikes or e.grace:
            return False  # its back-off, its grace end with time; its next strike comes with time
        returned = e.returned_at
        if e.times_ejected and returned is not None and now - returned < policy.backoff_max_s:
            return False  # its count of ejections is reset with time
    return all(now - t >= policy.slow_start_s for t in joined_at.values())
