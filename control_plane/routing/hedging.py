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
requests in flight may be retries or hedges) and by the listener's ``max_retries``. Envoy's
budget has a floor of 10 concurrent retries, so at low concurrency it bounds nothing; and the
per-try timeout comes from the servers' own P99, which leaves out what a try costs through
Envoy and the network. So a **guard** watches the hedges themselves, where they happen: Envoy's
retries per first try to the model's clusters over the last 10 s (``upstream_rq_retry``
over ``upstream_rq_total``; a hedge counts as a retry), from its stat sink. Above the budget
(``budget_percent``) the timeout is under what healthy tries take: it is doubled (``boost``, at
most ``MAX_BOOST``, at most once every ``BOOST_SPACING_S``, half the window, so one boost shows
before the next; never past the SLA P99). It is halved again after ``RECENT_S`` with the share
under half the budget. A slow server of three, re-weighted in about a second, costs about 4%
over a 10 s window, under the budget, so the guard does not blunt hedging where it is meant to
work. (The servers' share of tries abandoned is no such signal: a losing hedge of a healthy
try has mostly finished by the time its cancel arrives.)
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from control_plane.model.mesh import HedgingPolicy
from control_plane.scoring.types import EndpointSignals

RECENT_S = 10.0  # the pool P99 a per-try timeout follows: the highest of this many seconds
MAX_BOOST = 8.0
BOOST_SPACING_S = 5.0  # half the 10 s the share is counted over: a boost shows in the share by then


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
    policy: HedgingPolicy | None,
    sla_p99_ms: float,
    p99_ms: float | None,
    current: PerTry | None,
    boost: float = 1.0,
) -> PerTry | None:
    """The per-try timeout for a pool whose healthy P99 is ``p99_ms``, given ``current`` (the
    one in force) and the guard's ``boost``: ``current`` itself while the change is within the
    hysteresis. None: the model is not hedged (``policy`` None), or no P99 was ever known."""
    if policy is None:
        return None

    def clamped(ms: float) -> float:
        return min(max(ms, policy.floor_ms), sla_p99_ms)

    if current is not None and abs(clamped(current.per_try_ms) - current.per_try_ms) > 0.05:
        # The floor or the SLA moved (a topology reload): never keep a timeout outside them,
        # whatever the hysteresis says; recompute from the newest P99 known.
        p99_ms = current.pool_p99_ms if p99_ms is None else p99_ms
        current = None
    if p99_ms is None:
        return current
    raw = policy.multiplier * boost * p99_ms
    timeout = clamped(raw)
    if current is not None and abs(timeout - current.per_try_ms) <= policy.hysteresis * (
        current.per_try_ms
    ):
        return current
    timeout = round(timeout, 1)
    found = f"{policy.multiplier:g} x pool P99 {p99_ms:.1f} ms (the highest of {RECENT_S:g} s)"
    if boost != 1.0:
        found = (
            f"{found} x {boost:g} (the guard: Envoy hedged more than the "
            f"{policy.budget_percent:g}% budget of first tries, so healthy tries were hedged)"
        )
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
    boost: float = 1.0  # the guard's factor on the multiplier
    boosted_at: float | None = None  # the guard's last move
    calm_since: float | None = None  # hedged under half the budget since then


def _guard(
    hedged: float | None, budget: float, now: float, state: HedgeState, at_sla: bool
) -> tuple[float, float | None, float | None]:
    """The guard's next (boost, boosted_at, calm_since) for Envoy's hedges per first try
    (``at_sla``: the timeout in force is the SLA P99 already, so a boost cannot raise it)."""
    boost, boosted_at, calm_since = state.boost, state.boosted_at, state.calm_since
    settled = boosted_at is None or now - boosted_at >= BOOST_SPACING_S
    if hedged is not None and hedged > budget:
        if settled and boost < MAX_BOOST and not at_sla:
            return min(boost * 2.0, MAX_BOOST), now, None
        return boost, boosted_at, None
    if hedged is None or hedged >= budget / 2:
        return boost, boosted_at, None
    calm_since = now if calm_since is None else calm_since
    if boost > 1.0 and now - calm_since >= RECENT_S and settled:
        return max(boost / 2.0, 1.0), now, now
    return boost, boosted_at, calm_since


def follow(
    policy: HedgingPolicy | None, sla_p99_ms: float, p99_ms: float | None, now: float,
    state: HedgeState, hedged: float | None = None,
) -> HedgeState:  # fmt: skip
    """The next state for a pool whose healthy P99 is ``p99_ms`` now (None: not known) and
    to which Envoy sent ``hedged`` retries per first try over the last 10 s (None: no word)."""
    if policy is None:
        return HedgeState()
    recent = tuple((t, v) for t, v in state.recent if now - t < RECENT_S)
    if p99_ms is not None:
        recent += ((now, p99_ms),)
    highest = max((v for _, v in recent), default=None)
    at_sla = state.per_try is not None and state.per_try.per_try_ms >= sla_p99_ms
    budget = policy.budget_percent / 100
    boost, boosted_at, calm_since = _guard(hedged, budget, now, state, at_sla)
    # A guard's move always applies: within the hysteresis it would be lost (and its why too).
    current = state.per_try if boost == state.boost else None
    timeout = per_try(policy, sla_p99_ms, highest, current, boost)
    return HedgeState(timeout, recent, boost, boosted_at, calm_since)
