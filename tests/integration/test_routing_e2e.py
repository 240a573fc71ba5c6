"""Telemetry-driven routing for real: three servers behind Envoy, one of them degraded."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from control_plane.model.mesh import model_cluster
from tests.envoy_support import Envoy, free_port
from tests.mesh_support import (
    ControlPlaneThread,
    start_plane_and_envoy,
    start_reporting_servers,
    write_topology,
)
from tests.support import ServerProcess, Traffic, post_faults, wait_for

pytestmark = pytest.mark.integration
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def mesh(
    demo_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[list[ServerProcess], ControlPlaneThread, Envoy, int]]:
    workdir = tmp_path_factory.mktemp("routing")
    otlp, listener = free_port(), free_port()
    with contextlib.ExitStack() as stops:
        servers = start_reporting_servers(
            stops, demo_repo, workdir, otlp, "--memory-budget", "600MiB"
        )
        # Telemetry-driven weights and ejections alone (hedging is off by default;
        # test_hedging_e2e.py has it on)
        topology = write_topology(workdir / "t.yaml", listener, [s.url for s in servers])
        plane, envoy = start_plane_and_envoy(stops, workdir, topology, listener, 6, otlp)
        yield servers, plane, envoy, listener


def routing(plane: ControlPlaneThread, server: ServerProcess) -> dict[str, Any]:
    pools = plane.admin_get("/status")["routing"]
    return dict(pools.get("classifier", {}).get("endpoints", {}).get(server.url, {}))


def shares(servers: list[ServerProcess], listener: int, requests: int = 150) -> list[float]:
    """Each server's share of ``requests`` sequential calls through Envoy."""

    def served() -> list[int]:
        out = []
        for s in servers:
            stats = s.client().get_inference_statistics("classifier").model_stats
            out.append(sum(m.inference_count for m in stats))
        return out

    before = served()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{listener}")
    tensor = grpcclient.InferInput("input", [1, 3, 32, 32], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, 3, 32, 32), dtype=np.float32))
    for _ in range(requests):
        client.infer("classifier", [tensor])
    return [(a - b) / requests for a, b in zip(served(), before, strict=True)]


def test_a_slow_server_loses_weight_and_traffic(
    mesh: tuple[list[ServerProcess], ControlPlaneThread, Envoy, int],
) -> None:
    servers, plane, _, listener = mesh
    slow = servers[0]
    post_faults(slow, {"latency_ms": 150})  # past the 100 ms SLA: its latency score is 0
    try:
        started = time.monotonic()
        with Traffic(f"127.0.0.1:{listener}", clients=3):  # load, so the P99 moves

            def weight_fell() -> bool:
                others = [routing(plane, s).get("weight") or 0 for s in servers[1:]]
                return (routing(plane, slow).get("weight") or 100) < 0.7 * min(others)

            wait_for(weight_fell, 20, "the slow server's weight to fall", interval=0.1)
            reaction = time.monotonic() - started
        explained = routing(plane, slow)
        print(f"weight fell after {reaction:.1f}s: {explained}")
        assert "latency 0.00" in explained["reason"]
        shares_now = shares(servers, listener, 200)
        print(f"shares of 200 sequential requests through Envoy: {shares_now}")
        assert shares_now[0] < 0.8 * min(shares_now[1:])  # a third each before
        decisions = plane.admin_get("/decisions")["decisions"]
        assert any("weights" in d["decision"] for d in decisions)
    finally:
        post_faults(slow, {"reset": True})


def test_memory_over_the_watermark_ejects_and_return_is_gradual(
    mesh: tuple[list[ServerProcess], ControlPlaneThread, Envoy, int],
) -> None:
    servers, plane, envoy, listener = mesh
    hungry = servers[1]
    post_faults(hungry, {"ballast_bytes": 560 * MiB})  # past 95% of the 600 MiB budget
    try:
        wait_for(lambda: routing(plane, hungry).get("health") == "UNHEALTHY", 15, "ejection")
        assert "memory" in routing(plane, hungry)["reason"]
        metrics = plane.admin_get("/metrics")
        assert 'routing_ejections_total{cause="memory"} 1.0' in metrics
        wait_for(
            lambda: (
                f"{model_cluster('classifier')}::{hungry.url}::health_flags::/eds_status_unhealthy"
                in envoy.admin("/clusters")
                or "failed_eds_health" in envoy.admin("/clusters")
            ),
            10,
            "Envoy to see the ejection",
        )
        assert shares(servers, listener, 60)[1] == 0
        # Only one of three is out: never more than the configured share.
        healths = [routing(plane, s).get("health") for s in servers]
        assert healths.count("UNHEALTHY") == 1
    finally:
        post_faults(hungry, {"ballast_bytes": 0})
    wait_for(lambda: routing(plane, hungry).get("health") == "HEALTHY", 30, "return")
    # Back through slow start: a small weight first, the full one after the 10 s ramp.
    others = [s for s in servers if s is not hungry]
    first = routing(plane, hungry)
    assert "slow start" in first["reason"], first
    assert first["weight"] < min(routing(plane, s)["weight"] for s in others)
    wait_for(
        lambda: (
            "slow start" not in routing(plane, hungry)["reason"]
            and routing(plane, hungry)["weight"]
            >= 0.9 * min(routing(plane, s)["weight"] for s in others)
        ),
        20,
        "the end of the slow start ramp, pushed",
        interval=0.2,
    )


def test_never_more_than_the_configured_share_is_ejected(
    mesh: tuple[list[ServerProcess], ControlPlaneThread, Envoy, int],
) -> None:
    servers, plane, _, _ = mesh
    hungry = [servers[0], servers[2]]  # two of three over the watermark; the cap is half
    for server in hungry:
        post_faults(server, {"ballast_bytes": 560 * MiB})
    try:
        wait_for(
            lambda: [routing(plane, s).get("health") for s in hungry].count("UNHEALTHY") == 1,
            25,
            "one of the two ejected",
        )
        held = next(s for s in hungry if routing(plane, s).get("health") == "HEALTHY")
        wait_for(lambda: "would eject" in routing(plane, held)["reason"], 10, "the cap, said")
        watch_until = time.monotonic() + 3  # observe several recomputes, never two out
        while time.monotonic() < watch_until:
            healths = [routing(plane, s).get("health") for s in servers]
            assert healths.count("UNHEALTHY") <= 1, healths
            time.sleep(0.1)
    finally:
        for server in hungry:
            post_faults(server, {"ballast_bytes": 0})
    wait_for(
        lambda: all(routing(plane, s).get("health") == "HEALTHY" for s in servers), 30, "return"
    )
