"""What a telemetry shard resends: telemetry_moved's table, split_moved's bookkeeping,
touches on the control plane's side (fresh again, or asked for whole), and routing woken by
moved telemetry."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest

from control_plane.config.topology import TelemetryOptions, parse_topology_text
from control_plane.metrics import ControlPlaneMetrics
from control_plane.routing.loop import ticks_or_wakes
from control_plane.telemetry.moved import REFRESH_S, split_moved, telemetry_moved
from control_plane.telemetry.shards import Push, TelemetryShards
from control_plane.telemetry.values import EndpointTelemetry, Flag, ModelTelemetry, Signal

BASE = EndpointTelemetry(
    "a:1", 0.2, 1.0, stale=False,
    p99_ms=Signal(40.0, 0.2), qps=Signal(100.0, 0.2), memory_used_bytes=Signal(2e9, 0.2),
    memory_total_bytes=Signal(8e9, 0.2), draining=Flag(False, 0.2),
    models=(ModelTelemetry("m", Signal(40.0, 0.2), Signal(100.0, 0.2)),), series=10,
)  # fmt: skip


def _model(p99: float = 40.0, qps: float = 100.0, name: str = "m") -> tuple[ModelTelemetry]:
    return (ModelTelemetry(name, Signal(p99, 0.2), Signal(qps, 0.2)),)


@pytest.mark.parametrize(
    ("change", "moved"),
    [
        ({}, False),
        ({"age_s": 2.5}, False),  # ages are not compared
        ({"p99_ms": Signal(40.0, 3.0)}, False),
        ({"qps": Signal(101.9, 0.2)}, False),  # 1.9% < 2%
        ({"qps": Signal(102.5, 0.2)}, True),
        ({"p99_ms": Signal(30.0, 0.2)}, True),
        ({"p99_ms": None}, True),  # a signal that went away
        ({"error_rate": Signal(0.0, 0.2)}, True),  # one that appeared
        ({"interval_s": 1.4}, False),  # late exports: staleness is judged in whole intervals
        ({"interval_s": 2.5}, True),
        ({"stale": True}, True),
        ({"draining": Flag(True, 0.2)}, True),
        ({"draining": None}, True),
        ({"labels": (("zone", "b"),)}, True),
        ({"memory_source": "nvml"}, True),
        ({"series": 11}, True),
        ({"models": _model(p99=40.5)}, False),
        ({"models": _model(p99=60.0)}, True),
        ({"models": _model(qps=50.0)}, True),
        ({"models": _model(name="n")}, True),
        ({"models": ()}, True),
    ],
)
def test_what_moved(change: dict[str, Any], moved: bool) -> None:
    assert telemetry_moved(BASE, dataclasses.replace(BASE, **change), 0.02) is moved


def test_split_sends_whole_what_moved_is_new_asked_for_or_due() -> None:
    sent: dict[str, tuple[float, EndpointTelemetry]] = {}
    b = dataclasses.replace(BASE, endpoint="b:1")
    whole, touched, moved = split_moved({"a:1": BASE, "b:1": b}, sent, 10.0, 0.02)
    assert set(whole) == {"a:1", "b:1"} and touched == () and moved  # new: whole
    same = dataclasses.replace(BASE, age_s=0.4)
    whole, touched, moved = split_moved({"a:1": same, "b:1": b}, sent, 10.5, 0.02)
    assert whole == {} and touched == ("a:1", "b:1") and not moved
    faster = dataclasses.replace(b, qps=Signal(150.0, 0.2))
    whole, touched, moved = split_moved({"a:1": same, "b:1": faster}, sent, 11.0, 0.02)
    assert set(whole) == {"b:1"} and touched == ("a:1",) and moved
    assert sent["a:1"][1] is BASE  # the reference stays what was sent: no creeping drift
    whole, _, moved = split_moved({"a:1": same}, sent, 12.0, 0.02, resend=frozenset({"a:1"}))
    assert set(whole) == {"a:1"} and sent["a:1"][1] is same and moved


def test_refreshes_come_within_the_period_and_spread_out() -> None:
    """Sent whole again after half to all of REFRESH_S (a refresh alone does not wake
    routing), each at its own time: a fleet that started together is not refreshed in one
    push."""
    fleet = {f"e:{i}": dataclasses.replace(BASE, endpoint=f"e:{i}") for i in range(200)}
    sent: dict[str, tuple[float, EndpointTelemetry]] = {}
    split_moved(fleet, sent, 0.0, 0.02)
    whole, touched, _ = split_moved(fleet, sent, REFRESH_S * 0.49, 0.02)
    assert whole == {} and len(touched) == 200
    whole, _, moved = split_moved(fleet, sent, REFRESH_S * 0.75, 0.02)
    assert 40 < len(whole) < 160 and not moved  # about half, by chance
    whole, _, _ = split_moved(fleet, sent, REFRESH_S, 0.02)
    assert set(whole) | {k for k, (due, _) in sent.items() if due > REFRESH_S} == set(fleet)


def _push(at: float, whole: dict[str, EndpointTelemetry], touched: tuple[str, ...]) -> Push:
    read = {key: (at, t) for key, t in whole.items()}
    return Push(at, read, touched, bool(whole), frozenset(), frozenset(), (), 0, {}, ())


class _Conn:
    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []

    def send(self, message: tuple[Any, ...]) -> None:
        self.sent.append(message)


def test_a_touch_keeps_an_endpoint_fresh_and_one_it_cannot_apply_asks_for_it_whole() -> None:
    shards = TelemetryShards(2, TelemetryOptions(stale_after_intervals=3.0))
    conns = [_Conn(), _Conn()]
    shards._conns = conns  # type: ignore[assignment]
    shards._apply(0, _push(10.0, {"a:1": BASE}, ()))
    # Not heard of for 4 s (4 intervals): stale, and the routing read keeps the aged copy.
    assert shards.snapshot(14.0, ages=False)["a:1"].stale
    shards._apply(0, _push(14.2, {}, ("a:1",)))  # it reports again, unmoved
    fresh = shards.snapshot(14.3, ages=False)["a:1"]
    assert fresh is BASE and not fresh.stale  # as pushed, not the stale copy
    assert shards.snapshot(14.3)["a:1"].age_s == pytest.approx(BASE.age_s + 0.1)
    assert conns[0].sent == []
    # A touch from the other shard (the server reconnected there) or of an endpoint the
    # control plane does not have cannot be applied: that shard is asked for them whole.
    shards._apply(1, _push(15.0, {}, ("a:1", "z:9")))
    assert conns[1].sent == [("resend", ("a:1", "z:9"))]
    assert "z:9" not in shards.snapshot(15.0)


@pytest.mark.parametrize(
    ("push_tolerance", "pool_tolerances", "effective"),
    [(None, (), 0.02), (None, (0.0,), 0.0), (0.01, (0.05, 0.03), 0.01), (0.04, (0.05, 0.03), 0.03)],
)
def test_push_tolerance_is_no_more_than_any_pool_ignores(
    push_tolerance: float | None, pool_tolerances: tuple[float, ...], effective: float
) -> None:
    lines = ["models:"]
    lines += [f"  - {{name: m{i}, sla_p99_ms: 50, capacity_qps: 100, routing: "
              f"{{recompute_tolerance: {t}}}}}" for i, t in enumerate(pool_tolerances)]  # fmt: skip
    if not pool_tolerances:
        lines += ["  - {name: m, sla_p99_ms: 50, capacity_qps: 100}"]
    if push_tolerance is not None:
        lines += [f"telemetry: {{push_tolerance: {push_tolerance}}}"]
    topology = parse_topology_text("\n".join(lines) + "\n", "t.yaml")
    assert topology.telemetry.push_tolerance == effective


async def test_moved_telemetry_wakes_routing_before_its_tick() -> None:
    """At rest routing runs on its tick; moved telemetry (a shard's push) runs it after the
    minimum gap instead, and a wake during a run is not lost."""
    wake, ran, runs = asyncio.Event(), asyncio.Event(), []
    loop = asyncio.get_running_loop()

    async def run() -> None:
        runs.append(loop.time())
        ran.set()

    started = loop.time()
    task = asyncio.create_task(ticks_or_wakes(wake, 30.0, 0.05, run))
    try:
        await asyncio.sleep(0.2)
        assert runs == []  # the tick is 30 s away
        wake.set()
        await asyncio.wait_for(ran.wait(), 5)
        assert len(runs) == 1 and runs[0] - started < 10  # woken, not ticked
        ran.clear()
        wake.set()  # again at once: after the gap
        await asyncio.wait_for(ran.wait(), 5)
        assert len(runs) == 2 and runs[1] - runs[0] >= 0.05
    finally:
        task.cancel()


def test_the_control_plane_counts_what_was_sent_whole_touched_and_how_late() -> None:
    metrics = ControlPlaneMetrics()
    shards = TelemetryShards(1, TelemetryOptions(), metrics=metrics)
    now = time.monotonic()
    shards._apply(0, dataclasses.replace(_push(now - 0.2, {"a:1": BASE}, ()), delay=1.5))
    shards._apply(0, _push(now, {}, ("a:1",)))
    sample = metrics.registry.get_sample_value
    assert sample("telemetry_shard_endpoints_total", {"sent": "whole"}) == 1
    assert sample("telemetry_shard_endpoints_total", {"sent": "touched"}) == 1
    assert sample("telemetry_shard_delay_seconds_count") == 2
    # The first push: reported 1.5 s before it left the shard, 0.2 s before it arrived.
    assert sample("telemetry_shard_delay_seconds_bucket", {"le": "1.0"}) == 1
    assert sample("telemetry_shard_delay_seconds_bucket", {"le": "2.5"}) == 2
