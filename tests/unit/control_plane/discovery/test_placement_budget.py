"""The placement poller at scale: probe budget, staggering, concurrency, request_probe.

Fake KServe v2 servers (grpc.aio, one per 127.0.0.1 port, in the test's own event loop) count
the probes they get; no fixed sleeps, every wait is a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from control_plane.config.topology import PlacementOptions, TopologyError, parse_topology
from control_plane.discovery.placement import TICK_S, EndpointReport, PlacementPoller
from control_plane.model.mesh import EndpointAddress

MODEL = ("classifier", "1")
Changes = list[Mapping[EndpointAddress, EndpointReport]]


class Fleet:
    """What every fake server of a test saw, together."""

    def __init__(self) -> None:
        self.active = 0  # RepositoryIndex calls in progress, all servers
        self.max_active = 0


class FakeServer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, fleet: Fleet, delay_s: float) -> None:
        self.fleet = fleet
        self.delay_s = delay_s
        self.models: set[tuple[str, str]] = set()
        self.calls: list[float] = []  # loop time of each RepositoryIndex call
        self.active = 0
        self.max_active = 0
        self.address = EndpointAddress("127.0.0.1", 0)

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        self.calls.append(asyncio.get_running_loop().time())
        self.active += 1
        self.fleet.active += 1
        self.max_active = max(self.max_active, self.active)
        self.fleet.max_active = max(self.fleet.max_active, self.fleet.active)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            index = service_pb2.RepositoryIndexResponse
            return index(
                models=[
                    index.ModelIndex(name=name, version=version, state="READY")
                    for name, version in sorted(self.models)
                ]
            )
        finally:
            self.active -= 1
            self.fleet.active -= 1

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerReadyResponse(ready=True)


@asynccontextmanager
async def fleet_of(n: int, delay_s: float = 0.0) -> AsyncIterator[tuple[Fleet, list[FakeServer]]]:
    fleet, fakes, servers = Fleet(), [], []
    try:
        for _ in range(n):
            fake = FakeServer(fleet, delay_s)
            server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(fake, server)
            fake.address = EndpointAddress("127.0.0.1", server.add_insecure_port("127.0.0.1:0"))
            await server.start()
            fakes.append(fake)
            servers.append(server)
        yield fleet, fakes
    finally:
        await asyncio.gather(*(server.stop(None) for server in servers))


async def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def total_calls(fakes: list[FakeServer]) -> int:
    return sum(len(f.calls) for f in fakes)


async def test_budget_stretches_the_cycle(caplog: pytest.LogCaptureFixture) -> None:
    """20 endpoints every 0.5 s would be 40 probes/s; the budget of 20/s makes it 1 s."""
    async with fleet_of(20) as (_, fakes):
        addresses = [f.address for f in fakes]
        poller = PlacementPoller(lambda: addresses, 0.5, 2.0, max_probes_per_s=20)
        assert poller.effective_interval_s == 0.5  # no endpoints known yet
        caplog.set_level(logging.INFO, logger="control_plane.discovery.placement")
        try:
            await poller.poll_once()  # as the control plane does at start
            assert poller.effective_interval_s == pytest.approx(1.0)
            loop = asyncio.get_running_loop()
            await poller.start()
            began, before = loop.time(), total_calls(fakes)
            await wait_until(lambda: all(len(f.calls) >= 4 for f in fakes), 15, "3 cycles")
            elapsed = loop.time() - began
            # The budget is a floor on time: a loaded host only stretches it further, so only
            # the lower bounds are asserted (the wait's deadline bounds the rest).
            assert elapsed >= 2.4, elapsed  # 3 cycles of 1 s, not of 0.5 s
            rate = (total_calls(fakes) - before) / elapsed
            assert rate <= 26, rate  # the budget of 20 probes/s, with a tick's rounding
            for fake in fakes:  # each endpoint once per stretched cycle
                gaps = [b - a for a, b in zip(fake.calls[1:], fake.calls[2:], strict=False)]
                assert all(gap >= 0.6 for gap in gaps), gaps
        finally:
            await poller.stop()
    warnings = [r for r in caplog.records if "probes/s" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING  # once, not per cycle


async def test_within_budget_each_endpoint_is_probed_every_interval() -> None:
    async with fleet_of(4) as (_, fakes):
        addresses = [f.address for f in fakes]
        poller = PlacementPoller(lambda: addresses, 0.4, 2.0)  # 10 probes/s: under 100
        try:
            await poller.start()  # no poll_once: all four are new, probed at the first tick
            await wait_until(lambda: len(poller.reports) == 4, 2, "first probes")
            assert poller.effective_interval_s == 0.4
            await wait_until(lambda: all(len(f.calls) >= 5 for f in fakes), 10, "4 cycles")
            for fake in fakes:
                gaps = [b - a for a, b in zip(fake.calls[1:], fake.calls[2:], strict=False)]
                assert all(0.25 <= gap <= 0.8 for gap in gaps), gaps
        finally:
            await poller.stop()


async def test_probes_are_staggered_over_the_interval() -> None:
    async with fleet_of(10) as (_, fakes):
        addresses = [f.address for f in fakes]
        poller = PlacementPoller(lambda: addresses, 1.0, 2.0)
        try:
            await poller.poll_once()
            first = [f.calls[-1] for f in fakes]
            assert max(first) - min(first) < 0.5  # poll_once: all at once, as before
            await poller.start()
            await wait_until(lambda: all(len(f.calls) >= 2 for f in fakes), 5, "one cycle")
            cycle = sorted(f.calls[1] for f in fakes)
            assert cycle[-1] - cycle[0] >= 0.5, cycle  # spread over the 1 s cycle
            most_in_50ms = max(
                sum(1 for t in cycle if start <= t < start + 0.05) for start in cycle
            )
            assert most_in_50ms <= 4, cycle
        finally:
            await poller.stop()


async def test_never_more_than_max_concurrent_probes_in_flight() -> None:
    async with fleet_of(12, delay_s=0.15) as (fleet, fakes):
        addresses = [f.address for f in fakes]
        poller = PlacementPoller(
            lambda: addresses, 0.1, 2.0, max_probes_per_s=1000, max_concurrent_probes=3
        )
        try:
            reports = await poller.poll_once()
            assert all(r.reachable for r in reports.values()) and len(reports) == 12
            assert fleet.max_active == 3  # bounded, and the bound is used
            # The background loop owes 120 probes/s, far more than 3 slow probes allow.
            await poller.start()
            before = total_calls(fakes)
            await wait_until(lambda: total_calls(fakes) >= before + 24, 10, "24 more probes")
            assert fleet.max_active <= 3
            assert poller.in_flight <= 3
            # An endpoint whose probe is in flight is not probed again.
            assert all(f.max_active == 1 for f in fakes)
        finally:
            await poller.stop()


async def test_probe_in_flight_is_not_started_again() -> None:
    async with fleet_of(1, delay_s=0.4) as (_, fakes):
        address = fakes[0].address
        poller = PlacementPoller(lambda: [address], 0.05, 2.0)  # due 8 times per slow probe
        try:
            await poller.start()
            await wait_until(lambda: len(fakes[0].calls) >= 3, 5, "three probes")
            assert fakes[0].max_active == 1
            await asyncio.gather(poller.poll_once(), poller.poll_once())
            assert fakes[0].max_active == 1
        finally:
            await poller.stop()


async def test_request_probe_sees_a_change_within_a_tick_of_a_long_cycle() -> None:
    async with fleet_of(3) as (_, fakes):
        addresses = [f.address for f in fakes]
        changes: Changes = []
        poller = PlacementPoller(lambda: addresses, 30.0, 2.0, changes.append)
        target = fakes[1]
        try:
            await poller.poll_once()
            assert len(changes) == 1
            await poller.start()
            target.models.add(MODEL)
            calls = total_calls(fakes)
            # Without request_probe, the 30 s cycle does not look again soon.
            with pytest.raises(AssertionError):
                await wait_until(lambda: total_calls(fakes) > calls, 1.0, "a probe")
            assert len(changes) == 1 and MODEL not in poller.reports[target.address].ready_models

            poller.request_probe([EndpointAddress("127.0.0.1", 1)])  # unknown: ignored
            poller.request_probe([target.address])
            poller.request_probe([target.address])  # coalesced with the first
            # Seen within seconds, where the 30 s cycle alone would take 30.
            await wait_until(lambda: len(changes) == 2, 5.0, "the change")
            assert changes[-1][target.address].ready_models == {MODEL}
            assert list(changes[-1]) == sorted(addresses)
            await asyncio.sleep(3 * TICK_S)  # the ticks after it: nothing more asked
            assert len(target.calls) == 2  # poll_once's, and one for both requests
            assert total_calls(fakes) == calls + 1
        finally:
            await poller.stop()


async def test_changes_are_delivered_once_per_tick_not_per_endpoint() -> None:
    async with fleet_of(20) as (_, fakes):
        addresses = [f.address for f in fakes]
        changes: Changes = []
        # A budget that lets one tick probe all 20 (the default, 100/s, is 5 a tick).
        poller = PlacementPoller(lambda: addresses, 30.0, 2.0, changes.append, max_probes_per_s=500)
        try:
            await poller.poll_once()
            for fake in fakes:
                fake.models.add(MODEL)
            await poller.poll_once()  # 20 endpoints changed: one delivery
            assert len(changes) == 2
            assert all(r.ready_models == {MODEL} for r in changes[-1].values())

            await poller.start()
            for fake in fakes:
                fake.models.clear()
            poller.request_probe(addresses)  # all in one tick's slice
            await wait_until(
                lambda: not any(r.ready_models for r in poller.reports.values()), 3, "all seen"
            )
            await asyncio.sleep(2 * TICK_S)
            # One tick's slice: one delivery (two if a probe finished just after a tick).
            assert 3 <= len(changes) <= 4, len(changes)
            assert not any(r.ready_models for r in changes[-1].values())
        finally:
            await poller.stop()


async def test_joining_and_leaving_endpoints_in_the_background() -> None:
    async with fleet_of(3) as (_, fakes):
        addresses = [f.address for f in fakes[:2]]
        changes: Changes = []
        poller = PlacementPoller(
            lambda: tuple(addresses), 30.0, 2.0, changes.append, keep_channels_up_to_s=60
        )
        try:
            await poller.poll_once()
            await poller.start()
            addresses.append(fakes[2].address)  # joins: probed at the next tick
            await wait_until(lambda: fakes[2].address in poller.reports, 1.0, "the new one")
            await wait_until(lambda: fakes[2].address in changes[-1], 1.0, "its delivery")
            assert list(poller.reports) == sorted(addresses)
            addresses.remove(fakes[0].address)  # leaves: dropped, channel closed
            await wait_until(lambda: fakes[0].address not in changes[-1], 1.0, "it left")
            assert fakes[0].address not in poller.reports
            assert poller.open_channels == set(addresses)
        finally:
            await poller.stop()
        assert poller.open_channels == frozenset()


def test_topology_placement_budget() -> None:
    models = [{"name": "m", "sla_p99_ms": 10, "capacity_qps": 1}]
    assert parse_topology({"models": models}).placement == PlacementOptions(
        poll_interval_s=1.0, timeout_s=1.0, max_probes_per_s=100.0, max_concurrent_probes=200
    )
    placement = {"max_probes_per_s": 50, "max_concurrent_probes": 8}
    parsed = parse_topology({"models": models, "placement": placement}).placement
    assert (parsed.max_probes_per_s, parsed.max_concurrent_probes) == (50.0, 8)
    bad = {"max_probes_per_s": 0, "max_concurrent_probes": 2.5}
    with pytest.raises(TopologyError) as caught:
        parse_topology({"models": models, "placement": bad})
    assert [e.split(":")[0] for e in caught.value.errors] == [
        "placement.max_probes_per_s", "placement.max_concurrent_probes",
    ]  # fmt: skip
    with pytest.raises(TopologyError, match="max_concurrent_probes: must be >= 1, got 0"):
        parse_topology({"models": models, "placement": {"max_concurrent_probes": 0}})


def test_constructor_keeps_positional_arguments() -> None:
    def on_change(reports: Mapping[EndpointAddress, EndpointReport]) -> None:
        pass

    poller = PlacementPoller(list, 2.0, 0.5, on_change)
    assert (poller.interval_s, poller.timeout_s, poller.on_change) == (2.0, 0.5, on_change)
    assert (poller.max_probes_per_s, poller.max_concurrent_probes) == (100.0, 200)
    poller.interval_s, poller.timeout_s = 3.0, 1.5  # the control plane sets them on reload
    assert poller.effective_interval_s == 3.0
    poller.max_concurrent_probes = 0
    assert poller.max_concurrent_probes == 1


async def test_channels_are_kept_only_while_the_cycle_is_short() -> None:
    async with fleet_of(3) as (_, fakes):
        addresses = [f.address for f in fakes]
        poller = PlacementPoller(lambda: addresses, 1.0, 2.0)
        try:
            reports = await poller.poll_once()
            assert poller.open_channels == set(addresses)
            poller.interval_s = 30.0  # a long cycle: each probe connects and lets go
            reports = await poller.poll_once()
            assert poller.open_channels == frozenset()
            assert all(r.reachable and r.server_ready for r in reports.values())
        finally:
            await poller.stop()


async def test_unchanged_probes_leave_the_reports_as_they_are() -> None:
    """A probe that finds what the last one found changes nothing, not even the mapping's
    identity: at 10,000 endpoints, copying it at every tick for a few unchanged probes was
    a third of the control plane's process. A change still makes a new mapping."""
    async with fleet_of(5) as (_, fakes):
        addresses = [f.address for f in fakes]
        poller = PlacementPoller(lambda: addresses, 30.0, 2.0, lambda _: None)
        try:
            first = await poller.poll_once()
            assert await poller.poll_once() is first
            fakes[0].models.add(MODEL)
            changed = await poller.poll_once()
            assert changed is not first and changed[fakes[0].address].ready_models == {MODEL}
            assert changed[fakes[1].address] is first[fakes[1].address]
        finally:
            await poller.stop()
