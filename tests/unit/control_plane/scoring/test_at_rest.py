"""Pools at rest are not recomputed: only the pool whose inputs moved pays for a change, and
skipping never changes a decision (a router that skips ends where one that never skips does)."""

from __future__ import annotations

import dataclasses
import random
from array import array

import pytest

from control_plane.config.topology import Topology, parse_topology
from control_plane.discovery.placement import EndpointReport
from control_plane.model.mesh import EndpointAddress
from control_plane.routing.router import Router
from control_plane.scoring.at_rest import at_rest, near, signals_moved
from control_plane.scoring.ejection import EjectionCause, EjectionState
from control_plane.scoring.pipeline import PoolState
from control_plane.scoring.types import EndpointSignals, PoolPolicy
from control_plane.telemetry.decode import PointTuple
from control_plane.telemetry.store import TelemetryStore
from control_plane.telemetry.values import EndpointTelemetry, ModelTelemetry, Signal

POLICY = PoolPolicy(capacity_qps=100, sla_p99_ms=50)


@pytest.mark.parametrize(
    ("a", "b", "tolerance", "expected"),
    [
        (None, None, 0.02, True),
        (None, 0.0, 0.02, False),
        (0.0, None, 0.02, False),
        (0.0, 0.0, 0.0, True),
        (100.0, 101.0, 0.02, True),
        (100.0, 103.0, 0.02, False),
        (100.0, 100.0001, 0.0, False),  # tolerance 0: any change moves
        (-5.0, -5.05, 0.02, True),
        (0.0, 1e-9, 0.02, False),  # from zero, anything is a move
    ],
)
def test_near(a: float | None, b: float | None, tolerance: float, expected: bool) -> None:
    assert near(a, b, tolerance) is expected


def sig(endpoint: str = "a:1", **fields: object) -> EndpointSignals:
    base: dict[str, object] = {"qps": 50.0, "p99_ms": 20.0}
    return EndpointSignals(endpoint, **{**base, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("after", "moved"),
    [
        ([sig()], False),
        ([sig(qps=50.5)], False),  # 1% of a rate: the wobble of arrival times
        ([sig(qps=60.0)], True),
        ([sig(p99_ms=None)], True),  # a signal went missing
        ([sig(stale=True)], True),
        ([sig(draining=True)], True),
        ([sig(labels=(("device_class", "a10g"),))], True),
        ([sig("b:1")], True),  # another endpoint
        ([sig(), sig("b:1")], True),  # one joined
        ([], True),
    ],
)
def test_signals_moved(after: list[EndpointSignals], moved: bool) -> None:
    assert signals_moved([sig()], after, 0.02) is moved


STATE = PoolState(scores={"a:1": 0.8}, weights={"a:1": 100})


@pytest.mark.parametrize(
    ("before", "after", "joined_at", "probation", "rest"),
    [
        ((STATE, {}), (STATE, {}), {}, (), True),
        ((None, {}), (STATE, {}), {}, (), False),  # the first recompute
        ((STATE, {}), (PoolState(STATE.scores, {"a:1": 90}), {}), {}, (), False),
        ((STATE, {}), (PoolState({"a:1": 0.81}, STATE.weights), {}), {}, (), False),  # EWMA
        ((STATE, {}), (PoolState({"a:1": 0.80001}, STATE.weights), {}), {}, (), True),
        ((STATE, {}), (STATE, {"a:1": EjectionState(latency_strikes=1)}), {}, (), False),
        (
            (STATE, {"a:1": EjectionState(latency_strikes=1, struck_at=99.9)}),
            (STATE, {"a:1": EjectionState(latency_strikes=1, struck_at=99.9)}),
            {},
            (),
            False,  # its next strike comes with time
        ),
        (
            (STATE, {"a:1": EjectionState(ejected=True, until=105.0)}),
            (STATE, {"a:1": EjectionState(ejected=True, until=105.0)}),
            {},
            (),
            False,  # its back-off ends with time
        ),
        (
            (STATE, {"a:1": EjectionState(times_ejected=1, returned_at=50.0)}),
            (STATE, {"a:1": EjectionState(times_ejected=1, returned_at=50.0)}),
            {},
            (),
            False,  # its ejection count is forgotten at 50 + backoff_max_s
        ),
        (
            (STATE, {"a:1": EjectionState(grace=frozenset({EjectionCause.ERRORS}))}),
            (STATE, {"a:1": EjectionState(grace=frozenset({EjectionCause.ERRORS}))}),
            {},
            (),
            False,  # its error rate is judged again when the window has turned over
        ),
        ((STATE, {}), (STATE, {}), {"a:1": 95.0}, (), False),  # ramping up (slow start)
        ((STATE, {}), (STATE, {}), {"a:1": 80.0}, (), True),  # ramped
        ((STATE, {}), (STATE, {}), {}, ("a:1",), False),  # on probation
    ],
)
def test_at_rest(
    before: tuple[PoolState | None, dict[str, EjectionState]],
    after: tuple[PoolState, dict[str, EjectionState]],
    joined_at: dict[str, float],
    probation: tuple[str, ...],
    rest: bool,
) -> None:
    assert at_rest(before, after, joined_at, probation, POLICY, now=100.0) is rest


# -- the router ------------------------------------------------------------------------------
POOLS = 5
PER_POOL = 3
ADDRESSES = [EndpointAddress("127.0.0.1", 9000 + i) for i in range(POOLS * PER_POOL)]
POOL_OF = {a: f"m{i % POOLS}" for i, a in enumerate(ADDRESSES)}


def fleet(**routing: object) -> Topology:
    models = [
        {"name": f"m{j}", "sla_p99_ms": 50, "capacity_qps": 100, "routing": routing}
        for j in range(POOLS)
    ]
    return parse_topology({"models": models})


REPORTS = {a: EndpointReport(a, True, frozenset({(POOL_OF[a], "1")}), True) for a in ADDRESSES}


def telemetry(
    p99: dict[EndpointAddress, float], wobble: float = 0.0
) -> dict[str, EndpointTelemetry]:
    out = {}
    for a in ADDRESSES:
        ms, qps = Signal(p99.get(a, 10.0), 0.1), Signal(40.0 * (1 + wobble), 0.1)
        out[a.key] = EndpointTelemetry(
            a.key, age_s=0.1, interval_s=1.0, stale=False, p99_ms=ms, qps=qps,
            models=(ModelTelemetry(POOL_OF[a], ms, qps),),
        )  # fmt: skip
    return out


def settle(router: Router, topology: Topology, now: float) -> float:
    """Ticks with steady telemetry until every pool is at rest; the time after."""
    for _ in range(60):
        before = router.pools_skipped
        router.recompute(topology, telemetry({}), REPORTS, now)
        now += 0.5
        if router.pools_skipped - before == POOLS:
            return now
    raise AssertionError("the pools never came to rest")


def test_a_change_at_one_endpoint_recomputes_only_its_pool() -> None:
    topology, router = fleet(slow_start_s=0), Router()
    now = settle(router, topology, 0.0)
    computed = router.pools_computed
    router.recompute(topology, telemetry({}, wobble=0.01), REPORTS, now)  # within tolerance
    assert router.pools_computed == computed
    slow = ADDRESSES[0]
    router.recompute(topology, telemetry({slow: 400.0}), REPORTS, now + 0.5)
    assert router.pools_computed == computed + 1  # m0 alone
    assert router.explain()["m0"]["endpoints"][slow.key]["score"] < 0.5


def test_skipping_never_changes_a_decision() -> None:
    """The same telemetry through a router that skips pools at rest and through one that never
    does (tolerance 0 and a wobble on every tick): the same weights and health at every tick,
    through a slow server's strikes, its ejection, back-off, probation and slow start."""
    skipping, exact = fleet(), fleet(recompute_tolerance=0.0)
    lazy, eager = Router(), Router()
    slow = ADDRESSES[1]
    timeline: list[dict[EndpointAddress, float]] = [{}] * 20 + [{slow: 400.0}] * 10 + [{}] * 60
    now = 0.0
    for tick, p99 in enumerate(timeline):
        lazy.recompute(skipping, telemetry(p99), REPORTS, now)
        eager.recompute(exact, telemetry(p99, wobble=1e-9 * (tick % 2)), REPORTS, now)
        assert lazy.pool_weights() == eager.pool_weights(), tick
        assert lazy.pool_health() == eager.pool_health(), tick
        now += 0.5
    # Every pool ramps up for slow_start_s (20 ticks); then the four the slow server is not
    # in stay at rest, while its own keeps computing (its ejection count lasts backoff_max_s).
    assert lazy.pools_skipped >= (POOLS - 1) * (len(timeline) - 22)
    assert eager.pools_skipped == 0
    events = [d["decision"] for d in lazy.decisions if slow.key in d["decision"]]
    assert any("ejected" in e for e in events) and any("returned" in e for e in events)


def test_a_policy_change_recomputes_the_pool() -> None:
    router = Router()
    now = settle(router, fleet(), 0.0)
    computed = router.pools_computed
    router.recompute(fleet(hysteresis=0.2), telemetry({}), REPORTS, now)
    assert router.pools_computed == computed + POOLS


def test_a_pool_losing_an_endpoint_is_recomputed() -> None:
    router = Router()
    now = settle(router, fleet(), 0.0)
    gone = dataclasses.replace(REPORTS[ADDRESSES[0]], reachable=False)
    router.recompute(fleet(), telemetry({}), {**REPORTS, ADDRESSES[0]: gone}, now)
    assert ADDRESSES[0] not in router.pool_weights()["m0"]


BOUNDS_S = (0.005, 0.01, 0.025, 0.05, 0.1)


def export(
    store: TelemetryStore,
    key: str,
    at: float,
    exported_s: float,
    slow: bool,
    start_time: bool = True,
) -> None:
    """What a model server reports after ``exported_s + 1`` seconds of steady traffic (100
    requests a second, p99 under the 50 ms SLA; or, ``slow``, 50 more past the last bound).
    Without ``start_time`` the exporter's timestamps are unknown (rates use arrivals)."""
    start_ns, duration = (1, exported_s + 1.0) if start_time else (0, 0.0)
    n = 100.0 * (exported_s + 1)
    counts = array("d", [0.6 * n, 0.35 * n, 0.05 * n, 0.0, 0.0, 50.0 if slow else 0.0])
    model = POOL_OF[next(a for a in ADDRESSES if a.key == key)]
    attrs = (("model", model), ("version", "1"))
    name = "inference_request_duration_seconds"
    requests = (("code", "OK"), *attrs)
    points: list[PointTuple] = [
        (key, name, "histogram", attrs, counts, BOUNDS_S, False, start_ns, duration),
        (key, "inference_requests", "counter", requests, (sum(counts),), (), False, start_ns,
         duration),
    ]  # fmt: skip
    store.ingest_points(points, {}, [], at)


def late_exports(tolerance: float, start_time: bool = True) -> tuple[Router, TelemetryStore, int]:
    """30 s of steady exports, each arriving up to 0.3 s late, routed every 0.2 s; the
    router, the store, and how many pools it computed in the last 10 s (of 5 x 50)."""
    rng = random.Random(7)
    store, router = TelemetryStore(), Router()
    topology = fleet(recompute_tolerance=tolerance)
    arrivals = sorted(
        (second + rng.uniform(0.0, 0.3), a.key, float(second))
        for second in range(30)
        for a in ADDRESSES
    )
    index, computed = 0, 0
    for tick in range(150):
        now = tick * 0.2
        while index < len(arrivals) and arrivals[index][0] <= now:
            at, key, exported_s = arrivals[index]
            export(store, key, at, exported_s, slow=False, start_time=start_time)
            index += 1
        before = router.pools_computed
        router.recompute(topology, store.snapshot(now, ages=False), REPORTS, now)
        computed += router.pools_computed - before if tick >= 100 else 0
    return router, store, computed


def test_exports_arriving_late_do_not_wake_pools_at_rest() -> None:
    """Steady traffic whose exports arrive up to 0.3 s late (a receiver's queues under load):
    rates are measured over the exporter's own timestamps, so they do not move at all and no
    pool wakes at the default tolerance. Without them (arrival times), an exact comparison
    recomputes nearly every pool at every tick and the tolerance keeps most at rest. A real
    change at one endpoint still reaches its pool."""
    _, _, exact = late_exports(0.0, start_time=False)
    _, _, default_by_arrival = late_exports(PoolPolicy.recompute_tolerance, start_time=False)
    assert exact >= 0.9 * POOLS * 50
    assert default_by_arrival <= 0.3 * POOLS * 50  # the rest: converging after a real move
    router, store, default = late_exports(PoolPolicy.recompute_tolerance)
    assert default == 0
    assert {t.qps.value for t in store.snapshot(30.0).values() if t.qps} == {100.0}
    slow = ADDRESSES[0]
    export(store, slow.key, 30.0, 30.0, slow=True)
    before = router.pools_computed
    topology = fleet(recompute_tolerance=PoolPolicy.recompute_tolerance)
    router.recompute(topology, store.snapshot(30.1, ages=False), REPORTS, 30.1)
    assert router.pools_computed - before < POOLS  # its pool (and one still converging)
    assert router.explain()[POOL_OF[slow]]["endpoints"][slow.key]["score"] < 0.5
