"""A control-plane loop whose iteration raises is logged, counted and started again: one bug
in a routing tick must never stop routing for good (it used to, silently)."""

from __future__ import annotations

import asyncio

import pytest

from control_plane.app import loops
from control_plane.metrics import ControlPlaneMetrics


@pytest.fixture
def supervisor(monkeypatch: pytest.MonkeyPatch) -> loops.Loops:
    """Loops with their own metrics, restarting at once."""
    monkeypatch.setattr(loops, "LOOP_RESTART_DELAY_S", 0.0)
    return loops.Loops(ControlPlaneMetrics())


def failures(supervisor: loops.Loops, loop: str) -> float | None:
    return supervisor.metrics.registry.get_sample_value(
        "control_loop_failures_total", {"loop": loop}
    )


def test_a_failing_loop_is_counted_and_restarted(supervisor: loops.Loops) -> None:
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
    assert failures(supervisor, "route_by_telemetry") == 2


def test_a_loop_cancelled_from_below_is_counted_and_restarted(supervisor: loops.Loops) -> None:
    """Closing a gRPC channel cancels its calls in flight: the CancelledError reached the loop
    that awaited one (discovery, the topology watch) though nobody cancelled the loop, and the
    supervisor, catching Exception only, let the loop end without a word."""
    runs: list[int] = []

    async def follow_slices() -> None:
        runs.append(len(runs))
        if len(runs) == 1:
            under: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            under.cancel()  # what a closed channel does to the call awaited here
            await under
        await asyncio.sleep(3600)  # the second run: a loop that goes on until stopped

    async def main() -> None:
        supervisor.spawn("follow_slices", follow_slices)
        for _ in range(1000):
            if len(runs) == 2:
                break
            await asyncio.sleep(0)
        (task,) = supervisor.tasks
        supervisor.stop()  # and its own cancellation still ends it
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(main(), 10))
    assert runs == [0, 1]
    assert failures(supervisor, "follow_slices") == 1
