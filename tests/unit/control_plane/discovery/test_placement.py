"""Placement: the pure MeshState builder, and the poller against real model servers."""

from __future__ import annotations

import asyncio
import itertools
import random
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from control_plane.config.topology import Topology, parse_topology
from control_plane.discovery.placement import (
    EndpointReport,
    PlacementPoller,
    grpc_target,
    open_channel,
    probe_endpoint,
)
from control_plane.model.mesh import (
    SERVERS_CLUSTER,
    EndpointAddress,
    EndpointAssignment,
    EndpointHealth,
    MeshState,
    model_cluster,
)
from control_plane.routing.mesh_state import ClusterMemo, build_mesh_state
from tests.support import EXPLICIT, ServerProcess, start_server

A = EndpointAddress("127.0.0.1", 8001)
B = EndpointAddress("127.0.0.1", 8002)
C = EndpointAddress("127.0.0.1", 8003)
D = EndpointAddress("10.0.0.4", 8001)
BOTH = frozenset({("classifier", "1"), ("classifier", "2")})


def topology() -> Topology:
    return parse_topology(
        {
            "models": [
                {"name": "classifier", "sla_p99_ms": 50, "capacity_qps": 100,
                 "version_split": {"1": 90, "2": 10}},
                {"name": "detector", "sla_p99_ms": 20, "capacity_qps": 100},
                {"name": "absent", "sla_p99_ms": 20, "capacity_qps": 100,
                 "version_split": {"7": 1}},
            ]
        }
    )  # fmt: skip


def report(
    address: EndpointAddress,
    models: set[tuple[str, str]] | frozenset[tuple[str, str]] = frozenset(),
    reachable: bool = True,
    server_ready: bool = True,
) -> EndpointReport:
    return EndpointReport(address, reachable, frozenset(models), server_ready, "")


def members(clusters: Mapping[str, tuple[EndpointAssignment, ...]]) -> dict[str, list[str]]:
    return {name: [e.address.key for e in endpoints] for name, endpoints in clusters.items()}


def test_clusters_per_model_and_version() -> None:
    reports = {
        A: report(A, BOTH),
        B: report(B, {("classifier", "1"), ("detector", "3")}, server_ready=False),
        C: report(C, BOTH, reachable=False),  # stale models of an unreachable server: ignored
        D: report(D, {("classifier", "3"), ("unlisted", "1")}),
    }
    state = build_mesh_state(topology(), reports)
    assert state.listener == topology().listener
    assert state.models == topology().models
    assert members(state.clusters) == {
        "model:absent": [],
        "model:absent:v7": [],  # in the split, READY nowhere: empty, so routes still resolve
        "model:classifier": ["10.0.0.4:8001", "127.0.0.1:8001", "127.0.0.1:8002"],
        "model:classifier:v1": ["127.0.0.1:8001", "127.0.0.1:8002"],
        "model:classifier:v2": ["127.0.0.1:8001"],
        "model:classifier:v3": ["10.0.0.4:8001"],  # not in the split, READY somewhere
        "model:detector": ["127.0.0.1:8002"],
        "model:detector:v3": ["127.0.0.1:8002"],
        SERVERS_CLUSTER: ["10.0.0.4:8001", "127.0.0.1:8001"],  # B's server is not ready
    }
    assert all(
        e.weight == 1 and e.health is EndpointHealth.HEALTHY
        for endpoints in state.clusters.values()
        for e in endpoints
    )


def test_nothing_reachable_gives_empty_clusters() -> None:
    state = build_mesh_state(topology(), {A: report(A, BOTH, reachable=False)})
    assert set(state.clusters) == {
        model_cluster("absent"), model_cluster("absent", "7"), model_cluster("classifier"),
        model_cluster("classifier", "1"), model_cluster("classifier", "2"),
        model_cluster("detector"), SERVERS_CLUSTER,
    }  # fmt: skip
    assert all(endpoints == () for endpoints in state.clusters.values())
    assert build_mesh_state(topology(), {}) == state


def test_weights_and_health() -> None:
    reports = {A: report(A, BOTH), B: report(B, BOTH)}
    weights = {A: 5, B: 0}  # below 1 is raised to 1: EDS needs >= 1
    health = {B: EndpointHealth.DRAINING}
    state = build_mesh_state(topology(), reports, weights=weights, health=health)
    assert state.clusters[model_cluster("classifier", "2")] == (
        EndpointAssignment(A, 5, EndpointHealth.HEALTHY),
        EndpointAssignment(B, 1, EndpointHealth.DRAINING),
    )


def test_routing_never_ejects_every_endpoint_of_a_cluster() -> None:
    """A's ejection counts against the whole pool (A, B), but v2 is READY on A alone."""
    reports = {A: report(A, BOTH), B: report(B, {("classifier", "1")})}
    ejected = {"classifier": {A: EndpointHealth.UNHEALTHY}}
    state = build_mesh_state(topology(), reports, pool_health=ejected)
    health = {n: [e.health for e in state.clusters[n]] for n in state.clusters}
    assert health[model_cluster("classifier")] == [EndpointHealth.UNHEALTHY, EndpointHealth.HEALTHY]
    assert health[model_cluster("classifier", "2")] == [EndpointHealth.HEALTHY]  # failed open
    # An operator's UNHEALTHY is obeyed even when it empties a cluster.
    operator = {A: EndpointHealth.UNHEALTHY}
    state = build_mesh_state(topology(), reports, health=operator, pool_health=ejected)
    assert [e.health for e in state.clusters[model_cluster("classifier", "2")]] == [
        EndpointHealth.UNHEALTHY
    ]


def health_table(state: MeshState) -> dict[str, str]:
    """Cluster -> "A- B+": each member, + healthy, - unhealthy, ~ other."""
    mark = {EndpointHealth.HEALTHY: "+", EndpointHealth.UNHEALTHY: "-"}
    names = {A: "A", B: "B", C: "C"}
    return {
        name: " ".join(f"{names[e.address]}{mark.get(e.health, '~')}" for e in members)
        for name, members in state.clusters.items()
        if members
    }


@pytest.mark.parametrize(
    ("down", "pool_health", "operator", "want"),
    [
        # Envoy's checks of model:classifier find A down: A leaves the classifier's version
        # clusters, not the checked cluster itself; A still serves the detector, so it stays
        # in `servers`.
        ({"classifier": {A}}, {}, {},
         {"model:classifier": "A+ B+ C+", "model:classifier:v1": "A- B+",
          "model:classifier:v2": "A- C+", "model:detector": "A+", "model:detector:v1": "A+",
          SERVERS_CLUSTER: "A+ B+ C+"}),
        # Down in both models that check it: out of `servers` too.
        ({"classifier": {A}, "detector": {A}}, {}, {},
         {"model:classifier": "A+ B+ C+", "model:classifier:v1": "A- B+",
          "model:classifier:v2": "A- C+", "model:detector": "A+", "model:detector:v1": "A-",
          SERVERS_CLUSTER: "A- B+ C+"}),
        # Every member of v2 down: Envoy's finding is not failed open (routing's would be).
        ({"classifier": {A, C}}, {}, {},
         {"model:classifier": "A+ B+ C+", "model:classifier:v1": "A- B+",
          "model:classifier:v2": "A- C-", "model:detector": "A+", "model:detector:v1": "A+",
          SERVERS_CLUSTER: "A+ B+ C-"}),
        # Routing ejected C itself: Envoy reporting it unhealthy is our own EDS health, not a
        # failed check; it stays out of the versions by routing, and in `servers`.
        ({"classifier": {C}}, {"classifier": {C: EndpointHealth.UNHEALTHY}}, {},
         {"model:classifier": "A+ B+ C-", "model:classifier:v1": "A+ B+",
          "model:classifier:v2": "A+ C-", "model:detector": "A+", "model:detector:v1": "A+",
          SERVERS_CLUSTER: "A+ B+ C+"}),
        # An operator's word wins over Envoy's.
        ({"classifier": {B}}, {}, {B: EndpointHealth.HEALTHY},
         {"model:classifier": "A+ B+ C+", "model:classifier:v1": "A+ B+",
          "model:classifier:v2": "A+ C+", "model:detector": "A+", "model:detector:v1": "A+",
          SERVERS_CLUSTER: "A+ B+ C+"}),
    ],
)  # fmt: skip
def test_unchecked_clusters_follow_envoys_checks(
    down: dict[str, set[EndpointAddress]],
    pool_health: dict[str, dict[EndpointAddress, EndpointHealth]],
    operator: dict[EndpointAddress, EndpointHealth],
    want: dict[str, str],
) -> None:
    """listener.health_checks: model: Envoy checks a server only in its model's own cluster."""
    reports = {
        A: report(A, {("classifier", "1"), ("classifier", "2"), ("detector", "1")}),
        B: report(B, {("classifier", "1")}),
        C: report(C, {("classifier", "2")}),
    }
    found = {model: frozenset(addresses) for model, addresses in down.items()}
    state = build_mesh_state(
        topology(), reports, health=operator, pool_health=pool_health, checked_down=found
    )
    assert health_table(state) == want


def test_identical_inputs_give_identical_state() -> None:
    rng = random.Random(7)
    addresses = [EndpointAddress("127.0.0.1", 8000 + i) for i in range(12)]
    pairs = [(m, v) for m in ("classifier", "detector", "other") for v in "1234"]
    reports = {
        a: report(a, set(rng.sample(pairs, 4)), rng.random() > 0.2, rng.random() > 0.3)
        for a in addresses
    }
    first = build_mesh_state(topology(), reports)
    for _ in range(5):
        shuffled = list(reports.items())
        rng.shuffle(shuffled)
        again = build_mesh_state(topology(), dict(shuffled))
        assert again == first
        assert list(again.clusters) == list(first.clusters) == sorted(first.clusters)
        assert repr(again) == repr(first)
    for endpoints in first.clusters.values():
        assert [e.address for e in endpoints] == sorted(e.address for e in endpoints)


def test_a_kept_memo_builds_what_a_fresh_build_does() -> None:
    """build_mesh_state with a memo kept between builds, through a random walk of placement,
    routing, operator and Envoy-check changes, equals a build from scratch at every step, and
    built again from equal inputs hands back every cluster's own tuple."""
    rng = random.Random(11)
    addresses = [EndpointAddress("127.0.0.1", 8000 + i) for i in range(10)]
    pairs = [(m, v) for m in ("classifier", "detector") for v in "12"]
    reports = {a: report(a, set(rng.sample(pairs, 2))) for a in addresses}
    weights: dict[EndpointAddress, int] = {}
    health: dict[EndpointAddress, EndpointHealth] = {}
    pool_weights: dict[str, dict[EndpointAddress, int]] = {"classifier": {}, "detector": {}}
    pool_health: dict[str, dict[EndpointAddress, EndpointHealth]] = {"classifier": {}}
    down: dict[str, frozenset[EndpointAddress]] = {}
    labels: dict[str, tuple[tuple[str, str], ...]] = {}
    lanes = parse_topology(
        {
            "models": [
                {"name": "classifier", "sla_p99_ms": 50, "capacity_qps": 100,
                 "sla_classes": {"interactive": {"timeout_s": 1}, "batch": {"timeout_s": 30}}},
                {"name": "detector", "sla_p99_ms": 20, "capacity_qps": 100},
            ]
        }
    )  # fmt: skip
    memo: ClusterMemo = {}
    for step in range(300):
        a, change = rng.choice(addresses), rng.randrange(7)
        if change == 0:
            reports[a] = report(a, set(rng.sample(pairs, rng.randrange(3))), rng.random() > 0.2)
        elif change == 1:  # routing: a new dict for the pool, as Router.pool_weights gives
            model = rng.choice(["classifier", "detector"])
            pool_weights[model] = {**pool_weights[model], a: rng.randrange(1, 100)}
        elif change == 2:
            pool_health["classifier"] = {
                **pool_health["classifier"],
                a: rng.choice(list(EndpointHealth)),
            }
        elif change == 3:  # an operator's override, changed in place
            weights[a] = rng.randrange(1, 50)
        elif change == 4:
            health.pop(a, None) if a in health else health.__setitem__(a, EndpointHealth.DRAINING)
        elif change == 5:  # reserved for a class or not: a lane's priorities move
            labels[a.key] = () if labels.get(a.key) else (("reserved_for", "interactive"),)
        else:
            down = {"classifier": frozenset(rng.sample(addresses, rng.randrange(3)))}
        inputs = (lanes, reports, weights, health, pool_weights, pool_health)
        kept = build_mesh_state(*inputs, labels=labels, checked_down=down, memo=memo)
        assert kept == build_mesh_state(*inputs, labels=labels, checked_down=down), step
        if not down:  # built again from equal inputs: every cluster handed back as it was
            again = build_mesh_state(*inputs, labels=labels, memo=memo)
            assert all(again.clusters[n] is kept.clusters[n] for n in kept.clusters)


def test_grpc_target_brackets_ipv6() -> None:
    assert grpc_target(A) == "127.0.0.1:8001"
    assert grpc_target(EndpointAddress("::1", 8001)) == "[::1]:8001"


@pytest.fixture
def dead_address() -> Iterator[EndpointAddress]:
    """A loopback port that is bound (so nobody else gets it) but not listening: refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield EndpointAddress("127.0.0.1", sock.getsockname()[1])


def test_probe_of_a_dead_endpoint_does_not_raise(dead_address: EndpointAddress) -> None:
    result = asyncio.run(probe_endpoint(dead_address, timeout_s=2.0))
    assert result.address == dead_address
    assert not result.reachable and not result.server_ready and not result.ready_models
    assert "UNAVAILABLE" in result.error or "DEADLINE_EXCEEDED" in result.error

    async def on_a_closed_channel() -> EndpointReport:
        channel = open_channel(dead_address)
        await channel.close()
        return await probe_endpoint(dead_address, 2.0, channel)

    result = asyncio.run(on_a_closed_channel())
    assert not result.reachable and "closed" in result.error


def test_a_probe_whose_channel_is_closed_under_it_reports_it_and_returns() -> None:
    """set_tls closes the probe channels; a probe in flight on one then raised CancelledError,
    which ended the loop awaiting it (discovery, the topology watch) without a word. The probe
    now reports the endpoint unreachable, as for any failed call."""

    async def closed_under_a_probe() -> EndpointReport:
        with socket.socket() as silent:  # accepts, never answers: the probe stays in flight
            silent.bind(("127.0.0.1", 0))
            silent.listen()
            silent.setblocking(False)
            address = EndpointAddress("127.0.0.1", silent.getsockname()[1])
            channel = open_channel(address)
            probe = asyncio.ensure_future(probe_endpoint(address, 30.0, channel))
            accepted, _ = await asyncio.wait_for(asyncio.get_running_loop().sock_accept(silent), 10)
            with accepted:
                await channel.close()  # what set_tls does
                return await asyncio.wait_for(probe, 10)

    result = asyncio.run(closed_under_a_probe())
    assert not result.reachable and "CANCELLED: its channel was closed" in result.error


def test_failed_delivery_is_retried_and_left_endpoints_are_dropped(
    dead_address: EndpointAddress,
) -> None:
    calls: list[Mapping[EndpointAddress, EndpointReport]] = []
    addresses = [dead_address]

    async def on_change(reports: Mapping[EndpointAddress, EndpointReport]) -> None:
        calls.append(reports)
        if len(calls) == 1:
            raise RuntimeError("snapshot build failed")

    async def current() -> list[EndpointAddress]:
        return list(addresses)

    async def scenario() -> None:
        poller = PlacementPoller(current, interval_s=0.1, timeout_s=2.0, on_change=on_change)
        try:
            with pytest.raises(RuntimeError):
                await poller.poll_once()
            assert not poller.reports[dead_address].reachable
            await poller.poll_once()  # not delivered last time: delivered again
            await poller.poll_once()  # nothing changed: no call
            assert len(calls) == 2
            assert poller.open_channels == {dead_address}
            addresses.clear()
            assert await poller.poll_once() == {}
            assert len(calls) == 3 and calls[-1] == {}
            assert poller.open_channels == frozenset()
        finally:
            await poller.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("unreachable_after", "answers", "seen"),
    [
        # (the probe's answers in turn, whether the endpoint reads reachable after each)
        (2, [True, False, True, False, False, False], [True, True, True, True, False, False]),
        (3, [True, False, False, True, False, False, False], [True] * 6 + [False]),
        (1, [True, False, True], [True, False, True]),
        (2, [False, False, True], [False, False, True]),  # never reached: at once
    ],
)
def test_a_reachable_endpoint_leaves_after_failed_probes_in_a_row(
    monkeypatch: pytest.MonkeyPatch, unreachable_after: int, answers: list[bool], seen: list[bool]
) -> None:
    """On a loaded fleet one probe may time out: a reachable endpoint is taken out only after
    ``unreachable_after`` failures in a row, so a lone timeout costs no rebuild. (The probe
    is scripted: real probes are tested against real servers below.)"""
    script = iter(answers)

    async def probe(address: EndpointAddress, *_: object) -> EndpointReport:
        reachable = next(script)
        models = BOTH if reachable else frozenset()
        return EndpointReport(address, reachable, models, reachable, "" if reachable else "down")

    monkeypatch.setattr("control_plane.discovery.placement.probe_endpoint", probe)
    deliveries: list[bool] = []

    async def scenario() -> list[bool]:
        poller = PlacementPoller(
            lambda: [A],
            on_change=lambda r: deliveries.append(r[A].reachable),
            unreachable_after=unreachable_after,
        )
        found = []
        for _ in answers:
            found.append((await poller.poll_once())[A].reachable)
        return found

    assert asyncio.run(scenario()) == seen
    # Delivered once at first, then only when what it reads changed.
    changes = [seen[0]] + [b for a, b in itertools.pairwise(seen) if a != b]
    assert deliveries == changes


@pytest.mark.integration
def test_poller_sees_real_servers(
    demo_repo: Path, tmp_path: Path, dead_address: EndpointAddress
) -> None:
    servers: list[ServerProcess] = []
    try:
        for _ in range(2):
            logs = tmp_path / "logs"
            servers.append(start_server(demo_repo, logs, *EXPLICIT, "--models", "classifier"))
        asyncio.run(_poll_real_servers(servers, dead_address))
    finally:
        for server in servers:
            server.stop()


async def _poll_real_servers(servers: list[ServerProcess], dead: EndpointAddress) -> None:
    first, second = (EndpointAddress("127.0.0.1", s.port) for s in servers)
    changes: list[Mapping[EndpointAddress, EndpointReport]] = []
    changed = asyncio.Event()

    def on_change(reports: Mapping[EndpointAddress, EndpointReport]) -> None:
        changes.append(reports)
        changed.set()

    poller = PlacementPoller(lambda: [first, second, dead], 0.1, 5.0, on_change)
    try:
        reports = await poller.poll_once()
        assert list(reports) == sorted([first, second, dead])
        for address in (first, second):
            assert reports[address].reachable and reports[address].server_ready
            assert reports[address].ready_models == BOTH, reports[address].error
            assert reports[address].error == ""
        assert not reports[dead].reachable and reports[dead].error
        assert len(changes) == 1
        await poller.poll_once()
        assert len(changes) == 1  # same placement: no callback

        # Unload on one server; the background loop notices and calls on_change.
        changed.clear()
        await poller.start()
        await asyncio.to_thread(lambda: servers[0].client().unload_model("classifier"))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while ("classifier", "1") in poller.reports[first].ready_models:
            await asyncio.wait_for(changed.wait(), max(0.0, deadline - loop.time()))
            changed.clear()
        reports = changes[-1]
        assert reports[first].reachable and not reports[first].ready_models
        assert reports[second].ready_models == BOTH

        state = build_mesh_state(topology(), reports)
        for version in (None, "1", "2"):
            cluster = state.clusters[model_cluster("classifier", version)]
            assert [e.address for e in cluster] == [second]
    finally:
        await poller.stop()
    assert poller.open_channels == frozenset()
