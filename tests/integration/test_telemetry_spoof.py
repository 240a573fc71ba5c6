"""Issue 26's finding, replayed: a process that reaches the OTLP port reports
``server_draining=1`` under every server's ``service.instance.id``. Before, the whole pool left
rotation and calls failed with "no healthy upstream". Now draining from telemetry counts only
once the server's own health (its ServerReady, asked by placement) agrees, so the pool stays
and no call fails; a real drain still moves traffic away (tests/integration/test_drain.py,
tests/integration/test_edge_mesh.py)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceResponse,
)

from control_plane.telemetry.receiver import EXPORT_METHOD
from tests.envoy_support import Envoy, free_port
from tests.mesh_support import ControlPlaneThread, start_plane_and_envoy, write_topology
from tests.otlp_support import gauge, request
from tests.support import ServerProcess, Traffic, start_server

pytestmark = pytest.mark.integration


@pytest.fixture
def mesh(
    demo_repo: Path, tmp_path: Path
) -> Iterator[tuple[list[ServerProcess], ControlPlaneThread, Envoy]]:
    otlp, listener = free_port(), free_port()
    with contextlib.ExitStack() as stops:
        servers = []
        for i in (1, 2):
            server = start_server(
                demo_repo, tmp_path / f"s{i}", "--models", "classifier",
                "--otlp-endpoint", f"127.0.0.1:{otlp}", "--telemetry-interval", "0.2",
            )  # fmt: skip
            stops.callback(server.stop)
            servers.append(server)
        topology = write_topology(tmp_path / "t.yaml", listener, [s.url for s in servers])
        plane, envoy = start_plane_and_envoy(stops, tmp_path, topology, listener, 4, otlp)
        yield servers, plane, envoy


def test_a_forged_draining_report_takes_no_server_out(
    mesh: tuple[list[ServerProcess], ControlPlaneThread, Envoy],
) -> None:
    servers, plane, envoy = mesh
    forged = [request([gauge("server_draining", 1.0)], s.url).SerializeToString() for s in servers]
    draining_seen = []
    with (
        grpc.insecure_channel(f"127.0.0.1:{plane.plane.otlp_port}") as channel,
        Traffic(f"127.0.0.1:{envoy.port}", clients=2) as traffic,
    ):
        export = channel.unary_unary(
            EXPORT_METHOD, response_deserializer=ExportMetricsServiceResponse.FromString
        )
        traffic.wait_ok(20)
        ends = time.monotonic() + 4.0  # longer than the servers' own reports take to arrive
        while time.monotonic() < ends:
            for body in forged:  # accepted: OTLP does not authenticate yet (issue 26)
                export(body, timeout=5)
            clusters = envoy.admin("/clusters")
            draining_seen += [
                line for line in clusters.splitlines() if "eds_status_draining" in line
            ]
            time.sleep(0.1)
        traffic.wait_ok(40)
    assert not traffic.errors, traffic.errors[:3]
    assert draining_seen == []
    pool = plane.admin_get("/status")["routing"]["classifier"]["endpoints"]
    assert all(pool[s.url].get("health") != "DRAINING" for s in servers), pool
