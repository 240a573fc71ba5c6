"""Hedged requests: the per-try timeout follows the pool's healthy P99, and only unary
inference of idempotent, non-generative models is hedged."""

from __future__ import annotations

from typing import Any

import pytest

from control_plane.config.topology import TopologyError, parse_topology
from control_plane.model.mesh import (
    ROUTE_CONFIG_NAME,
    EndpointAddress,
    EndpointAssignment,
    EndpointHealth,
    HedgingPolicy,
    LargeInputs,
    ListenerOptions,
    MeshState,
    ModelRoute,
    SlaClass,
    model_cluster,
)
from control_plane.routing.hedging import (
    BOOST_SPACING_S,
    MAX_BOOST,
    RECENT_S,
    HedgeState,
    PerTry,
    follow,
    per_try,
    pool_p99_ms,
)
from control_plane.scoring.types import EndpointSignals
from control_plane.xds import edge
from control_plane.xds.resources import CLUSTER_TYPE, ROUTE_TYPE, build_resources

POLICY = HedgingPolicy(multiplier=3.0, floor_ms=5.0, hysteresis=0.25)


def signal(endpoint: str, p99_ms: float | None, stale: bool = False) -> EndpointSignals:
    return EndpointSignals(endpoint, p99_ms=p99_ms, stale=stale)


def test_the_pools_healthy_p99_leaves_out_the_ejected_and_the_stale() -> None:
    signals = [signal("a", 6.0), signal("b", 7.0), signal("c", 200.0), signal("d", 1.0, True)]
    assert pool_p99_ms(signals, {"c": "UNHEALTHY"}) == 6.5
    # one slow server among three does not move the median it is measured against
    assert pool_p99_ms(signals[:3], {}) == 7.0
    assert pool_p99_ms([signal("a", None)], {}) is None


def test_the_per_try_timeout_is_the_multiple_and_says_so() -> None:
    found = per_try(POLICY, 50.0, 6.0, None)
    assert found == PerTry(18.0, 6.0, "per-try 18 ms = 3 x pool P99 6.0 ms (the highest of 10 s)")
    assert found.timeout_s == pytest.approx(0.018)


def test_the_per_try_timeout_is_clamped_to_the_floor_and_the_sla() -> None:
    low = per_try(POLICY, 50.0, 1.0, None)
    assert low is not None and low.per_try_ms == 5.0 and "the floor" in low.why
    high = per_try(POLICY, 50.0, 40.0, None)
    assert high is not None and high.per_try_ms == 50.0 and "the SLA P99" in high.why


def test_small_moves_keep_the_timeout_in_force_and_large_ones_replace_it() -> None:
    current = per_try(POLICY, 100.0, 6.0, None)  # 18 ms
    assert per_try(POLICY, 100.0, 7.0, current) is current  # 21 ms: within 25 %
    moved = per_try(POLICY, 100.0, 8.0, current)  # 24 ms: more than 25 %
    assert moved is not None and moved.per_try_ms == 24.0


def test_a_reloaded_sla_or_floor_moves_a_timeout_the_hysteresis_would_keep() -> None:
    """On the code before, the timeout in force stayed 100 ms after the SLA fell to 85 (and
    its reason still said "= the SLA P99"), and 16 ms after the floor rose to 20."""
    at_sla = per_try(POLICY, 100.0, 40.0, None)  # 120 ms clamped to the SLA
    assert at_sla is not None and at_sla.per_try_ms == 100.0
    lowered = per_try(POLICY, 85.0, 40.0, at_sla)
    assert lowered is not None and lowered.per_try_ms == 85.0 and "the SLA P99" in lowered.why
    no_p99 = per_try(POLICY, 85.0, None, at_sla)  # no fresh P99: from the one it had
    assert no_p99 is not None and no_p99.per_try_ms == 85.0
    current = per_try(POLICY, 100.0, 16 / 3, None)  # 16 ms
    raised = HedgingPolicy(multiplier=3.0, floor_ms=20.0, hysteresis=0.25)
    floored = per_try(raised, 100.0, 16 / 3, current)
    assert floored is not None and floored.per_try_ms == 20.0 and "the floor" in floored.why


def test_no_p99_keeps_what_is_in_force_and_no_policy_hedges_nothing() -> None:
    current = per_try(POLICY, 100.0, 6.0, None)
    assert per_try(POLICY, 100.0, None, current) is current
    assert per_try(POLICY, 100.0, None, None) is None
    assert per_try(None, 100.0, 6.0, current) is None


def test_the_timeout_rises_at_once_and_falls_only_after_a_calm_spell() -> None:
    """A quiet second must not drop it below what a try takes: the hedges of healthy tries
    then load the pool (bench_routing saw its P99 rise 20-fold)."""
    state = follow(POLICY, 100.0, 6.0, 0.0, HedgeState())
    assert state.per_try is not None and state.per_try.per_try_ms == 18.0
    state = follow(POLICY, 100.0, 2.0, 1.0, state)  # a dip: held at the recent high
    assert state.per_try is not None and state.per_try.per_try_ms == 18.0
    state = follow(POLICY, 100.0, 10.0, 2.0, state)  # a rise: at once
    assert state.per_try is not None and state.per_try.per_try_ms == 30.0
    for t in range(3, 12):
        state = follow(POLICY, 100.0, 2.0, float(t), state)
    assert state.per_try is not None and state.per_try.per_try_ms == 30.0  # within RECENT_S
    state = follow(POLICY, 100.0, 2.0, 2.0 + RECENT_S + 0.5, state)
    assert state.per_try is not None and state.per_try.per_try_ms == 6.0
    assert follow(None, 100.0, 6.0, 20.0, state) == HedgeState()


def routes_and_clusters(model: ModelRoute) -> tuple[dict[str, Any], dict[str, Any]]:
    a = EndpointAddress("127.0.0.1", 8001)
    clusters = {model_cluster(model.name): (EndpointAssignment(a, 1, EndpointHealth.HEALTHY),)}
    state = MeshState(ListenerOptions(), (model,), clusters)
    resources = build_resources(state)
    config: Any = resources[ROUTE_TYPE][ROUTE_CONFIG_NAME]
    return {r.name: r for r in config.virtual_hosts[0].routes}, resources[CLUSTER_TYPE]


ON = HedgingPolicy()


def test_a_hedged_model_races_a_slow_try_on_another_host() -> None:
    model = ModelRoute("classifier", 50, 2.0, hedging=ON, hedge_per_try_s=0.018)
    routes, clusters = routes_and_clusters(model)
    unary = routes[model_cluster("classifier")].route
    assert unary.hedge_policy.hedge_on_per_try_timeout
    assert unary.retry_policy.per_try_timeout.ToMilliseconds() == 18
    assert unary.retry_policy.num_retries.value >= 1
    # at the per-try timeout, not after Envoy's default retry back-off (0-24 ms, then more)
    assert unary.retry_policy.retry_back_off.base_interval.ToMilliseconds() == 1
    predicates = [p.name for p in unary.retry_policy.retry_host_predicate]
    assert predicates == ["envoy.retry_host_predicates.previous_hosts"]  # never the same host
    stream = routes[f"{model_cluster('classifier')}:stream"].route
    assert not stream.HasField("hedge_policy") and not stream.HasField("retry_policy")
    (limits,) = clusters[model_cluster("classifier")].circuit_breakers.thresholds
    assert limits.retry_budget.budget_percent.value == 10


def test_a_model_that_must_not_run_twice_is_never_retried_after_a_reset() -> None:
    """A reset may come after the server ran the request; a refused connection or stream, or
    UNAVAILABLE (our servers answer it before any work), may be retried. Over REST too."""
    parsed = parse_topology(model_config(idempotent=False)).models[0]
    assert not parsed.idempotent
    routes, _ = routes_and_clusters(parsed)
    retry_on = routes[model_cluster("m")].route.retry_policy.retry_on.split(",")
    assert "reset" not in retry_on and {"connect-failure", "refused-stream"} <= set(retry_on)
    rest = edge.rest_action(routes[model_cluster("m")].route).retry_policy.retry_on.split(",")
    assert "reset" not in rest and "connect-failure" in rest
    routes, _ = routes_and_clusters(parse_topology(model_config()).models[0])
    assert "reset" in routes[model_cluster("m")].route.retry_policy.retry_on.split(",")
    assert "reset" in edge.rest_action(routes[model_cluster("m")].route).retry_policy.retry_on


def test_without_a_p99_or_with_hedging_off_a_try_has_the_whole_timeout() -> None:
    for model in (
        ModelRoute("classifier", 50, 2.0, hedging=ON),  # no P99 yet
        ModelRoute("classifier", 50, 2.0, hedging=None, hedge_per_try_s=0.018),
    ):
        routes, clusters = routes_and_clusters(model)
        unary = routes[model_cluster("classifier")].route
        assert not unary.HasField("hedge_policy")
        assert unary.retry_policy.per_try_timeout.ToMilliseconds() == 2000
        assert not unary.retry_policy.HasField("retry_back_off")  # Envoy's, for failures
    (limits,) = clusters[model_cluster("classifier")].circuit_breakers.thresholds
    assert limits.retry_budget.budget_percent.value == 25  # the listener's


def test_a_stalled_try_races_another_host_at_its_share_of_the_timeout() -> None:
    """Without a P99 (or with adaptive hedging off) a try unanswered at the stalled-try share
    of the timeout is hedged, so one stalled server cannot take a request's whole deadline."""
    for model in (
        ModelRoute("classifier", 50, 2.0, stalled_try_share=0.5),
        ModelRoute("classifier", 50, 2.0, hedging=ON, stalled_try_share=0.5),  # no P99 yet
    ):
        routes, _ = routes_and_clusters(model)
        unary = routes[model_cluster("classifier")].route
        assert unary.hedge_policy.hedge_on_per_try_timeout
        assert unary.retry_policy.per_try_timeout.ToMilliseconds() == 1000
        assert unary.timeout.ToMilliseconds() == 2000
    # the pool's P99, once known, sets the per-try timeout instead
    model = ModelRoute("classifier", 50, 2.0, hedging=ON, hedge_per_try_s=0.018,
                       stalled_try_share=0.5)  # fmt: skip
    routes, _ = routes_and_clusters(model)
    assert (
        routes[model_cluster("classifier")].route.retry_policy.per_try_timeout.ToMilliseconds()
        == 18
    )
    # streams are never hedged
    streams = [r.route for n, r in routes.items() if "stream" in n]
    assert streams and not any(r.HasField("hedge_policy") for r in streams)


def test_an_sla_class_with_its_own_per_try_timeout_is_not_hedged() -> None:
    lanes = (SlaClass("interactive", 1.0, 1, 0.1), SlaClass("batch", 10.0))
    model = ModelRoute("classifier", 50, 2.0, sla_classes=lanes, hedging=ON, hedge_per_try_s=0.018)
    routes, _ = routes_and_clusters(model)
    by_lane = {n: r.route for n, r in routes.items() if ":sla:" in n and "stream" not in n}
    interactive = next(r for n, r in by_lane.items() if "interactive" in n)
    batch = next(r for n, r in by_lane.items() if "batch" in n)
    assert not interactive.HasField("hedge_policy")
    assert interactive.retry_policy.per_try_timeout.ToMilliseconds() == 100
    assert batch.hedge_policy.hedge_on_per_try_timeout
    assert batch.retry_policy.per_try_timeout.ToMilliseconds() == 18


def test_large_inputs_are_not_hedged() -> None:
    """They take longer by design: a per-try timeout from the pool's P99 would run each twice
    (found by the large-input lane's end-to-end test)."""
    large = LargeInputs(1024, (("device_class", ("a100",)),))
    model = ModelRoute("classifier", 50, 2.0, large_inputs=large, hedging=ON, hedge_per_try_s=0.018)
    routes, _ = routes_and_clusters(model)
    lanes = [r.route for n, r in routes.items() if ":large" in n and "stream" not in n]
    assert lanes and not any(r.HasField("hedge_policy") for r in lanes)
    assert all(r.retry_policy.per_try_timeout.ToMilliseconds() == 2000 for r in lanes)
    assert routes[model_cluster("classifier")].route.hedge_policy.hedge_on_per_try_timeout


def model_config(**fields: Any) -> dict[str, Any]:
    return {"models": [{"name": "m", "sla_p99_ms": 50, "capacity_qps": 100, **fields}]}


def test_hedging_is_off_unless_asked_for() -> None:
    def hedging(**fields: Any) -> HedgingPolicy | None:
        return parse_topology(model_config(**fields)).models[0].hedging

    on = {"enabled": True}
    assert hedging() is None
    assert hedging(hedging={"multiplier": 1.5}) is None  # tuned, but not turned on
    assert hedging(hedging=on) == HedgingPolicy()
    tuned = hedging(hedging={**on, "multiplier": 1.5, "floor_ms": 2, "budget_percent": 5})
    assert tuned == HedgingPolicy(multiplier=1.5, floor_ms=2, budget_percent=5)


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        (
            {"idempotent": False, "hedging": {"enabled": True}},
            "models[0].hedging.enabled: a model declared idempotent: false cannot be hedged",
        ),
        (  # docs/control-plane.md: a generation's time follows its length; a hedge runs it twice
            {"generative": True, "hedging": {"enabled": True}},
            "models[0].hedging.enabled: a generative model cannot be hedged",
        ),
        ({"hedging": {"multiplier": 0}}, "models[0].hedging.multiplier"),
        ({"hedging": {"budget_percent": 120}}, "models[0].hedging.budget_percent"),
        ({"hedging": {"delay_ms": 3}}, "models[0].hedging.delay_ms: unknown key"),
    ],
)
def test_bad_hedging_settings_name_the_field(fields: dict[str, Any], error: str) -> None:
    with pytest.raises(TopologyError) as info:
        parse_topology(model_config(**fields))
    assert any(e.startswith(error) for e in info.value.errors), info.value.errors


def test_the_guard_doubles_the_timeout_past_the_hedge_budget_and_undoes_it_calmly() -> None:
    """More hedges than the budget mean the timeout is under what healthy tries take through
    Envoy: the guard raises it, once per BOOST_SPACING_S, up to MAX_BOOST, and lowers it only
    after a calm spell."""
    state = follow(POLICY, 1000.0, 6.0, 0.0, HedgeState(), hedged=0.0)
    assert state.per_try is not None and state.per_try.per_try_ms == 18.0 and state.boost == 1
    state = follow(POLICY, 1000.0, 6.0, 1.0, state, hedged=0.5)
    assert state.per_try is not None and state.per_try.per_try_ms == 36.0
    assert "x 2 (the guard: Envoy hedged more than the 10% budget" in state.per_try.why
    state = follow(POLICY, 1000.0, 6.0, 1.0 + BOOST_SPACING_S / 2, state, hedged=0.5)
    assert state.boost == 2  # the last boost has not shown yet
    t = 1.0
    while t < 60:
        t += BOOST_SPACING_S
        state = follow(POLICY, 1000.0, 6.0, t, state, hedged=0.5)
    assert state.boost == MAX_BOOST and state.per_try is not None
    assert state.per_try.per_try_ms == 18.0 * MAX_BOOST
    # A slow server re-weighted within a second costs a few percent over the window: no
    # boost, and no undoing while the share is between half the budget and the budget.
    state = follow(POLICY, 1000.0, 6.0, t + 30, state, hedged=0.07)
    assert state.boost == MAX_BOOST
    calm = t + 31
    state = follow(POLICY, 1000.0, 6.0, calm, state, hedged=0.0)
    assert state.boost == MAX_BOOST  # calm only just began
    state = follow(POLICY, 1000.0, 6.0, calm + RECENT_S, state, hedged=0.0)
    assert state.boost == MAX_BOOST / 2
    assert state.per_try is not None and state.per_try.per_try_ms == 18.0 * MAX_BOOST / 2
    state = follow(POLICY, 1000.0, 6.0, calm + RECENT_S + 1, state, hedged=None)
    assert state.boost == MAX_BOOST / 2  # the next halving waits for another calm spell


def test_a_slow_server_within_the_budget_leaves_the_timeout_alone() -> None:
    state = follow(POLICY, 1000.0, 6.0, 0.0, HedgeState(), hedged=0.04)
    for t in range(1, 30):
        state = follow(POLICY, 1000.0, 6.0, float(t), state, hedged=0.09)
    assert state.boost == 1 and state.per_try is not None and state.per_try.per_try_ms == 18.0


def test_the_guard_never_raises_the_timeout_past_the_sla() -> None:
    state = HedgeState()
    for t in range(0, 60, 5):
        state = follow(POLICY, 40.0, 6.0, float(t), state, hedged=0.5)
    assert state.per_try is not None and state.per_try.per_try_ms == 40.0
    assert state.boost == 4  # 18 -> 36 -> 40 (the SLA): no boost past it
