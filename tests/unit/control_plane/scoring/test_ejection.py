"""Ejection rules, back-off, the share cap, fail-open, draining; slow start."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.scoring.ejection import (
    DRAINING,
    HEALTHY,
    UNHEALTHY,
    EjectionDecision,
    EjectionState,
    _PoolMedian,
    backoff_s,
    decide_ejections,
)
from control_plane.scoring.slow_start import apply_slow_start, slow_start_factor
from control_plane.scoring.types import EndpointSignals, PoolPolicy

GIB = 1024.0**3
POLICY = PoolPolicy(capacity_qps=100.0, sla_p99_ms=200.0)
ONE_WINDOW = PoolPolicy(capacity_qps=100.0, sla_p99_ms=200.0, latency_eject_windows=1)


def sig(name: str = "a:1", **kw: Any) -> EndpointSignals:
    base: dict[str, Any] = {
        "p99_ms": 100.0,
        "error_rate": 0.0,
        "memory_used_bytes": 10 * GIB,
        "memory_total_bytes": 100 * GIB,
    }
    base.update(kw)
    return EndpointSignals(endpoint=name, **base)


def good(name: str) -> EndpointSignals:
    return sig(name)


def decide(
    signals: Sequence[EndpointSignals],
    previous: Mapping[str, EjectionState] | None = None,
    now: float = 0.0,
    policy: PoolPolicy = POLICY,
) -> EjectionDecision:
    return decide_ejections(signals, policy, previous or {}, now)


# Each rule with one bad endpoint among three good ones (so the 50% cap is not in the way).
@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (
            {"memory_used_bytes": 97 * GIB},
            "ejected: memory 97% >= watermark 95%",
        ),
        ({"error_rate": 0.6}, "ejected: error rate 60% >= 50%"),
        ({"error_rate": 0.5}, "ejected: error rate 50% >= 50%"),
        (
            {"abandoned_rate": 0.7},
            "ejected: tries abandoned 70% >= 50% (slower than the per-try timeout: hedged to "
            "other servers)",
        ),
        ({"memory_used_bytes": 95 * GIB}, "ejected: memory 95% >= watermark 95%"),
    ],
)
def test_single_rule_ejects_with_reason(bad: dict[str, Any], reason: str) -> None:
    d = decide([sig("x:1", **bad), good("b:1"), good("c:1"), good("d:1")])
    assert d.health == {"x:1": UNHEALTHY, "b:1": HEALTHY, "c:1": HEALTHY, "d:1": HEALTHY}
    assert d.reasons["x:1"] == reason
    assert d.states["x:1"].ejected and d.states["x:1"].until == 5.0
    assert d.states["x:1"].times_ejected == 1
    assert any(e.startswith("x:1 ejected for 5 s") for e in d.events)
    assert not d.fail_open and d.fail_open_reason == ""


@pytest.mark.parametrize(
    "ok",
    [
        {"memory_used_bytes": 94 * GIB},
        {"error_rate": 0.49},
        {"p99_ms": 400.0},  # exactly factor x SLA is not over it
        {"memory_total_bytes": 0.0, "memory_used_bytes": 5.0},
    ],
)
def test_just_below_thresholds_stays_healthy(ok: dict[str, Any]) -> None:
    prev: dict[str, EjectionState] = {}
    for t in range(5):
        d = decide([sig("x:1", **ok), good("b:1"), good("c:1")], prev, now=float(t))
        prev = d.states
        assert d.health["x:1"] == HEALTHY and d.reasons["x:1"] == "healthy"


def test_latency_needs_consecutive_strikes_and_resets() -> None:
    pool = [good("b:1"), good("c:1"), good("d:1")]
    slow = sig("x:1", p99_ms=412.0)
    d1 = decide([slow, *pool])
    d2 = decide([slow, *pool], d1.states, now=1.0)
    assert d2.states["x:1"].latency_strikes == 2 and d2.health["x:1"] == HEALTHY
    # A good window and a missing p99 both reset the count.
    for fine in (sig("x:1", p99_ms=150.0), sig("x:1", p99_ms=None), sig("x:1", stale=True)):
        reset = decide([fine, *pool], d2.states, now=2.0)
        assert reset.states["x:1"].latency_strikes == 0
    d3 = decide([slow, *pool], d2.states, now=2.0)
    assert d3.health["x:1"] == UNHEALTHY
    assert d3.reasons["x:1"] == "ejected: p99 412 ms > 2 x SLA 200 ms for 3 windows"


@pytest.mark.parametrize(
    "missing",
    [
        sig("x:1", p99_ms=None, error_rate=None, memory_used_bytes=None),
        sig("x:1", memory_total_bytes=None, memory_used_bytes=99 * GIB),
        sig("x:1", stale=True, error_rate=0.9, memory_used_bytes=99 * GIB, p99_ms=9999.0),
    ],
)
def test_missing_or_stale_signals_never_eject(missing: EndpointSignals) -> None:
    prev: dict[str, EjectionState] = {}
    for t in range(5):
        d = decide([missing, good("b:1"), good("c:1")], prev, now=float(t))
        prev = d.states
        assert d.health["x:1"] == HEALTHY and not d.events


def test_backoff_doubles_and_caps() -> None:
    policy = PoolPolicy(capacity_qps=1.0, sla_p99_ms=1.0, backoff_base_s=5.0, backoff_max_s=30.0)
    assert [backoff_s(n, policy) for n in range(1, 7)] == [5.0, 10.0, 20.0, 30.0, 30.0, 30.0]
    assert backoff_s(10_000, policy) == 30.0


def test_stays_out_until_backoff_ends_then_returns_only_when_healthy() -> None:
    pool = [good("b:1"), good("c:1"), good("d:1")]
    bad = sig("x:1", error_rate=0.9)
    d = decide([bad, *pool], now=0.0)
    assert d.states["x:1"].until == 5.0
    # In back-off: stays out even with good signals, no new event.
    d = decide([good("x:1"), *pool], d.states, now=4.9)
    assert d.health["x:1"] == UNHEALTHY and d.reasons["x:1"] == "ejected: error rate 90% >= 50%"
    assert not d.events
    # Back-off over, and the telemetry window since the ejection too (its error rate is
    # then its own, not the one that ejected it), but still bad: extended, doubled.
    d = decide([bad, *pool], d.states, now=10.0)
    assert d.health["x:1"] == UNHEALTHY
    assert d.states["x:1"].times_ejected == 2 and d.states["x:1"].until == 20.0
    assert d.states["x:1"].ejected_at == 0.0
    assert d.events == ["x:1 stays ejected for 10 s: error rate 90% >= 50%."]
    # Over and healthy: returns, with returned_at for slow start.
    d = decide([good("x:1"), *pool], d.states, now=20.0)
    assert d.health["x:1"] == HEALTHY
    assert d.reasons["x:1"] == "returned after 20 s ejected"
    assert d.events == ["x:1 returned after 20 s ejected."]
    assert d.states["x:1"].returned_at == 20.0 and not d.states["x:1"].ejected
    # Ejected again later: the count carries on, so the back-off keeps doubling.
    d = decide([bad, *pool], d.states, now=100.0)
    assert d.states["x:1"].until == 120.0


def test_max_share_ejects_worst_first() -> None:
    pool = [
        sig("lat:1", p99_ms=900.0),
        sig("err:1", error_rate=0.7),
        sig("mem:1", memory_used_bytes=98 * GIB),
        good("ok:1"),
    ]
    policy = PoolPolicy(capacity_qps=1.0, sla_p99_ms=200.0, latency_eject_windows=1)
    d = decide(pool, policy=policy)
    assert sorted(e for e, h in d.health.items() if h == UNHEALTHY) == ["err:1", "mem:1"]
    assert d.reasons["lat:1"] == (
        "would eject (p99 900 ms > 2 x SLA 200 ms for 1 window), "
        "but at most 50% of the pool may be out"
    )
    assert not d.fail_open


def test_already_ejected_keep_their_place_under_the_cap() -> None:
    pool = [good("a:1"), sig("b:1", error_rate=0.6), good("c:1"), good("d:1")]
    d = decide(pool)
    worse = [good("a:1"), sig("b:1", error_rate=0.6), sig("c:1", error_rate=0.9)]
    d = decide([*worse, sig("d:1", error_rate=0.99)], d.states, now=1.0)
    assert d.health["b:1"] == UNHEALTHY and d.health["d:1"] == UNHEALTHY
    assert d.health["c:1"] == HEALTHY


def test_one_endpoint_pool_is_never_ejected() -> None:
    policy = PoolPolicy(capacity_qps=1.0, sla_p99_ms=200.0, max_ejected_share=1.0)
    d = decide([sig("x:1", error_rate=1.0)], policy=policy)
    assert d.health == {"x:1": HEALTHY}
    assert not d.states["x:1"].ejected


def test_fail_open_when_every_endpoint_is_bad() -> None:
    d = decide([sig("a:1", error_rate=0.9), sig("b:1", p99_ms=900.0)], policy=ONE_WINDOW)
    assert d.fail_open and d.fail_open_reason == "every endpoint looks bad: failing open to weights"
    assert set(d.health.values()) == {HEALTHY}
    assert d.reasons["a:1"] == (
        "would eject (error rate 90% >= 50%), but every endpoint looks bad: failing open to weights"
    )
    assert any("fails open" in e for e in d.events)


def test_failing_open_keeps_a_server_over_its_memory_watermark_out() -> None:
    """The others may only be slow for a moment; this one would run out of memory."""
    d = decide([sig("a:1", error_rate=0.9), sig("b:1", memory_used_bytes=99 * GIB)])
    assert d.fail_open
    assert d.health == {"a:1": HEALTHY, "b:1": UNHEALTHY}
    assert d.reasons["b:1"].startswith("ejected: memory")


def test_fail_open_serves_those_already_out() -> None:
    d = decide([sig("a:1", error_rate=0.9), good("b:1"), good("c:1")])
    assert d.health["a:1"] == UNHEALTHY
    everyone_bad = [sig(n, error_rate=0.9) for n in ("a:1", "b:1", "c:1")]
    d = decide(everyone_bad, d.states, now=1.0)
    assert d.fail_open and set(d.health.values()) == {HEALTHY}
    assert d.reasons["a:1"] == (
        "would eject (still in back-off), but every endpoint looks bad: failing open to weights"
    )
    assert d.states["a:1"].ejected and d.states["a:1"].until == 5.0  # its back-off goes on


def test_failing_open_and_back_resumes_the_back_off_instead_of_a_new_ejection() -> None:
    """a at 90% errors, b flapping across the 50% threshold every tick: on the code before,
    every tick that failed open returned a (its ejection forgotten) and the next ejected it
    anew, doubling its back-off each time (5, 10, 20, 40 s after 2 s)."""
    served = "would eject (still in back-off), but every endpoint looks bad: failing open"
    d = decide([sig("a:1", error_rate=0.9), sig("b:1", error_rate=0.49)])
    assert d.health["a:1"] == UNHEALTHY and d.states["a:1"].until == 5.0
    for tick in range(1, 9):  # 0.5 s apart, inside a's 5 s back-off
        b_errors = 0.51 if tick % 2 else 0.49
        pool = [sig("a:1", error_rate=0.9), sig("b:1", error_rate=b_errors)]
        d = decide(pool, d.states, now=tick * 0.5)
        assert d.fail_open == (b_errors > 0.5)
        assert d.health["a:1"] == (HEALTHY if d.fail_open else UNHEALTHY)
        a = d.states["a:1"]
        assert (a.ejected, a.until, a.times_ejected, a.ejected_at) == (True, 5.0, 1, 0.0)
        assert d.reasons["a:1"].startswith(served if d.fail_open else "ejected: error rate 90%")
        assert not any(e.startswith("a:1") for e in d.events), d.events


def test_draining_is_immediate_and_not_counted() -> None:
    pool = [sig("dr:1", draining=True, error_rate=0.9), sig("b:1", error_rate=0.9)]
    pool += [good("c:1"), good("d:1"), good("e:1")]
    d = decide(pool)
    assert d.health["dr:1"] == DRAINING
    assert d.reasons["dr:1"] == "draining: server reports draining"
    assert d.health["b:1"] == UNHEALTHY  # the draining one does not use up the share
    assert d.states["dr:1"].until is None and not d.states["dr:1"].ejected
    assert "dr:1 is draining: the server reports draining." in d.events
    again = decide(pool, d.states, now=1.0)
    assert not any(e.startswith("dr:1") for e in again.events)  # announced once
    # An ejected endpoint that starts draining is DRAINING, not ejected, with no back-off.
    drained = decide([sig("b:1", draining=True), *pool[2:]], d.states, now=2.0)
    assert drained.health["b:1"] == DRAINING and not drained.states["b:1"].ejected
    back = decide([good("b:1"), *pool[2:]], drained.states, now=3.0)
    assert back.health["b:1"] == HEALTHY and back.states["b:1"].returned_at == 3.0


def test_only_draining_and_one_serving_never_ejects() -> None:
    d = decide([sig("d:1", draining=True), sig("d:2", draining=True), sig("x:1", error_rate=1.0)])
    assert d.health["x:1"] == HEALTHY


def test_endpoints_gone_from_the_pool_are_dropped() -> None:
    d = decide([sig("a:1", error_rate=0.9), good("b:1"), good("c:1")])
    d = decide([good("b:1"), good("c:1")], d.states, now=1.0)
    assert set(d.states) == {"b:1", "c:1"}


signal_values = st.fixed_dictionaries(
    {
        "draining": st.booleans(),
        "stale": st.booleans(),
        "p99_ms": st.none() | st.floats(0, 5000),
        "error_rate": st.none() | st.floats(0, 1),
        "memory_used_bytes": st.none() | st.floats(0, 100),
        "memory_total_bytes": st.none() | st.floats(0, 100),
    }
)


@settings(max_examples=200, deadline=None)
@given(
    rounds=st.lists(st.lists(signal_values, min_size=1, max_size=8), min_size=1, max_size=6),
    share=st.floats(0, 1),
    windows=st.integers(1, 3),
)
def test_property_cap_and_draining(
    rounds: list[list[dict[str, Any]]], share: float, windows: int
) -> None:
    policy = PoolPolicy(
        capacity_qps=1.0, sla_p99_ms=200.0, max_ejected_share=share, latency_eject_windows=windows
    )
    prev: dict[str, EjectionState] = {}
    for t, values in enumerate(rounds):
        pool = [EndpointSignals(endpoint=f"e{i}:1", **v) for i, v in enumerate(values)]
        d = decide_ejections(pool, policy, prev, float(t * 3))
        ejected = [e for e, h in d.health.items() if h == UNHEALTHY]
        assert len(ejected) <= math.floor(share * len(pool))
        assert all(d.states[e].ejected for e in ejected)
        for s in pool:
            if s.draining:
                assert d.health[s.endpoint] == DRAINING
        if d.fail_open:  # only a server over its memory watermark stays out
            assert all(d.reasons[e].startswith("ejected: memory") for e in ejected), d.reasons
        prev = d.states


@pytest.mark.parametrize(
    ("since", "now", "expected"),
    [
        (None, 5.0, 1.0),
        (0.0, 0.0, 0.1),
        (0.0, 5.0, 0.55),
        (0.0, 10.0, 1.0),
        (0.0, 99.0, 1.0),
        (10.0, 5.0, 0.1),  # joined "in the future": the floor
    ],
)
def test_slow_start_factor(since: float | None, now: float, expected: float) -> None:
    assert slow_start_factor(since, now, 10.0) == pytest.approx(expected)


def test_slow_start_zero_duration_is_full_weight() -> None:
    assert slow_start_factor(0.0, 0.0, 0.0) == 1.0


def test_apply_slow_start_ramps_and_never_below_one() -> None:
    weights = {"new:1": 100, "old:1": 100, "tiny:1": 1, "half:1": 40}
    joined = {"new:1": 0.0, "tiny:1": 0.0, "half:1": -5.0}
    out = apply_slow_start(weights, joined, now=0.0, duration_s=10.0)
    assert out == {"new:1": 10, "old:1": 100, "tiny:1": 1, "half:1": 22}
    assert apply_slow_start({"z:1": 0}, {"z:1": 0.0}, 0.0, 10.0) == {"z:1": 1}


@given(
    weights=st.dictionaries(st.text(min_size=1, max_size=3), st.integers(0, 1000), max_size=6),
    elapsed=st.floats(-10, 100),
)
def test_property_slow_start_bounds(weights: dict[str, int], elapsed: float) -> None:
    out = apply_slow_start(weights, dict.fromkeys(weights, 0.0), elapsed, 10.0)
    for k, w in weights.items():
        assert 1 <= out[k] <= max(w, 1)
    assert 0.0 < slow_start_factor(0.0, elapsed, 10.0) <= 1.0


def test_a_host_wide_stall_ejects_nobody_an_outlier_is_still_ejected() -> None:
    """Every server slow at once is the host, not a server: latency is also judged against
    the median of the rest of the pool (latency_eject_vs_pool, 2x by default)."""
    stalled = [sig(n, p99_ms=900.0) for n in ("a:1", "b:1", "c:1")]
    d = decide(stalled, policy=ONE_WINDOW)
    assert set(d.health.values()) == {HEALTHY} and not d.fail_open
    outlier = [sig("a:1", p99_ms=900.0), sig("b:1", p99_ms=300.0), sig("c:1", p99_ms=300.0)]
    d = decide(outlier, policy=ONE_WINDOW)  # 900 > 2 x SLA 200 and > 2 x the others' 300
    assert d.health["a:1"] == UNHEALTHY and d.health["b:1"] == HEALTHY
    off = PoolPolicy(100.0, 200.0, latency_eject_windows=1, latency_eject_vs_pool=0.0)
    assert decide(stalled, policy=off).fail_open  # without it: everyone looks bad


def test_back_off_starts_over_after_a_long_healthy_stretch() -> None:
    policy = PoolPolicy(100.0, 200.0, backoff_base_s=5.0, backoff_max_s=60.0)
    pool = [good("b:1"), good("c:1"), good("d:1")]
    d = decide([sig("x:1", error_rate=0.9), *pool], policy=policy)  # out for 5 s
    d = decide([good("x:1"), *pool], d.states, now=6.0, policy=policy)  # back
    d = decide([sig("x:1", error_rate=0.9), *pool], d.states, now=11.0, policy=policy)
    assert d.states["x:1"].until == 11.0 + 10.0  # a repeat soon after: doubled
    d = decide([good("x:1"), *pool], d.states, now=22.0, policy=policy)
    d = decide([good("x:1"), *pool], d.states, now=22.0 + 60.0, policy=policy)  # a minute fine
    assert d.states["x:1"].times_ejected == 0
    d = decide([sig("x:1", error_rate=0.9), *pool], d.states, now=100.0, policy=policy)
    assert d.states["x:1"].until == 105.0  # an unrelated incident: the base back-off again


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.one_of(st.none(), st.sampled_from([10.0, 20.0, 30.0, 55.5, 900.0])),
                  st.booleans()),
        max_size=9,
    )
)  # fmt: skip
def test_the_rest_of_the_pools_median_p99_leaves_out_exactly_the_endpoint(
    pool: list[tuple[float | None, bool]],
) -> None:
    """What latency_eject_vs_pool compares with: the median over every other fresh endpoint
    (duplicates, stale and missing P99s included), as a plain sort of the rest gives it."""
    signals = [sig(f"e{i}:1", p99_ms=p99, stale=stale) for i, (p99, stale) in enumerate(pool)]
    median = _PoolMedian(signals)
    for index, one in enumerate(signals):
        rest = sorted(s.p99_ms for j, s in enumerate(signals)
                      if j != index and s.p99_ms is not None and not s.stale)  # fmt: skip
        expected = None
        if rest:
            middle = len(rest) // 2
            expected = rest[middle] if len(rest) % 2 else (rest[middle - 1] + rest[middle]) / 2
        assert median.without(one) == expected


def test_abandoned_tries_eject_only_the_outlier_not_a_pool_whose_tries_are_all_hedged() -> None:
    """When every server's tries are abandoned alike, the per-try timeout is under what tries
    take (the hedging guard raises it); ejecting for it would empty the pool of good servers."""
    alike = [sig(ep, abandoned_rate=0.6) for ep in ("a:1", "b:1", "c:1", "d:1")]
    d = decide(alike)
    assert set(d.health.values()) == {HEALTHY}, d.reasons
    one = decide([sig("x:1", abandoned_rate=0.6), *(sig(ep, abandoned_rate=0.2)
                  for ep in ("b:1", "c:1", "d:1"))])  # fmt: skip
    assert one.health["x:1"] == UNHEALTHY and "tries abandoned 60%" in one.reasons["x:1"]
    assert {one.health[ep] for ep in ("b:1", "c:1", "d:1")} == {HEALTHY}


def test_back_from_a_back_off_it_is_not_ejected_again_on_evidence_from_before_it() -> None:
    """It gets no requests while out, so when a 5 s back-off ends the 10 s telemetry window
    still holds the errors that ejected it. On the code before, they ejected it again ("stays
    ejected for 10 s"): every first ejection lasted 15 s, and its return said "after 10 s
    back-off"."""
    pool = [good("b:1"), good("c:1"), good("d:1")]
    bad = sig("x:1", error_rate=0.9)  # the window's rate: unchanged while it gets nothing
    d = decide([bad, *pool], now=0.0)
    d = decide([bad, *pool], d.states, now=5.0)
    assert d.health["x:1"] == HEALTHY and d.reasons["x:1"] == "returned after 5 s ejected"
    assert d.events == ["x:1 returned after 5 s ejected."]
    for now in (5.5, 9.5):  # the window still reaches back before the ejection
        d = decide([bad, *pool], d.states, now=now)
        assert d.health["x:1"] == HEALTHY and not d.events
    # Another cause is judged at once: the window held no abandoned tries before.
    hedged_away = decide([sig("x:1", abandoned_rate=0.7), *pool], d.states, now=9.5)
    assert hedged_away.health["x:1"] == UNHEALTHY
    d = decide([bad, *pool], d.states, now=10.0)  # the window holds only what came after
    assert d.health["x:1"] == UNHEALTHY and d.states["x:1"].times_ejected == 2
    assert d.events == ["x:1 ejected for 10 s: error rate 90% >= 50%."]
    # Memory is a gauge, read as it is now: still over at the back-off's end, still out.
    full = sig("m:1", memory_used_bytes=97 * GIB)
    d = decide([full, *pool], now=0.0)
    d = decide([full, *pool], d.states, now=5.0)
    assert d.health["m:1"] == UNHEALTHY and d.states["m:1"].until == 15.0
