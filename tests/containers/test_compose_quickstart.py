"""compose.yaml, the host-network quick start, in real containers: `docker compose up` of
the InferMesh services from nothing (the credentials and certificates made in its
mesh-state volume), inference through Envoy. Prometheus and the observability profile are
left out: their images come from a registry this host cannot reach."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from tests.container_support import SERVERS, PrivateMesh
from tests.envoy_support import free_port
from tests.support import ROOT

pytestmark = pytest.mark.containers
# Fixed in compose.yaml and deploy/topology.yaml: the servers' gRPC, metrics and REST ports.
FIXED_PORTS = [p + offset for p in (8001, 8002, 8003) for offset in (0, 1000, 2000)]
MOVABLE = ("ENVOY", "ENVOY_ADMIN", "XDS", "ADMIN", "OTLP", "XDS2", "ADMIN2", "OTLP2")
INFERMESH = ("mesh-certs", *SERVERS, "control-plane-1", "control-plane-2", "envoy")


def busy(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def quickstart(mesh_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateMesh]:
    taken = [port for port in FIXED_PORTS if busy(port)]
    if taken:  # a mesh of `make run` is up: its ports are compose.yaml's
        pytest.skip(f"compose.yaml's fixed ports {taken} are in use on this host")
    ports = {f"INFERMESH_{name}_PORT": str(free_port()) for name in MOVABLE}
    mesh = PrivateMesh(
        tmp_path_factory.mktemp("quickstart"),
        compose_file=ROOT / "compose.yaml",
        services=INFERMESH,
        environment=ports,
    )
    mesh.envoy_port = int(ports["INFERMESH_ENVOY_PORT"])
    with mesh:
        print(f"\ncompose.yaml up in containers (Envoy healthy) in {mesh.up_s:.1f} s")
        yield mesh


def test_the_quick_start_serves_in_containers(quickstart: PrivateMesh) -> None:
    with quickstart.traffic(clients=4, deadline_s=60) as traffic:
        traffic.wait_ok(200)
    assert not traffic.errors, traffic.errors[:5]
    for service in INFERMESH:
        assert quickstart.inspect(service)["Config"]["User"] == "10001", service
    print(f"\ncompose.yaml in containers: {traffic.ok} OK, {len(traffic.errors)} failed")
