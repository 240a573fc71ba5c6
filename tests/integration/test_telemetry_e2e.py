"""Real model servers export OTLP to the real control plane, which sees what clients see."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.envoy_support import free_port
from tests.mesh_support import ControlPlaneThread, write_topology
from tests.support import ServerProcess, post_faults, start_server, wait_for

pytestmark = pytest.mark.integration
INTERVAL_S = 0.2
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def telemetry_mesh(
    demo_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[list[ServerProcess], ControlPlaneThread]]:
    workdir = tmp_path_factory.mktemp("telemetry")
    otlp = free_port()
    with contextlib.ExitStack() as stops:
        servers = []
        for i in (1, 2):
            server = start_server(
                demo_repo, workdir / f"s{i}", "--models", "classifier",
                "--otlp-endpoint", f"127.0.0.1:{otlp}",
                "--telemetry-interval", str(INTERVAL_S), "--enable-fault-injection",
            )  # fmt: skip
            stops.callback(server.stop)
            servers.append(server)
        topology = write_topology(workdir / "t.yaml", free_port(), [s.url for s in servers])
        plane = ControlPlaneThread(topology, otlp_port=otlp)
        stops.callback(plane.stop)
        yield servers, plane


def endpoint(plane: ControlPlaneThread, server: ServerProcess) -> dict[str, Any]:
    return dict(plane.admin_get("/telemetry")["endpoints"].get(server.url) or {})


def value(signal_: Any) -> float:
    return float(signal_["value"]) if isinstance(signal_, dict) else float(signal_)


def client_p99_ms(server: ServerProcess, seconds: float, clients: int = 2) -> float:
    """Steady load from ``clients`` threads; the p99 latency the clients measured."""
    latencies: list[float] = []
    lock = threading.Lock()
    ends = time.monotonic() + seconds

    def run() -> None:
        client = grpcclient.InferenceServerClient(server.url)
        tensor = grpcclient.InferInput("input", [1, 3, 32, 32], "FP32")
        tensor.set_data_from_numpy(np.zeros((1, 3, 32, 32), dtype=np.float32))
        while time.monotonic() < ends:
            started = time.perf_counter()
            client.infer("classifier", [tensor])
            with lock:
                latencies.append((time.perf_counter() - started) * 1000)

    threads = [threading.Thread(target=run) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=seconds + 30)
    return float(np.percentile(latencies, 99))


# Large against what a loaded host adds (a few ms to either server, and to the clients' own
# view, which shares this process with the control plane): with 20 ms the bounds below were
# within a few ms of what a busy host produced.
INJECTED_MS = 50


def test_injected_latency_shows_in_the_control_planes_p99(
    telemetry_mesh: tuple[list[ServerProcess], ControlPlaneThread],
) -> None:
    (slow, fast), plane = telemetry_mesh
    post_faults(slow, {"latency_ms": INJECTED_MS})
    try:
        results: dict[str, float] = {}
        threads = [
            threading.Thread(target=lambda s=s: results.__setitem__(s.url, client_p99_ms(s, 4)))
            for s in (slow, fast)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        ended = time.monotonic()
        for server in (slow, fast):  # an export made after the load ended has arrived

            def fresh(server: ServerProcess = server) -> bool:
                signal = endpoint(plane, server)["p99_ms"]
                return signal is not None and signal["age_s"] < time.monotonic() - ended

            wait_for(fresh, 10, f"an export from {server.url} after the load")
        seen_slow = value(endpoint(plane, slow)["p99_ms"])
        seen_fast = value(endpoint(plane, fast)["p99_ms"])
        client_slow, client_fast = results[slow.url], results[fast.url]
        print(
            f"p99 slow/fast: control plane {seen_slow:.2f}/{seen_fast:.2f} ms, "
            f"clients {client_slow:.2f}/{client_fast:.2f} ms"
        )
        assert seen_slow >= INJECTED_MS, (seen_slow, client_slow)
        # The server's P99 tracks what clients saw: never above it (beyond bucket error), and
        # not far below (clients add their own queueing on a busy host, so not equal).
        assert 0.6 * client_slow <= seen_slow <= 1.2 * client_slow, (seen_slow, client_slow)
        # The latency injected keeps them apart even when this shared host slows both down (the
        # fast server serves several times the requests, so it is the busier one).
        assert seen_fast < seen_slow - INJECTED_MS / 2, (seen_fast, seen_slow)
        assert seen_fast <= client_fast * 1.2, (seen_fast, client_fast)
        assert value(endpoint(plane, slow)["qps"]) > 0
    finally:
        post_faults(slow, {"reset": True})


def test_memory_ballast_moves_the_memory_signal(
    telemetry_mesh: tuple[list[ServerProcess], ControlPlaneThread],
) -> None:
    server, plane = telemetry_mesh[0][1], telemetry_mesh[1]
    wait_for(
        lambda: endpoint(plane, server).get("memory_used_bytes") is not None, 10, "a memory signal"
    )
    before = value(endpoint(plane, server)["memory_used_bytes"])
    assert endpoint(plane, server)["memory_source"] == "process"
    post_faults(server, {"ballast_bytes": 200 * MiB})
    try:
        started = time.monotonic()
        wait_for(
            lambda: value(endpoint(plane, server)["memory_used_bytes"]) >= before + 180 * MiB,
            2 * INTERVAL_S + 1.0,  # two intervals, plus the allocation itself
            "the ballast in the memory signal",
            interval=0.02,
        )
        assert time.monotonic() - started < 2 * INTERVAL_S + 1.0
    finally:
        post_faults(server, {"ballast_bytes": 0})


def test_a_stopped_server_goes_stale(
    telemetry_mesh: tuple[list[ServerProcess], ControlPlaneThread],
) -> None:
    server, plane = telemetry_mesh[0][0], telemetry_mesh[1]
    # Fresh, and its interval learned from the arrivals (a smoothed gap that starts at the
    # default of 1 s): stale must come from this interval, not the default's.
    wait_for(
        lambda: (
            (e := endpoint(plane, server)).get("stale") is False
            and float(e["interval_s"]) < 2 * INTERVAL_S
        ),
        10,
        "a fresh endpoint with its interval learned",
    )
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:

        def stale_view() -> dict[str, Any] | None:
            view = endpoint(plane, server)
            return view if view.get("stale") is True else None

        stale = wait_for(stale_view, 5, "stale", 0.02)
        # Stale once the last report is 3 intervals old (the topology's default), by the plane's
        # own clock: never before, and the wait's deadline bounds how late.
        assert float(stale["age_s"]) > 3 * float(stale["interval_s"]), stale
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    wait_for(lambda: endpoint(plane, server).get("stale") is False, 5, "fresh again")
