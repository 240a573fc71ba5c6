"""``bootstrap --run --drain-on-stop``: a stop signal drains Envoy before it exits, so a request
in flight finishes (compose.private.yaml's Envoy under ``docker compose stop``), where a plain
``--run`` Envoy resets it. Real Envoy, control plane and model server."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2_grpc

from infermesh.wire import IN_FLIGHT
from tests.envoy_support import free_port
from tests.mesh_support import ControlPlaneThread, write_topology
from tests.support import (
    ServerProcess,
    classifier_request,
    metric_value,
    post_faults,
    start_server,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration
SLOW_MS = 1200


@pytest.fixture(scope="module")
def mesh(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    workdir = tmp_path_factory.mktemp("envoy-drain")
    with contextlib.ExitStack() as stops:
        server = start_server(demo_repo, workdir / "s", "--enable-fault-injection")
        stops.callback(server.stop)
        listener = free_port()
        plane = ControlPlaneThread(write_topology(workdir / "t.yaml", listener, [server.url]))
        stops.callback(plane.stop)
        yield server, plane, listener, workdir


def start_envoy(mesh: Any, drain_s: float) -> tuple[subprocess.Popen[bytes], int, Path]:
    _, plane, listener, workdir = mesh
    admin = free_port()
    log = workdir / f"envoy-{admin}.log"
    command = [
        sys.executable, "-m", "control_plane.xds.bootstrap", "--run",
        "--drain-on-stop", str(drain_s), "--xds-port", str(plane.plane.xds_port),
        "--admin-port", str(admin), "--node-id", f"envoy-{admin}",
        "--", "--drain-time-s", "3", "--drain-strategy", "immediate", "-l", "warning",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    return proc, listener, log


def infer(listener: int) -> grpc.StatusCode:
    request = classifier_request(np.zeros((1, 3, 32, 32), dtype=np.float32))
    with grpc.insecure_channel(f"127.0.0.1:{listener}") as channel:
        try:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=20)
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def stop_during_a_slow_request(mesh: Any, drain_s: float) -> tuple[grpc.StatusCode, int | None]:
    """A request that takes 1.2 s (its route allows 2), and the stop signal while it runs: its
    status, and the exit code of the process that was signalled."""
    server: ServerProcess = mesh[0]
    proc, listener, _ = start_envoy(mesh, drain_s)
    try:
        wait_for(lambda: infer(listener) == grpc.StatusCode.OK, 30, "Envoy serving")
        post_faults(server, {"latency_ms": SLOW_MS})
        outcome: list[grpc.StatusCode] = []
        call = threading.Thread(target=lambda: outcome.append(infer(listener)))
        call.start()
        wait_for(lambda: metric_value(server.metrics(), IN_FLIGHT) >= 1, 10, "it at the server")
        proc.send_signal(signal.SIGTERM)
        call.join(timeout=30)
        code = proc.wait(timeout=30)
        return outcome[0], code
    finally:
        post_faults(server, {"reset": True})
        stop_process(proc, signal.SIGKILL, 5)


def test_a_stop_signal_drains_envoy_before_it_exits(mesh: Any) -> None:
    status, code = stop_during_a_slow_request(mesh, drain_s=10)
    assert status == grpc.StatusCode.OK  # finished through the drain
    assert code == 0


def test_without_the_drain_the_request_in_flight_is_reset(mesh: Any) -> None:
    """What --drain-on-stop is for (and that the test above can fail)."""
    status, _ = stop_during_a_slow_request(mesh, drain_s=0)
    assert status == grpc.StatusCode.UNAVAILABLE
