"""Hedged requests for real: three servers behind Envoy, one of them slow; a try past the
per-try timeout (2 x the pool's healthy P99, from telemetry) races a second try on another
server, and the first answer wins."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.envoy_support import Envoy, free_port
from tests.mesh_support import (
    ControlPlaneThread,
    start_plane_and_envoy,
    start_reporting_servers,
    write_topology,
)
from tests.support import ServerProcess, Traffic, post_faults, wait_for

pytestmark = pytest.mark.integration
# Envoy counts a hedge as a retry (its per-try timeout counter stays 0 in hedging mode); no
# try fails in this test, so every retry is a hedge
HEDGED = "cluster.model_classifier.upstream_rq_retry"
SLOW_MS = 400


@pytest.fixture(scope="module")
def mesh(
    demo_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[list[ServerProcess], ControlPlaneThread, Envoy, int]]:
    workdir = tmp_path_factory.mktemp("hedging")
    otlp, listener = free_port(), free_port()
    with contextlib.ExitStack() as stops:
        servers = start_reporting_servers(stops, demo_repo, workdir, otlp)
        hedging = {"enabled": True}
        topology = write_topology(
            workdir / "t.yaml", listener, [s.url for s in servers], hedging=hedging
        )
        plane, envoy = start_plane_and_envoy(stops, workdir, topology, listener, 3, otlp)
        yield servers, plane, envoy, listener


def hedging(plane: ControlPlaneThread) -> dict[str, Any] | None:
    found: dict[str, Any] | None = plane.admin_get("/status")["routing"].get(
        "classifier", {}).get("hedging")  # fmt: skip
    return found


def test_a_slow_try_races_another_server_and_the_client_never_waits_for_it(
    mesh: tuple[list[ServerProcess], ControlPlaneThread, Envoy, int],
) -> None:
    servers, plane, envoy, listener = mesh
    slow, url = servers[2], f"127.0.0.1:{listener}"
    with Traffic(url, clients=2):  # the servers report a P99 only under load
        wait_for(lambda: hedging(plane), 20, "a per-try timeout from the pool's P99")
    in_force = hedging(plane)
    assert in_force is not None and in_force["why"].startswith("per-try ")
    assert 5 <= in_force["per_try_ms"] <= 100  # the floor, and never above the SLA P99
    dump = envoy.admin("/config_dump?resource=dynamic_route_configs")
    assert '"hedge_on_per_try_timeout": true' in dump
    before = envoy.counter(HEDGED)
    post_faults(slow, {"latency_ms": SLOW_MS})
    try:
        with Traffic(url, clients=2) as traffic:
            wait_for(lambda: envoy.counter(HEDGED) >= before + 5, 30, "hedged tries")
    finally:
        post_faults(slow, {"reset": True})
    latencies = sorted(latency for _, latency in traffic.latencies)
    print(
        f"\nhedging {in_force['why']}: {envoy.counter(HEDGED) - before} tries hedged; "
        f"{len(latencies)} calls, slowest {latencies[-1] * 1000:.0f} ms "
        f"(the slow server answers after {SLOW_MS} ms)"
    )
    assert not traffic.errors, traffic.errors[:5]
    assert latencies[-1] < SLOW_MS / 2 / 1000  # no client waited for the slow server
    decisions = [d["decision"] for d in plane.admin_get("/decisions")["decisions"]]
    assert any(d.startswith("hedging: per-try ") for d in decisions)
