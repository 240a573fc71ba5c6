"""Adaptive hedging: each model's per-try timeout, from its pool's healthy P99 (pure).

The control plane re-weights a slow server within about a second, but the requests already on
their way there, and the trickle that measures it afterwards, set the tail: at 60 requests/s a
second of a third of the traffic is more than 1% of a 30 s window. So the data plane protects
the tail by itself: Envoy sends a try that has not answered within the per-try timeout to
another host (``hedge_on_per_try_timeout``, with the ``previous_hosts`` predicate), without
cancelling it; the first answer wins. This is Dean and Barroso's hedged request ("The Tail at
Scale"), with the delay taken from telemetry instead of fixed.

The per-try timeout is ``multiplier`` x the pool's healthy P99: the median of the P99s its
endpoints report, leaving out those routing ejected and those whose telemetry is stale, so one
slow server does not raise the bar it is measured against; and the highest of those medians
over the last ``RECENT_S``, so it rises at once and falls only after a calm spell. A per-try
timeout that followed every dip fell to the floor in a quiet second, below what a try takes
through Envoy, and the hedges of healthy tries loaded the pool until its P99 rose 20-fold
(bench_routing, round 3 of a run at 1.5x). It is clamped between ``floor_ms`` and the model's
SLA P99, and moves only when the new value differs from the one in force by more than
``hysteresis`` (a share of it): each move is a route push to every Envoy. A pool with no P99
yet keeps the value in force (none at first: no per-try timeout, no hedging).

The extra load is bounded by the model clusters' retry budget (``budget_percent`` of the
requests in flight may be retries or hedges) and by the listener's ``max_retries``.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from control_plane.model.mesh import HedgingPolicy
from control_plane.scoring.types import EndpointSignals

RECENT_S = 10.0  # the pool P99 a per-try timeout follows: the highest of this many seconds


@dataclass(frozen=True)
class PerTry:
    """The per-try timeout in force for one model, and how it was found."""

    per_try_ms: float
    pool_p99_ms: float  # the pool's healthy P99 it was computed from
    why: str  # e.g. "per-try 18 ms = 3 x pool P99 6 ms"

    @property
    def timeout_s(self) -> float:
        return self.per_try_ms / 1000.0


def pool_p99_ms(signals: Sequence[EndpointSignals], health: Mapping[str, str]) -> float | None:
    """The median P99 of the endpoints routing keeps (not ejected, telemetry fresh)."""
    kept = [
        s.p99_ms
        for s in signals
        if s.p99_ms is not None and not s.stale and health.get(s.endpoint, "HEALTHY") == "HEALTHY"
    ]
    return statistics.median(kept) if kept else None


def per_try(
    policy: HedgingPolicy | None, sla_p99_ms: float, p99_ms: float | None, current: PerTry | None
) -> PerTry | None:
    """The per-try timeout for a pool whose healthy P99 is ``p99_ms``, given ``current`` (the
    one in force): ``current`` itself while the change is within the hysteresis. None: the
    model is not hedged (``policy`` None), or no P99 was ever known."""
    if policy is None:
        return None
    if p99_ms is None:
        return current
    raw = policy.multiplier * p99_ms
    timeout = min(max(raw, policy.floor_ms), sla_p99_ms)
    if current is not None and abs(timeout - current.per_try_ms) <= policy.hysteresis * (
        current.per_try_ms
    ):
        return current
    timeout = round(timeout, 1)
    found = f"{policy.multiplier:g} x pool P99 {p99_ms:.1f} ms (the highest of {RECENT_S:g} s)"
    if raw < policy.floor_ms:
        why = f"per-try {timeout:g} ms = the floor ({found} = {raw:.1f} ms is under it)"
    elif raw > sla_p99_ms:
        why = f"per-try {timeout:g} ms = the SLA P99 ({found} = {raw:.1f} ms is over it)"
    else:
        why = f"per-try {timeout:g} ms = {found}"
    return PerTry(timeout, round(p99_ms, 2), why)


@dataclass(frozen=True)
class HedgeState:
    """What one pool's hedging keeps between recomputes."""

    per_try: PerTry | None = None
    recent: tuple[tuple[float, float], ...] = ()  # (when, the pool's healthy P99) of RECENT_S


def follow(
    policy: HedgingPolicy | None, sla_p99_ms: float, p99_ms: float | None, now: float,
    state: HedgeState,
) -> HedgeState:  # fmt: skip
    """The next state for a pool whose healthy P99 is ``p99_ms`` now (None: not known)."""
    if policy is None:
        return HedgeState()
    recent = tuple((t, v) for t, v in state.recent if now - t < RECENT_S)
    if p99_ms is not None:
        recent += ((now, p99_ms),)
    highest = max((v for _, v in recent), default=None)
    return HedgeState(per_try(policy, sla_p99_ms, highest, state.per_try), recent)
