"""grpc.health.v1.Health/Watch through the real Envoy: the stream stays open past Envoy's
default route timeout (15 s), which cut every Watch when it took the servers' unary route, and
it reports the server's change of status."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.envoy_support import free_port
from tests.mesh_support import start_plane_and_envoy, write_topology
from tests.support import start_server, wait_for

pytestmark = pytest.mark.integration
ENVOY_DEFAULT_ROUTE_TIMEOUT_S = 15.0


def test_a_health_watch_through_envoy_outlives_the_route_timeout(
    demo_repo: Path, tmp_path: Path
) -> None:
    listener = free_port()
    with contextlib.ExitStack() as stops:
        server = start_server(demo_repo, tmp_path / "server", "--drain-delay", "3.0")
        stops.callback(server.stop)
        topology = write_topology(tmp_path / "t.yaml", listener, [server.url])
        start_plane_and_envoy(stops, tmp_path, topology, listener, 2)
        statuses: list[int] = []
        ended: list[grpc.StatusCode] = []
        channel = grpc.insecure_channel(f"127.0.0.1:{listener}")
        stops.callback(channel.close)
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=60
        )

        def read() -> None:
            try:
                for answer in watch:
                    statuses.append(answer.status)
            except grpc.RpcError as error:
                ended.append(error.code())

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        wait_for(lambda: statuses, 10, "the first status")
        assert statuses[0] == health_pb2.HealthCheckResponse.SERVING
        opened = time.monotonic()
        wait_for(
            lambda: ended or time.monotonic() - opened > ENVOY_DEFAULT_ROUTE_TIMEOUT_S + 2,
            ENVOY_DEFAULT_ROUTE_TIMEOUT_S + 10,
            "the route timeout to pass",
            interval=0.2,
        )
        assert not ended, f"the Watch ended after {time.monotonic() - opened:.1f} s: {ended}"
        server.signal(signal.SIGTERM)  # drain: health says NOT_SERVING first
        wait_for(lambda: health_pb2.HealthCheckResponse.NOT_SERVING in statuses, 10, "NOT_SERVING")
        watch.cancel()
        reader.join(10)
