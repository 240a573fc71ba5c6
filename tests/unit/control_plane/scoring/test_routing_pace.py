"""A pool moves at the pace of RECOMPUTE_PERIOD_S, whatever the routing tick's cadence:
recomputes that come sooner smooth, step and strike by their share of a period, so how often a
pool happens to be recomputed does not change how fast scores move or how soon a server is
out."""

from __future__ import annotations

import pytest

from control_plane.scoring.ejection import HEALTHY, UNHEALTHY, EjectionState, decide_ejections
from control_plane.scoring.pipeline import PoolState, decide_pool
from control_plane.scoring.types import RECOMPUTE_PERIOD_S, EndpointSignals, PoolPolicy

POLICY = PoolPolicy(capacity_qps=100.0, sla_p99_ms=50.0)
FAST = RECOMPUTE_PERIOD_S / 5


def pool(slow_p99: float) -> list[EndpointSignals]:
    ok = {"qps": 50.0, "p99_ms": 10.0}
    return [
        EndpointSignals("a:1", **ok),  # type: ignore[arg-type]
        EndpointSignals("b:1", **ok),  # type: ignore[arg-type]
        EndpointSignals("c:1", qps=50.0, p99_ms=slow_p99),
    ]


def settled() -> PoolState:
    state = None
    for _ in range(30):
        _, state = decide_pool(pool(10.0), POLICY, state)
    assert state is not None
    return state


def test_five_fifth_period_recomputes_smooth_like_one_period() -> None:
    _, one = decide_pool(pool(300.0), POLICY, settled(), RECOMPUTE_PERIOD_S)
    state = settled()
    for _ in range(5):
        _, state = decide_pool(pool(300.0), POLICY, state, FAST)
    # The same smoothed score either way (up to rounding), not five periods' worth of moving.
    assert state.scores["c:1"] == pytest.approx(one.scores["c:1"], rel=1e-9)
    assert one.scores["c:1"] != pytest.approx(settled().scores["c:1"], rel=1e-3)  # it moved


def test_a_weight_steps_by_its_share_of_a_period() -> None:
    policy = PoolPolicy(capacity_qps=100.0, sla_p99_ms=50.0, ewma_alpha=1.0, max_step=0.5)
    before = settled()
    whole, _ = decide_pool(pool(300.0), policy, before, RECOMPUTE_PERIOD_S)
    fifth, _ = decide_pool(pool(300.0), policy, before, FAST)
    full_step = before.weights["c:1"] - whole.weights["c:1"]
    assert full_step == 50  # max_step x max_weight in one period
    assert before.weights["c:1"] - fifth.weights["c:1"] == 10  # a fifth of it


def test_latency_strikes_count_once_a_period_however_often_it_recomputes() -> None:
    signals = pool(400.0)  # 8x the SLA, 40x the others
    states: dict[str, EjectionState] = {}
    tick, health = 0, HEALTHY
    while health == HEALTHY:
        decision = decide_ejections(signals, POLICY, states, tick * FAST)
        states, health = decision.states, decision.health["c:1"]
        tick += 1
    # Three strikes (the default windows) at 0, 0.5 and 1.0 s, not at 0, 0.1 and 0.2 s.
    assert (tick - 1) * FAST == pytest.approx(2 * RECOMPUTE_PERIOD_S)
    assert health == UNHEALTHY and states["c:1"].latency_strikes == 3


def test_a_good_window_resets_strikes_at_once() -> None:
    states = decide_ejections(pool(400.0), POLICY, {}, 0.0).states
    states = decide_ejections(pool(10.0), POLICY, states, FAST).states
    assert states["c:1"].latency_strikes == 0 and states["c:1"].struck_at is None
