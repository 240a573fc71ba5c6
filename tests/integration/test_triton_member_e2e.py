"""A mixed fleet for real: one InferMesh model server and one Triton server (the tritonserver
binary from the nvidia-pytriton wheel, tools/install_triton.sh) serve the same model through
Envoy. Triton's signals come from scraping its Prometheus metrics; injected slowness in either
server moves traffic to the other."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.envoy_support import Envoy, free_port
from tests.mesh_support import ControlPlaneThread, start_plane_and_envoy, write_topology
from tests.support import (
    ROOT,
    ServerProcess,
    Traffic,
    infer_classifier,
    post_faults,
    post_json,
    start_server,
    stop_process,
    successes,
    wait_for,
)

pytestmark = pytest.mark.integration
TRITON_PYTHON = ROOT / ".venv-triton" / "bin" / "python"
SLA_P99_MS = 100.0


@dataclass
class TritonMember:
    """tests/triton_member.py in its own virtualenv; stopped by its PID."""

    proc: subprocess.Popen[bytes]
    grpc_port: int
    http_port: int
    metrics_port: int
    fault_port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def client(self) -> grpcclient.InferenceServerClient:
        return grpcclient.InferenceServerClient(self.url)

    def faults(self, body: dict[str, Any]) -> None:
        post_json(f"http://127.0.0.1:{self.fault_port}/faults", body, timeout=5)

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGTERM, 20)


def start_triton(repository: Path, log_dir: Path) -> TritonMember:
    if not TRITON_PYTHON.exists():
        pytest.fail(f"{TRITON_PYTHON} is missing: run tools/install_triton.sh (make does)")
    log_dir.mkdir(parents=True, exist_ok=True)
    ports = [free_port() for _ in range(4)]
    log_path = log_dir / "triton.log"
    command = [
        str(TRITON_PYTHON), "tests/triton_member.py", "--models", str(repository),
        "--grpc-port", str(ports[0]), "--http-port", str(ports[1]),
        "--metrics-port", str(ports[2]), "--fault-port", str(ports[3]),
    ]  # fmt: skip
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, cwd=ROOT)
    member = TritonMember(proc, ports[0], ports[1], ports[2], ports[3], log_path)

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"the Triton member exited: {log_path.read_text()[-2000:]}")
        with contextlib.suppress(Exception):
            return bool(member.client().is_model_ready("classifier"))
        return False

    try:
        wait_for(ready, 90, "the Triton member's classifier READY")
    except BaseException:
        member.stop()
        raise
    return member


@pytest.fixture(scope="module")
def fleet(
    demo_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, TritonMember, ControlPlaneThread, Envoy, int]]:
    workdir = tmp_path_factory.mktemp("mixed")
    otlp, listener = free_port(), free_port()
    with contextlib.ExitStack() as stops:
        triton = start_triton(demo_repo, workdir / "triton")
        stops.callback(triton.stop)
        ours = start_server(
            demo_repo, workdir / "ours", "--models", "classifier",
            "--otlp-endpoint", f"127.0.0.1:{otlp}", "--telemetry-interval", "0.25",
            "--enable-fault-injection",
        )  # fmt: skip
        stops.callback(ours.stop)
        endpoints = [
            {"address": ours.url, "rest_port": ours.http_port},
            {"address": triton.url, "kind": "triton", "rest_port": triton.http_port,
             "metrics_url": f"http://127.0.0.1:{triton.metrics_port}/metrics"},
        ]  # fmt: skip
        top = {"endpoints": endpoints, "telemetry": {"scrape_interval_s": 0.5}}
        topology = write_topology(
            workdir / "t.yaml", listener, [], top=top, sla_p99_ms=SLA_P99_MS,
            routing={"slow_start_s": 2, "backoff_base_s": 2},
        )  # fmt: skip
        plane, envoy = start_plane_and_envoy(stops, workdir, topology, listener, 6, otlp)
        yield ours, triton, plane, envoy, listener


def served(ours: ServerProcess, triton: TritonMember) -> tuple[int, int]:
    return successes(ours.client()), successes(triton.client())


def triton_share(ours: ServerProcess, triton: TritonMember, at_least: int = 60) -> float:
    """Triton's share of the next ``at_least`` requests the running traffic completes."""
    before = served(ours, triton)

    def enough() -> bool:
        now = served(ours, triton)
        return now[0] - before[0] + now[1] - before[1] >= at_least

    wait_for(enough, 30, f"{at_least} requests served")
    after = served(ours, triton)
    theirs, ours_n = after[1] - before[1], after[0] - before[0]
    return theirs / max(1, theirs + ours_n)


def settles(check: Callable[[float], bool], ours: ServerProcess, triton: TritonMember) -> float:
    """Waits until a share measurement passes ``check``; returns it."""
    seen: list[float] = []

    def measured() -> bool:
        seen.append(triton_share(ours, triton))
        return check(seen[-1])

    wait_for(measured, 60, "the traffic to move", interval=0.1)
    return seen[-1]


def test_triton_answers_through_envoy_like_our_server(
    fleet: tuple[ServerProcess, TritonMember, ControlPlaneThread, Envoy, int],
) -> None:
    ours, triton, plane, _, listener = fleet
    images = np.random.default_rng(7).random((2, 3, 32, 32), dtype=np.float32)
    # The member serves version 1 only (PyTriton binds one version); ours serves 1 and 2.
    clients = (ours.client(), triton.client())
    direct = [infer_classifier(c, images, version="1").as_numpy("probs") for c in clients]
    np.testing.assert_allclose(direct[0], direct[1], rtol=1e-5, atol=1e-6)
    through = grpcclient.InferenceServerClient(f"127.0.0.1:{listener}")
    outputs = [infer_classifier(through, images, "1").as_numpy("probs") for _ in range(20)]
    for out in outputs:
        np.testing.assert_allclose(out, direct[0], rtol=1e-5, atol=1e-6)

    def scraped() -> bool:
        seen = plane.admin_get("/telemetry")
        endpoint = seen["endpoints"].get(triton.url) or {}
        scrape = seen.get("scrapes", {}).get(triton.url) or {}
        return bool(endpoint.get("qps")) and scrape.get("failures", 1) == 0

    wait_for(scraped, 30, "Triton's scraped signals in the control plane's telemetry")


def test_rest_through_envoy_reaches_both_at_their_own_rest_ports(
    fleet: tuple[ServerProcess, TritonMember, ControlPlaneThread, Envoy, int],
) -> None:
    ours, triton, _, _, listener = fleet
    images = np.random.default_rng(8).random((1, 3, 32, 32), dtype=np.float32)
    expected = infer_classifier(ours.client(), images, version="1").as_numpy("probs")
    client = httpclient.InferenceServerClient(f"127.0.0.1:{listener}")
    tensor = httpclient.InferInput("input", list(images.shape), "FP32")
    tensor.set_data_from_numpy(images, binary_data=True)
    before = served(ours, triton)
    for _ in range(40):
        answer = client.infer("classifier", [tensor], model_version="1")
        np.testing.assert_allclose(answer.as_numpy("probs"), expected, rtol=1e-5, atol=1e-6)
    after = served(ours, triton)
    assert after[0] > before[0] and after[1] > before[1], (before, after)  # both served


def test_slowness_in_either_server_moves_traffic_to_the_other(
    fleet: tuple[ServerProcess, TritonMember, ControlPlaneThread, Envoy, int],
) -> None:
    ours, triton, plane, _, listener = fleet
    with Traffic(f"127.0.0.1:{listener}", clients=4, deadline_s=240) as traffic:
        traffic.wait_ok(50)
        balanced = triton_share(ours, triton)
        started = time.monotonic()
        post_faults(ours, {"latency_ms": 300})
        try:
            to_triton = settles(lambda share: share > 0.8, ours, triton)
            ours_slow_s = time.monotonic() - started
        finally:
            post_faults(ours, {"reset": True})
        settles(lambda share: share < 0.8, ours, triton)  # ours is back in rotation
        started = time.monotonic()
        triton.faults({"latency_ms": 300})
        try:
            to_ours = settles(lambda share: share < 0.2, ours, triton)
            triton_slow_s = time.monotonic() - started
        finally:
            triton.faults({"reset": True})
    print(
        f"\nTriton's share: {balanced:.2f} balanced; {to_triton:.2f} {ours_slow_s:.1f} s after "
        f"our server was slowed; {to_ours:.2f} {triton_slow_s:.1f} s after Triton was slowed; "
        f"{traffic.ok} OK, {len(traffic.errors)} failed"
    )
    decisions = plane.admin_get("/decisions")["decisions"]
    assert any(triton.url in str(d) for d in decisions), decisions
    assert not traffic.errors, traffic.errors[:5]
