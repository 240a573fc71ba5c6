"""The router over time: ejection, probation after a latency ejection, then slow start."""

from __future__ import annotations

import dataclasses

from control_plane.config.topology import Topology, parse_topology
from control_plane.discovery.placement import EndpointReport
from control_plane.model.mesh import EndpointAddress, EndpointHealth
from control_plane.routing.router import Router
from control_plane.scoring.ejection import EjectionCause
from control_plane.telemetry.values import EndpointTelemetry, Flag, ModelTelemetry, Signal

A, B, C = (EndpointAddress("127.0.0.1", p) for p in (9001, 9002, 9003))
SLA = 50.0


def topology() -> Topology:
    routing = {"latency_eject_windows": 1, "backoff_base_s": 5, "slow_start_s": 10,
               "ewma_alpha": 1.0, "max_step": 1.0, "hysteresis": 0.0}  # fmt: skip
    return parse_topology(
        {"models": [{"name": "m", "sla_p99_ms": SLA, "capacity_qps": 100, "routing": routing}]}
    )


def seen(address: EndpointAddress, p99_ms: float | None) -> EndpointTelemetry:
    p99 = None if p99_ms is None else Signal(p99_ms, 0.1)
    return EndpointTelemetry(
        address.key, age_s=0.1, interval_s=0.2, stale=False, p99_ms=p99, qps=Signal(10.0, 0.1)
    )


REPORTS = {a: EndpointReport(a, True, frozenset({("m", "1")}), True) for a in (A, B, C)}


def step(router: Router, now: float, slow_p99: float | None) -> dict[str, dict[str, object]]:
    telemetry = {a.key: seen(a, 10.0) for a in (A, B)}
    telemetry[C.key] = seen(C, slow_p99)
    router.recompute(topology(), telemetry, REPORTS, now)
    return dict(router.explain()["m"]["endpoints"])


def test_back_from_a_latency_ejection_on_probation_then_slow_start() -> None:
    router = Router()
    step(router, 0.0, 10.0)
    out = step(router, 1.0, 400.0)  # 8x the SLA: ejected at once (one window)
    assert out[C.key]["health"] == "UNHEALTHY"
    assert router.pool_health()["m"][C] is EndpointHealth.UNHEALTHY
    back = step(router, 6.5, None)  # back-off over; no traffic, so no p99 yet
    assert back[C.key]["health"] == "HEALTHY" and back[C.key]["weight"] == 1
    assert "probation: weight 1 until p99 <= SLA 50 ms or the rest of the pool's median" in str(
        back[C.key]["reason"]
    )
    still = step(router, 7.0, 60.0)  # measured, but over the SLA: still a trickle
    assert still[C.key]["weight"] == 1
    proven = step(router, 8.0, 20.0)  # within the SLA: slow start from here
    assert "probation" not in str(proven[C.key]["reason"])
    assert "slow start" in str(proven[C.key]["reason"])
    assert 1 < int(proven[C.key]["weight"]) < int(proven[A.key]["weight"])  # type: ignore[call-overload]
    done = step(router, 18.5, 10.0)  # ramped up: as good as the others, as heavy
    assert done[C.key]["weight"] == done[A.key]["weight"]


def test_probation_ends_when_the_server_is_no_worse_than_the_rest_of_the_pool() -> None:
    """Every server over the SLA (70 ms against 50): on the code before, the one back from
    an ejection stayed at weight 1 for good while the others, no faster, carried it all."""
    router = Router()
    step(router, 0.0, 10.0)
    step(router, 1.0, 400.0)  # ejected
    assert step(router, 6.5, None)[C.key]["weight"] == 1  # back, on probation
    everyone_slow = {a.key: seen(a, 70.0) for a in (A, B, C)}
    router.recompute(topology(), everyone_slow, REPORTS, 7.0)
    out = dict(router.explain()["m"]["endpoints"])
    assert "probation" not in str(out[C.key]["reason"]) and "slow start" in str(
        out[C.key]["reason"]
    )
    still_slower = {A.key: seen(A, 70.0), B.key: seen(B, 70.0), C.key: seen(C, 90.0)}
    router = Router()
    step(router, 0.0, 10.0)
    step(router, 1.0, 400.0)
    step(router, 6.5, None)
    router.recompute(topology(), still_slower, REPORTS, 7.0)
    assert router.explain()["m"]["endpoints"][C.key]["weight"] == 1  # worse than the rest


def test_a_server_that_leaves_and_comes_back_ramps_up_again() -> None:
    """On the code before, a server that left the pool (not ready) and came back at the same
    address kept its first join time: at once the heaviest weight in the pool, cold."""
    router = Router()
    for now in (0.0, 20.0):
        step(router, now, 10.0)  # long past slow start
    without_c = {a: r for a, r in REPORTS.items() if a != C}
    router.recompute(topology(), {a.key: seen(a, 10.0) for a in (A, B)}, without_c, 21.0)
    assert C not in router.pool_weights()["m"]
    back = step(router, 22.0, 10.0)
    assert "slow start" in str(back[C.key]["reason"])
    assert int(back[C.key]["weight"]) < int(back[A.key]["weight"])  # type: ignore[call-overload]
    assert step(router, 32.5, 10.0)[C.key]["weight"] == back[A.key]["weight"]


# "good" and "broken", both READY on A, B and C: one model failing on a shared server.
SHARED = parse_topology({"models": [
    {"name": name, "sla_p99_ms": SLA, "capacity_qps": 100, "routing": {"ewma_alpha": 1.0}}
    for name in ("good", "broken")
]})  # fmt: skip
SHARED_REPORTS = {
    a: EndpointReport(a, True, frozenset({("good", "1"), ("broken", "1")}), True) for a in (A, B, C)
}


def after_four_periods(telemetry: dict[str, EndpointTelemetry]) -> Router:
    """A router that recomputed SHARED four periods on ``telemetry``."""
    router = Router()
    for now in (0.0, 1.0, 2.0, 3.0):
        router.recompute(SHARED, telemetry, SHARED_REPORTS, now)
    return router


def test_a_model_failing_on_a_shared_server_ejects_it_from_its_own_pool_only() -> None:

    def seen_by_model(address: EndpointAddress, broken_errors: float) -> EndpointTelemetry:
        fine, errors = Signal(10.0, 0.1), Signal(broken_errors, 0.1)
        return EndpointTelemetry(
            address.key, age_s=0.1, interval_s=0.2, stale=False, p99_ms=fine,
            qps=Signal(20.0, 0.1), error_rate=Signal(broken_errors / 2, 0.1),
            models=(ModelTelemetry("good", fine, Signal(10.0, 0.1), Signal(0.0, 0.1)),
                    ModelTelemetry("broken", fine, Signal(10.0, 0.1), errors)),
        )  # fmt: skip

    telemetry = {A.key: seen_by_model(A, 0.0), B.key: seen_by_model(B, 0.0),
                 C.key: seen_by_model(C, 1.0)}  # fmt: skip
    router = after_four_periods(telemetry)
    health = router.pool_health()
    assert health["broken"][C] is EndpointHealth.UNHEALTHY
    assert health["good"][C] is EndpointHealth.HEALTHY  # its server's 50% is not its own


def test_a_slow_server_loses_most_of_its_weight_before_any_ejection() -> None:
    router = Router()
    topo = parse_topology(
        {"models": [{"name": "m", "sla_p99_ms": SLA, "capacity_qps": 100,
                     "routing": {"ewma_alpha": 1.0, "max_step": 1.0}}]}
    )  # fmt: skip
    telemetry = {A.key: seen(A, 10.0), B.key: seen(B, 10.0), C.key: seen(C, 2 * SLA)}
    router.recompute(topo, telemetry, REPORTS, 0.0)
    weights = router.pool_weights()["m"]
    assert weights[C] <= weights[A] // 4  # 2x the SLA: a quarter of the score at most


def test_a_generative_pool_moves_away_from_a_full_kv_cache() -> None:
    topo = parse_topology(
        {"models": [{"name": "lm", "sla_p99_ms": 500, "capacity_qps": 100, "generative": True,
                     "routing": {"ewma_alpha": 1.0, "max_step": 1.0}}]}
    )  # fmt: skip
    policy = topo.policy("lm")
    assert (policy.score_weights.kv_cache, policy.score_weights.queue) == (0.35, 0.2)

    def lm(address: EndpointAddress, used: float, waiting: float) -> EndpointTelemetry:
        return EndpointTelemetry(
            address.key, age_s=0.1, interval_s=0.2, stale=False, p99_ms=Signal(20.0, 0.1),
            qps=Signal(5.0, 0.1), kv_blocks_used=Signal(used, 0.1),
            kv_blocks_total=Signal(512.0, 0.1), queue_depth=Signal(waiting, 0.1),
        )  # fmt: skip

    reports = {a: EndpointReport(a, True, frozenset({("lm", "1")}), True) for a in (A, B)}
    router = Router()
    router.recompute(topo, {A.key: lm(A, 500.0, 6.0), B.key: lm(B, 40.0, 0.0)}, reports, 0.0)
    weights = router.pool_weights()["lm"]
    assert weights[A] * 2 < weights[B]  # nearly full and with a queue: under half the weight
    reason = str(router.explain()["lm"]["endpoints"][A.key]["reason"])
    assert "kv_cache 0.02" in reason and "queue 0.00" in reason


def test_a_recompute_says_what_it_did_as_values() -> None:
    """The result and the states carry typed causes; the words are only for people."""
    router = Router()
    first = router.recompute(topology(), {a.key: seen(a, 10.0) for a in (A, B, C)}, REPORTS, 0.0)
    assert first.changed and first.new_ejections == () and first.pools_computed == 1
    slow = {A.key: seen(A, 10.0), B.key: seen(B, 10.0), C.key: seen(C, 400.0)}
    ejected = router.recompute(topology(), slow, REPORTS, 1.0)
    assert ejected.changed and ejected.new_ejections == ("latency",)
    state = router.pools["m"].ejections[C.key]
    assert state.ejected and state.causes == frozenset({EjectionCause.LATENCY})
    # The same slow server while in back-off: no new ejection is counted.
    again = router.recompute(topology(), slow, REPORTS, 2.0)
    assert again.new_ejections == ()
    back = step(router, 6.5, None)
    assert back[C.key]["state"] == "probation" and not router.pools["m"].ejections[C.key].causes
    assert step(router, 8.0, 20.0)[C.key]["state"] == "slow_start"


def test_a_hedged_pool_whose_signals_rest_still_follows_envoys_retry_share() -> None:
    """Signals unchanged tick after tick put a pool at rest (its recompute skipped); a hedged
    pool's guard must still see its hedges fall back within budget and undo its boost (before,
    the pool rested with the per-try timeout at the SLA, hedging nothing, for good)."""
    router = Router()
    hedged = {"models": [{"name": "m", "sla_p99_ms": SLA, "capacity_qps": 100,
                          "hedging": {"enabled": True}}]}  # fmt: skip
    topo = parse_topology(hedged)
    telemetry = {a.key: seen(a, 10.0) for a in (A, B, C)}
    share = {"m": 0.5}  # half the tries are hedges: over the 10% budget

    for tick in range(90):  # the same signals every second
        if tick == 10:
            share["m"] = 0.0  # calm from here
        router.recompute(topo, telemetry, REPORTS, float(tick), share.get)
        if tick == 9:
            assert router.pools["m"].hedging.boost >= 4  # boosted up to the SLA
            assert router.pool_hedges()["m"].per_try_ms == SLA
    assert router.pools["m"].hedging.boost == 1  # undone, calmly
    assert router.pool_hedges()["m"].per_try_ms == 20.0  # 2 x the pool's P99 again


def test_the_per_try_timeout_follows_the_pools_healthy_p99_and_is_explained() -> None:
    router = Router()
    step(router, 0.0, 10.0)
    assert router.pool_hedges() == {}  # off by default
    router = Router()
    hedged = {"models": [{"name": "m", "sla_p99_ms": SLA, "capacity_qps": 100,
                          "hedging": {"enabled": True}}]}  # fmt: skip
    topo = parse_topology(hedged)
    telemetry = {a.key: seen(a, 10.0) for a in (A, B, C)}
    router.recompute(topo, telemetry, REPORTS, 0.0)
    assert router.pool_hedges()["m"].per_try_ms == 20.0
    why = "per-try 20 ms = 2 x pool P99 10.0 ms (the highest of 10 s)"
    assert router.explain()["m"]["hedging"]["why"] == why
    router.recompute(topo, {**telemetry, C.key: seen(C, 400.0)}, REPORTS, 1.0)  # C: slow
    assert router.pool_hedges()["m"].per_try_ms == 20.0  # the median of the healthy ones
    decisions = [d["decision"] for d in router.decisions if d["decision"].startswith("hedging")]
    assert decisions == [f"hedging: {why}"]  # logged once


def test_a_model_failing_on_a_shared_server_keeps_it_in_a_pool_without_its_own_figures() -> None:
    """A server with two models where only the broken one has served yet (the other has no
    series of its own): on the code before, the other model's pool read the server's figures,
    the broken model's 100% errors, and ejected the server, which then never got the traffic
    that would have made its own series, and was ejected again after every back-off."""
    fine = Signal(10.0, 0.1)

    def serving(address: EndpointAddress, errors: float) -> EndpointTelemetry:
        # Only "broken" has been asked anything here: the server's figures are its figures.
        return EndpointTelemetry(
            address.key, age_s=0.1, interval_s=0.2, stale=False, p99_ms=fine, qps=fine,
            error_rate=Signal(errors, 0.1),
            models=(ModelTelemetry("broken", fine, fine, Signal(errors, 0.1)),),
        )  # fmt: skip

    telemetry = {A.key: serving(A, 0.0), B.key: serving(B, 0.0), C.key: serving(C, 1.0)}
    router = after_four_periods(telemetry)
    health = router.pool_health()
    assert health["broken"][C] is EndpointHealth.UNHEALTHY
    assert health["good"][C] is EndpointHealth.HEALTHY  # nothing says "good" fails there
    assert "error rate" not in str(router.explain()["good"]["endpoints"][C.key]["reason"])


def test_endpoints_a_placement_rule_leaves_out_take_no_part_in_the_pools_ejections() -> None:
    """On the code before, the endpoints ``placement.require`` keeps out of a model's clusters
    were judged with its pool: failing ones used up its share of ejections, and fine ones kept
    it from failing open, so every routed server could be ejected (and then put back by the
    data plane's fail-open, the one over its memory watermark with them)."""
    D = EndpointAddress("127.0.0.1", 9004)
    topo = parse_topology({"models": [
        {"name": "m", "sla_p99_ms": SLA, "capacity_qps": 100,
         "placement": {"require": {"device_class": "a100"}}}
    ]})  # fmt: skip
    reports = {a: EndpointReport(a, True, frozenset({("m", "1")}), True) for a in (A, B, C, D)}

    def server(
        address: EndpointAddress, card: str, errors: float = 0.0, used: float = 0.1
    ) -> EndpointTelemetry:
        return EndpointTelemetry(
            address.key, age_s=0.1, interval_s=0.2, stale=False, p99_ms=Signal(10.0, 0.1),
            qps=Signal(10.0, 0.1), error_rate=Signal(errors, 0.1),
            memory_used_bytes=Signal(used, 0.1), memory_total_bytes=Signal(1.0, 0.1),
            labels=(("device_class", card),),
        )  # fmt: skip

    # The share cap: the routed pool is A and B, so A's errors may take A out.
    router = Router()
    cpus_full = {C.key: server(C, "cpu", used=0.99), D.key: server(D, "cpu", used=0.99)}
    a100s = {A.key: server(A, "a100", errors=1.0), B.key: server(B, "a100")}
    router.recompute(topo, {**a100s, **cpus_full}, reports, 0.0)
    assert router.pool_health()["m"][A] is EndpointHealth.UNHEALTHY
    assert router.pool_health()["m"][B] is EndpointHealth.HEALTHY
    # Failing open: both routed servers look bad; only the one over its memory stays out.
    router = Router()
    cpus_fine = {C.key: server(C, "cpu"), D.key: server(D, "cpu")}
    a100s = {A.key: server(A, "a100", used=0.99), B.key: server(B, "a100", errors=1.0)}
    router.recompute(topo, {**a100s, **cpus_fine}, reports, 0.0)
    assert router.pool_health()["m"][A] is EndpointHealth.UNHEALTHY
    assert router.pool_health()["m"][B] is EndpointHealth.HEALTHY
    assert router.explain()["m"]["fail_open"]


def test_two_servers_leave_probation_whatever_order_they_are_looked_at_in() -> None:
    """Two servers back from a latency ejection, each no slower than the rest of the pool's
    median (150 ms): both leave probation. On the code before, the first one looked at left
    and then counted in the second one's median, which it could pull under the second's
    p99: which one stayed at weight 1 depended on a set's order (PYTHONHASHSEED), so two
    control-plane replicas could disagree."""
    D, E = EndpointAddress("127.0.0.1", 9004), EndpointAddress("127.0.0.1", 9005)
    everyone = (A, B, C, D, E)
    reports = {a: EndpointReport(a, True, frozenset({("m", "1")}), True) for a in everyone}

    def tick(router: Router, now: float, p99: dict[EndpointAddress, float | None]) -> None:
        router.recompute(topology(), {a.key: seen(a, p99.get(a, 10.0)) for a in everyone},
                         reports, now)  # fmt: skip

    for first, second in ((D, E), (E, D)):  # either may come first out of a set
        router = Router()
        tick(router, 0.0, {})
        tick(router, 1.0, {D: 400.0, E: 400.0})  # both ejected (one window)
        tick(router, 6.5, {D: None, E: None})  # back, on probation
        states = router.explain()["m"]["endpoints"]
        assert states[D.key]["state"] == states[E.key]["state"] == "probation"
        tick(router, 7.0, {A: 100.0, B: 150.0, C: 200.0, first: 120.0, second: 140.0})
        states = router.explain()["m"]["endpoints"]
        assert states[first.key]["state"] == states[second.key]["state"] == "slow_start"


def test_a_server_that_stops_draining_ramps_up_again() -> None:
    """On the code before, a server back from a drain (a drain called off) kept its first
    join time: at once the heaviest weight in the pool."""
    router = Router()
    for now in (0.0, 20.0):
        step(router, now, 10.0)  # long past slow start
    draining = {**REPORTS, C: EndpointReport(C, True, frozenset({("m", "1")}), False)}
    telemetry = {a.key: seen(a, 10.0) for a in (A, B, C)}
    telemetry[C.key] = dataclasses.replace(telemetry[C.key], draining=Flag(True, 0.1))
    router.recompute(topology(), telemetry, draining, 21.0)
    assert router.pool_health()["m"][C] is EndpointHealth.DRAINING
    back = step(router, 22.0, 10.0)  # serving again
    assert back[C.key]["health"] == "HEALTHY" and back[C.key]["state"] == "slow_start"
    assert int(back[C.key]["weight"]) < int(back[A.key]["weight"])  # type: ignore[call-overload]
    assert step(router, 32.5, 10.0)[C.key]["weight"] == back[A.key]["weight"]


def test_a_model_removed_from_the_topology_leaves_routing_and_comes_back_fresh() -> None:
    """On the code before, a removed model's pool stayed in the weights, health and /status,
    and a model of that name added back started from what the old one had left."""

    def topo(*names: str) -> Topology:
        return parse_topology({"models": [
            {"name": n, "sla_p99_ms": SLA, "capacity_qps": 100, "routing": {"slow_start_s": 10}}
            for n in names
        ]})  # fmt: skip

    both = frozenset({("m", "1"), ("n", "1")})
    reports = {a: EndpointReport(a, True, both, True) for a in (A, B, C)}
    telemetry = {a.key: seen(a, 10.0) for a in (A, B, C)}
    router = Router()
    for now in (0.0, 20.0):
        router.recompute(topo("m", "n"), telemetry, reports, now)
    assert router.explain()["n"]["endpoints"][A.key]["state"] == ""  # ramped up long ago
    router.recompute(topo("m"), telemetry, reports, 21.0)
    assert "n" not in router.pool_weights() and "n" not in router.pool_health()
    assert list(router.explain()) == ["m"]
    router.recompute(topo("m", "n"), telemetry, reports, 22.0)
    assert router.explain()["n"]["endpoints"][A.key]["state"] == "slow_start"  # a new pool


def test_a_server_with_a_small_weight_reaches_it_after_slow_start() -> None:
    """A server at its capacity and near its SLA is worth 6 of the best's 100. On the code
    before, its ramp from 1 never moved more than the hysteresis (10), so nothing was pushed,
    and once the ramp ended the pool was at rest: Envoy kept weight 1 for good while /status
    said "-> weight 6"."""
    routing = {"ewma_alpha": 1.0, "max_step": 1.0}  # the default hysteresis, 10 of 100
    topo = parse_topology(
        {"models": [{"name": "m", "sla_p99_ms": SLA, "capacity_qps": 100, "routing": routing}]}
    )

    def server(address: EndpointAddress, qps: float, p99: float) -> EndpointTelemetry:
        return EndpointTelemetry(address.key, age_s=0.1, interval_s=0.2, stale=False,
                                 p99_ms=Signal(p99, 0.1), qps=Signal(qps, 0.1))  # fmt: skip

    telemetry = {A.key: server(A, 10.0, 10.0), B.key: server(B, 10.0, 10.0)}
    router = Router()
    router.recompute(topo, telemetry, {a: REPORTS[a] for a in (A, B)}, 0.0)
    telemetry[C.key] = server(C, 100.0, 45.0)  # joins, busy
    for now in (20.0, 25.0):
        router.recompute(topo, telemetry, REPORTS, now)
    c = router.explain()["m"]["endpoints"][C.key]  # half way: 3, but moves under 10 wait
    assert c["weight"] == router.pool_weights()["m"][C] == 1
    assert "slow start -> 3; pushed 1 (" in str(c["reason"])  # /status says what Envoy has
    for now in (30.0, 31.0, 40.0):  # ramped up, then at rest
        router.recompute(topo, telemetry, REPORTS, now)
    c = router.explain()["m"]["endpoints"][C.key]
    assert router.pool_weights()["m"][C] == c["weight"] == 6
    assert str(c["reason"]).endswith("-> weight 6")


def test_an_ejected_idle_server_does_not_set_the_scale_of_the_served_ones() -> None:
    """C is ejected: no traffic, so full QPS headroom and no P99. On the code before it was the
    best score (weight 100) and A and B, both over the SLA, shared a few units: B getting
    twice as fast moved its weight less than the hysteresis, and nothing was pushed."""
    topo = parse_topology({"models": [{"name": "m", "sla_p99_ms": SLA, "capacity_qps": 100,
                                       "routing": {"slow_start_s": 0}}]})  # fmt: skip

    def served(address: EndpointAddress, p99_ms: float) -> EndpointTelemetry:
        return dataclasses.replace(seen(address, p99_ms), error_rate=Signal(0.0, 0.1))

    ejected = EndpointTelemetry(
        C.key, age_s=0.1, interval_s=0.2, stale=False, qps=Signal(0.0, 0.1),
        error_rate=Signal(0.9, 0.1),
    )  # fmt: skip
    router = Router()
    router.recompute(topo, {A.key: served(A, 90.0), B.key: served(B, 90.0), C.key: ejected},
                     REPORTS, 0.0)  # fmt: skip
    assert router.pool_health()["m"][C] is EndpointHealth.UNHEALTHY
    assert router.pool_weights()["m"][A] == router.pool_weights()["m"][B] == 100
    faster = {A.key: served(A, 90.0), B.key: served(B, 60.0), C.key: ejected}
    assert router.recompute(topo, faster, REPORTS, 0.5).changed
    weights = router.pool_weights()["m"]
    assert weights[B] == 100 and weights[A] == 62  # B's smoothed score is 1.6x A's


def test_the_grace_after_an_ejection_lasts_the_topologys_telemetry_window() -> None:
    """A server back from an ejection is judged on that ejection's cause again only once
    the window its error rate is read over (telemetry.window_s) has turned over."""
    model = {"name": "m", "sla_p99_ms": SLA, "capacity_qps": 100}
    topo = parse_topology({"telemetry": {"window_s": 30}, "models": [model]})

    def errors(address: EndpointAddress, rate: float) -> EndpointTelemetry:
        return dataclasses.replace(seen(address, 10.0), error_rate=Signal(rate, 0.1))

    telemetry = {A.key: errors(A, 0.0), B.key: errors(B, 0.0), C.key: errors(C, 0.9)}
    router = Router()
    health = []
    for now in (0.0, 5.0, 29.5, 30.0):  # ejected; back after 5 s; the window turns over at 30
        router.recompute(topo, telemetry, REPORTS, now)
        health.append(router.pool_health()["m"][C].name)
    assert health == ["UNHEALTHY", "HEALTHY", "HEALTHY", "UNHEALTHY"]
