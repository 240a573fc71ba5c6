"""SLA classes for real: two model servers behind Envoy, one reserved for interactive requests
(it reports the label itself, over OTLP), and a saturating batch-class load on the other."""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2_grpc

from control_plane.lanes import sla_cluster
from control_plane.mesh import EndpointAddress, model_cluster
from tests.envoy_support import Envoy, free_port
from tests.mesh_support import ControlPlaneThread, start_plane_and_envoy, write_topology
from tests.support import ServerProcess, Traffic, classifier_request, start_server, wait_for

pytestmark = pytest.mark.integration
SLA_P99_MS = 50.0
INTERACTIVE = (("x-sla-class", "interactive"),)
BATCH = (("x-sla-class", "batch"),)


@pytest.fixture(scope="module")
def mesh(
    demo_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, ServerProcess, ControlPlaneThread, Envoy, int]]:
    workdir = tmp_path_factory.mktemp("sla")
    otlp, listener = free_port(), free_port()
    with contextlib.ExitStack() as stops:
        servers = []
        for i, labels in ((1, ("--label", "reserved_for=interactive")), (2, ())):
            server = start_server(
                demo_repo, workdir / f"s{i}", "--models", "classifier",
                "--otlp-endpoint", f"127.0.0.1:{otlp}", "--telemetry-interval", "0.2", *labels,
            )  # fmt: skip
            stops.callback(server.stop)
            servers.append(server)
        classes = {
            "interactive": {"timeout_s": 2, "per_try_timeout_s": 1, "max_retries": 2},
            "batch": {"timeout_s": 30, "max_retries": 0},
        }
        topology = write_topology(
            workdir / "t.yaml", listener, [s.url for s in servers],
            sla_p99_ms=SLA_P99_MS, sla_classes=classes,
        )  # fmt: skip
        plane, envoy = start_plane_and_envoy(stops, workdir, topology, listener, 2, otlp)
        yield servers[0], servers[1], plane, envoy, listener


def successes(server: ServerProcess) -> int:
    stats = server.client().get_inference_statistics("classifier").model_stats
    return sum(m.inference_stats.success.count for m in stats)


def p(latencies: list[tuple[float, float]], q: float) -> float:
    values = sorted(seconds * 1000 for _, seconds in latencies)
    return values[min(len(values) - 1, int(q * len(values)))]


def test_reserved_endpoint_serves_only_interactive_and_keeps_its_sla_under_batch_load(
    mesh: tuple[ServerProcess, ServerProcess, ControlPlaneThread, Envoy, int],
) -> None:
    reserved, shared, plane, envoy, listener = mesh
    lane = sla_cluster("classifier", "interactive")
    reserved_at = EndpointAddress("127.0.0.1", reserved.port)

    def lanes_in_place() -> bool:
        state = plane.plane.mesh_state
        if state is None:
            return False
        interactive = {(a.address, a.priority) for a in state.clusters.get(lane, ())}
        default = {a.address for a in state.clusters.get(model_cluster("classifier"), ())}
        return (reserved_at, 0) in interactive and reserved_at not in default

    wait_for(lanes_in_place, 30, "the reported reserved_for label applied to the lanes")
    wait_for(
        lambda: (
            f"{model_cluster('classifier')}::127.0.0.1:{reserved.port}::"
            not in envoy.admin("/clusters")
        ),
        10,
        "Envoy's default cluster without the reserved server",
    )
    before = successes(reserved), successes(shared)
    url = f"127.0.0.1:{listener}"
    with (
        Traffic(url, clients=8, batch=16, metadata=BATCH, deadline_s=60) as batch,
        Traffic(url, clients=1, metadata=INTERACTIVE, deadline_s=60) as interactive,
    ):
        batch.wait_ok(20)
        interactive.wait_ok(300, timeout=45)
    after = successes(reserved), successes(shared)
    served_reserved, served_shared = after[0] - before[0], after[1] - before[1]
    i50, i99 = p(interactive.latencies, 0.5), p(interactive.latencies, 0.99)
    b50, b99 = p(batch.latencies, 0.5), p(batch.latencies, 0.99)
    print(
        f"\ninteractive: {interactive.ok} OK, p50 {i50:.1f} ms, p99 {i99:.1f} ms (SLA "
        f"{SLA_P99_MS:g} ms); batch x16: {batch.ok} OK, p50 {b50:.1f} ms, p99 {b99:.1f} ms; "
        f"reserved server {served_reserved} requests, shared {served_shared}"
    )
    assert not interactive.errors and not batch.errors, (interactive.errors, batch.errors)
    # Every request the reserved server served was interactive, and it served them all.
    assert served_reserved == interactive.ok, (served_reserved, interactive.ok)
    assert served_shared == batch.ok, (served_shared, batch.ok)
    # Batch queues on the shared server while interactive requests do not wait behind it.
    assert i99 < SLA_P99_MS, (i99, b50)
    assert statistics.median([i50, i99]) < b50, (i50, i99, b50)


def test_an_unknown_class_is_refused_naming_the_known_ones(
    mesh: tuple[ServerProcess, ServerProcess, ControlPlaneThread, Envoy, int],
) -> None:
    listener = mesh[4]
    images = np.zeros((1, 3, 32, 32), dtype=np.float32)
    with grpc.insecure_channel(f"127.0.0.1:{listener}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.ModelInfer(
                classifier_request(images), timeout=5, metadata=(("x-sla-class", "urgent"),)
            )
    error = raised.value
    assert isinstance(error, grpc.Call)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "x-sla-class" in (error.details() or "")
    assert all(name in (error.details() or "") for name in ("interactive", "batch"))


def test_interactive_spills_to_the_shared_pool_when_its_reserved_server_is_gone(
    mesh: tuple[ServerProcess, ServerProcess, ControlPlaneThread, Envoy, int],
) -> None:
    reserved, shared, _, _, listener = mesh
    reserved.stop()
    before = successes(shared)
    with Traffic(f"127.0.0.1:{listener}", clients=1, metadata=INTERACTIVE) as interactive:
        interactive.wait_ok(50)
    print(f"\nafter the reserved server stopped: {interactive.errors[:3]}")
    assert successes(shared) - before >= 50
    # At most the requests in flight when it went (each retried on the shared server).
    assert not interactive.errors, interactive.errors[:5]
