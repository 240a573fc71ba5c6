"""Outlier ejection: which endpoints of a pool are taken out, for how long, and why.

Pure: the previous per-endpoint states and the time come in, the new states come out.

Error rates and latencies are read over the telemetry window (``window_s``, 10 s by default),
and an ejected endpoint gets no requests: when a back-off shorter than the window ends, the
window still holds the requests that ejected it. So an endpoint back from an ejection is not
judged again on that ejection's causes until the window since the ejection began has passed
(its "grace"); memory is a gauge, read as it is now, and is judged at once. A server still
failing then serves until the window has turned over (Envoy's own outlier detection can still
eject it on consecutive 5xx), which is the price of not re-ejecting on stale evidence.
"""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from control_plane.scoring.types import RECOMPUTE_PERIOD_S, EndpointSignals, PoolPolicy

HEALTHY = "HEALTHY"
UNHEALTHY = "UNHEALTHY"
DRAINING = "DRAINING"
FAIL_OPEN_REASON = "every endpoint looks bad: failing open to weights"
STRIKE_SPACING_S = 0.9 * RECOMPUTE_PERIOD_S  # one latency strike a period (ticks are not exact)
WINDOW_S = 10.0  # the telemetry store's default window (topology telemetry.window_s)


class EjectionCause(enum.Enum):
    """Why the signals say "eject" (the words for people are in the reasons)."""

    MEMORY = "memory"
    ERRORS = "errors"
    LATENCY = "latency"


@dataclass(frozen=True)
class EjectionState:
    """What ejection remembers about one endpoint between recomputes."""

    ejected: bool = False
    reason: str = ""  # for people (/status, decisions)
    causes: frozenset[EjectionCause] = frozenset()  # while ejected: what the code reads
    ejected_at: float | None = None  # start of the current ejection
    until: float | None = None  # end of the current back-off
    times_ejected: int = 0  # ejections and extensions so far; sets the back-off length
    latency_strikes: int = 0  # p99 over factor x SLA this many periods in a row ...
    struck_at: float | None = None  # ... the last of them counted then
    draining: bool = False
    returned_at: float | None = None  # last return to service (feeds slow start)
    # Back from an ejection: its windowed causes, not judged again until the telemetry window
    # since ``ejected_at`` has passed (the window still holds what ejected it); then emptied.
    grace: frozenset[EjectionCause] = frozenset()


_NEVER_JUDGED = EjectionState()  # an endpoint new to the pool (one value: states are frozen)


@dataclass(frozen=True)
class EjectionDecision:
    states: dict[str, EjectionState]
    health: dict[str, str]  # HEALTHY, UNHEALTHY (ejected) or DRAINING
    reasons: dict[str, str]
    events: list[str] = field(default_factory=list)
    fail_open: bool = False
    fail_open_reason: str = ""


def backoff_s(times_ejected: int, policy: PoolPolicy) -> float:
    """base x 2**(n-1), capped; the exponent is bounded so huge counts cannot overflow."""
    exponent = min(max(times_ejected - 1, 0), 64)
    return float(min(policy.backoff_base_s * 2.0**exponent, policy.backoff_max_s))


def _pct(value: float) -> str:
    return f"{value * 100:.0f}%"


@dataclass(frozen=True)
class _Verdict:
    causes: tuple[str, ...]  # why the signals say "eject", in words; empty when they do not
    severity: tuple[float, float, float]  # memory, error, latency: larger is worse
    strikes: int
    struck_at: float | None = None
    kinds: frozenset[EjectionCause] = frozenset()  # ``causes`` as values


def _judge(
    sig: EndpointSignals,
    policy: PoolPolicy,
    prev: EjectionState,
    now: float,
    others_p99: float | None = None,
    others_abandoned: float | None = None,
    graced: frozenset[EjectionCause] = frozenset(),
) -> _Verdict:
    """Eject conditions from the current signals; stale or missing signals never eject.

    ``others_p99``: the median P99 of the rest of the pool. A server is slow enough to eject
    only when it is also ``latency_eject_vs_pool`` times slower than that: when the whole host
    stalls, every server looks slow and none of them is the outlier.
    ``others_abandoned``: the median share of tries abandoned over the rest of the pool. When
    it is half the threshold or more, the whole pool's tries are being hedged (a per-try
    timeout under what tries take, which the hedging guard raises): no server is the slow one.
    ``graced``: causes not judged (see ``_graced``).
    """
    if sig.stale:
        return _Verdict((), (0.0, 0.0, 0.0), 0)
    causes: list[str] = []
    kinds: set[EjectionCause] = set()
    mem = err = lat = 0.0
    used, total = sig.memory_used_bytes, sig.memory_total_bytes
    if used is not None and total is not None and total > 0:
        ratio = used / total
        if ratio >= policy.memory_watermark:
            mem = ratio
            causes.append(f"memory {_pct(ratio)} >= watermark {_pct(policy.memory_watermark)}")
            kinds.add(EjectionCause.MEMORY)
    errors_judged = EjectionCause.ERRORS not in graced
    if errors_judged and sig.error_rate is not None and sig.error_rate >= policy.error_rate_eject:
        err = sig.error_rate
        causes.append(f"error rate {_pct(sig.error_rate)} >= {_pct(policy.error_rate_eject)}")
        kinds.add(EjectionCause.ERRORS)
    abandoned = None if EjectionCause.LATENCY in graced else sig.abandoned_rate
    pool_hedged = others_abandoned is not None and others_abandoned >= policy.error_rate_eject / 2
    if abandoned is not None and abandoned >= policy.error_rate_eject and not pool_hedged:
        # Hedging cancels the tries that lost their race: the server's own P99 then stops at
        # about the per-try timeout, and the share its callers gave up on says how slow it is.
        lat = max(lat, abandoned)
        causes.append(
            f"tries abandoned {_pct(abandoned)} >= {_pct(policy.error_rate_eject)} (slower "
            "than the per-try timeout: hedged to other servers)"
        )
        kinds.add(EjectionCause.LATENCY)
    strikes, struck_at = 0, None
    limit = policy.latency_eject_factor * policy.sla_p99_ms
    if others_p99 is not None and policy.latency_eject_vs_pool > 0:
        limit = max(limit, policy.latency_eject_vs_pool * others_p99)
    p99 = None if EjectionCause.LATENCY in graced else sig.p99_ms
    if p99 is not None and p99 > limit:
        strikes, struck_at = prev.latency_strikes, prev.struck_at
        # One strike a period: recomputes that come faster than that do not make three
        # windows out of one slow report.
        if struck_at is None or now - struck_at >= STRIKE_SPACING_S or not strikes:
            strikes, struck_at = strikes + 1, now
        if strikes >= policy.latency_eject_windows:
            lat = p99 / policy.sla_p99_ms if policy.sla_p99_ms > 0 else math.inf
            causes.append(
                f"p99 {p99:.0f} ms > {policy.latency_eject_factor:g} x SLA "
                f"{policy.sla_p99_ms:.0f} ms for {strikes} window{'s' if strikes != 1 else ''}"
            )
            kinds.add(EjectionCause.LATENCY)
    return _Verdict(tuple(causes), (mem, err, lat), strikes, struck_at, frozenset(kinds))


class _PoolMedian:
    """The median of one signal (``name``: an ``EndpointSignals`` field) over a pool without
    one of its endpoints; sorted once per pool, then O(log n) per endpoint (no copy of the
    pool's values)."""

    def __init__(self, pool: Sequence[EndpointSignals], name: str = "p99_ms") -> None:
        self.name = name
        self.values = sorted(v for s in pool if (v := getattr(s, name)) is not None and not s.stale)

    def without(self, sig: EndpointSignals) -> float | None:
        values = self.values
        # Where sig's own value sits (any equal value gives the same median); len: none left out.
        gone = len(values)
        own = getattr(sig, self.name)
        if own is not None and not sig.stale:
            gone = bisect.bisect_left(values, own)
        left = len(values) - (gone < len(values))
        if left == 0:
            return None

        def at(k: int) -> float:  # the k-th of the values left
            return float(values[k] if k < gone else values[k + 1])

        middle = left // 2
        return at(middle) if left % 2 else (at(middle - 1) + at(middle)) / 2


def _graced(prev: EjectionState, now: float, window_s: float) -> frozenset[EjectionCause]:
    """The causes of an endpoint's last ejection that its signals cannot judge yet: until
    ``window_s`` after the ejection began, its error rate and latency still hold the requests
    from before it (it got none while out). Memory is a gauge: never graced."""
    if prev.ejected_at is None or now >= prev.ejected_at + window_s:
        return frozenset()
    return (prev.causes if prev.ejected else prev.grace) - {EjectionCause.MEMORY}


def _max_out(serving: int, share: float) -> int:
    # A pool of one is never emptied, whatever the share.
    if serving <= 1:
        return 0
    return math.floor(min(max(share, 0.0), 1.0) * serving)


def _with(state: EjectionState, **changes: Any) -> EjectionState:
    """``replace``, or ``state`` itself when nothing changes: the usual case for a healthy
    endpoint, and ``replace`` for every endpoint was a fifth of a fleet's recompute."""
    for name, value in changes.items():
        if getattr(state, name) != value:
            return replace(state, **changes)
    return state


def decide_ejections(
    signals: Sequence[EndpointSignals],
    policy: PoolPolicy,
    previous: Mapping[str, EjectionState],
    now: float,
    window_s: float = WINDOW_S,
) -> EjectionDecision:
    """Eject, extend, return or keep each endpoint; endpoints absent from signals are dropped.

    ``window_s``: the telemetry window the error rates and latencies are read over."""
    states: dict[str, EjectionState] = {}
    health: dict[str, str] = {}
    reasons: dict[str, str] = {}
    events: list[str] = []

    serving: list[EndpointSignals] = []
    for sig in signals:
        prev = previous.get(sig.endpoint, _NEVER_JUDGED)
        if not sig.draining:
            serving.append(sig)
            continue
        # Draining is the server's own choice: no back-off, not counted as ejected.
        states[sig.endpoint] = _with(
            prev, ejected=False, until=None, latency_strikes=0, struck_at=None, draining=True
        )
        health[sig.endpoint] = DRAINING
        reasons[sig.endpoint] = "draining: server reports draining"
        if not prev.draining:
            events.append(f"{sig.endpoint} is draining: the server reports draining.")

    pool_p99 = _PoolMedian(serving)
    pool_abandoned = _PoolMedian(serving, "abandoned_rate")
    verdicts = {
        s.endpoint: _judge(
            s,
            policy,
            previous.get(s.endpoint, _NEVER_JUDGED),
            now,
            pool_p99.without(s),
            pool_abandoned.without(s),
            _graced(previous.get(s.endpoint, _NEVER_JUDGED), now, window_s),
        )
        for s in serving
    }

    def wants_out(ep: str) -> bool:
        prev = previous.get(ep, _NEVER_JUDGED)
        in_backoff = prev.ejected and prev.until is not None and now < prev.until
        return in_backoff or bool(verdicts[ep].causes)

    candidates = [s.endpoint for s in serving if wants_out(s.endpoint)]
    fail_open = bool(candidates) and len(candidates) == len(serving)
    cap = _max_out(len(serving), policy.max_ejected_share)

    # Already ejected first (no flapping), then the worst: memory, error rate, latency.
    def rank(ep: str) -> tuple[bool, tuple[float, float, float], str]:
        sev = verdicts[ep].severity
        return (not previous.get(ep, _NEVER_JUDGED).ejected, (-sev[0], -sev[1], -sev[2]), ep)

    # Failing open never brings back a server over its memory watermark: it would run out of
    # memory, whatever the others look like (they may only be slow for a moment).
    over_memory = [ep for ep in candidates if verdicts[ep].severity[0] > 0]
    eligible = over_memory if fail_open else candidates
    chosen = set(sorted(eligible, key=rank)[:cap])
    if fail_open:
        events.append(f"Pool fails open: {FAIL_OPEN_REASON}.")
    share_text = f"at most {policy.max_ejected_share * 100:g}% of the pool may be out"

    for sig in serving:
        ep = sig.endpoint
        prev = previous.get(ep, _NEVER_JUDGED)
        verdict = verdicts[ep]
        why = "; ".join(verdict.causes)
        base = _with(
            prev, latency_strikes=verdict.strikes, struck_at=verdict.struck_at, draining=False
        )
        if prev.draining:
            base = replace(base, returned_at=now)  # back from draining: ramp up again
            events.append(f"{ep} stopped draining.")
        if ep in chosen:
            health[ep] = UNHEALTHY
            in_backoff = prev.ejected and prev.until is not None and now < prev.until
            if in_backoff:
                # Failing open keeps out only servers over their memory watermark: one in
                # back-off for its latency that is now over its memory says so (otherwise
                # the back-off's reason stands, so the state does not churn every tick).
                reason = f"ejected: {why}" if fail_open else prev.reason
                causes = verdict.kinds if fail_open else prev.causes
                states[ep] = _with(base, reason=reason, causes=causes)
                reasons[ep] = reason
                continue
            times = prev.times_ejected + 1
            out_for = backoff_s(times, policy)
            reason = f"ejected: {why}"
            states[ep] = replace(
                base,
                ejected=True,
                reason=reason,
                causes=verdict.kinds,
                until=now + out_for,
                times_ejected=times,
                ejected_at=prev.ejected_at if prev.ejected else now,
                grace=frozenset(),
            )
            reasons[ep] = reason
            verb = "stays ejected" if prev.ejected else "ejected"
            events.append(f"{ep} {verb} for {out_for:g} s: {why}.")
            continue
        health[ep] = HEALTHY
        if ep in candidates:
            what = why or "still in back-off"
            limit = FAIL_OPEN_REASON if fail_open else share_text
            reasons[ep] = f"would eject ({what}), but {limit}"
        elif prev.ejected:
            out_s = now - (now if prev.ejected_at is None else prev.ejected_at)
            reasons[ep] = f"returned after {round(out_s, 1):g} s ejected"
        elif sig.stale:
            reasons[ep] = "healthy (signals stale: not judged)"
        else:
            reasons[ep] = "healthy"
        if fail_open and prev.ejected and prev.until is not None and now < prev.until:
            # Served while the pool fails open, but its ejection goes on: when the pool stops
            # failing open it is out for the rest of its back-off, not ejected anew (which
            # flapped with the pool and doubled its back-off at every flap).
            states[ep] = base
            continue
        if prev.ejected:
            states[ep] = replace(
                base, ejected=False, until=None, returned_at=now, reason=reasons[ep],
                causes=frozenset(), grace=_graced(prev, now, window_s),
            )  # fmt: skip
            early = ep in candidates  # cut by the share cap or by failing open
            events.append(f"{ep} returned: {reasons[ep]}." if early else f"{ep} {reasons[ep]}.")
        else:
            since = prev.returned_at
            if prev.times_ejected and since is not None and now - since >= policy.backoff_max_s:
                base = replace(base, times_ejected=0)  # a new incident starts over
            states[ep] = _with(base, reason=reasons[ep], grace=_graced(prev, now, window_s))
    return EjectionDecision(
        states=states,
        health=health,
        reasons=reasons,
        events=events,
        fail_open=fail_open,
        fail_open_reason=FAIL_OPEN_REASON if fail_open else "",
    )
