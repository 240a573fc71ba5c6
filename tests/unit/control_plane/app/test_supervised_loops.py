"""A control-plane loop whose iteration raises is logged, counted and started again: one bug
in a routing tick must never stop routing for good (it used to, silently)."""

from __future__ import annotations

import asyncio

import pytest

from control_plane.app import loops
from control_plane.metrics import ControlPlaneMetrics


def test_a_failing_loop_is_counted_and_restarted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loops, "LOOP_RESTART_DELAY_S", 0.0)
    metrics = ControlPlaneMetrics()
    supervisor = loops.Loops(metrics)
    runs: list[int] = []

    async def _route_by_telemetry() -> None:
        runs.append(len(runs))
        if len(runs) < 3:
            raise ValueError("a bug in one tick")

    async def main() -> None:
        supervisor.spawn("route_by_telemetry", _route_by_telemetry)
        for _ in range(1000):
            if not supervisor.tasks:
                return
            await asyncio.sleep(0)
        raise AssertionError("the loop never finished")

    asyncio.run(asyncio.wait_for(main(), 10))
    assert runs == [0, 1, 2]  # failed twice, restarted each time, then returned
    failures = metrics.registry.get_sample_value(
        "control_loop_failures_total", {"loop": "route_by_telemetry"}
    )
    assert failures == 2
