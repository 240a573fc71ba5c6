"""The whole path for real: tritonclient -> Envoy -> model servers, driven over xDS by the
control plane (state-of-the-world and delta), with placement, overrides, NACKs and restarts."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from envoy.config.cluster.v3 import cluster_pb2

from control_plane.model.mesh import model_cluster
from control_plane.xds.resources import build_resources
from control_plane.xds.snapshot import CLUSTER_TYPE, build_snapshot
from tests.envoy_support import Envoy, free_port
from tests.mesh_support import ControlPlaneThread, start_ads_envoy, write_topology
from tests.support import ServerProcess, Traffic, start_server, wait_for

pytestmark = pytest.mark.integration


@dataclass
class Mesh:
    servers: list[ServerProcess]
    plane: ControlPlaneThread
    envoy: Envoy | None
    topology: Path
    listener_port: int

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.listener_port}"

    def admin(self, path: str) -> str:
        assert self.envoy is not None
        return self.envoy.admin(path)

    def client(self) -> grpcclient.InferenceServerClient:
        return grpcclient.InferenceServerClient(self.url)

    def served(self) -> list[int]:
        """Inferences each server has answered so far (from its own statistics)."""
        counts = []
        for server in self.servers:
            stats = server.client().get_inference_statistics("classifier").model_stats
            counts.append(sum(s.inference_count for s in stats))
        return counts


@pytest.fixture(scope="module", params=["sotw", "delta"])
def mesh(
    request: pytest.FixtureRequest, demo_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    workdir = tmp_path_factory.mktemp(f"mesh-{request.param}")
    servers = [start_server(demo_repo, workdir / f"s{i}", "--models", "classifier") for i in (1, 2)]
    listener_port = free_port()
    topology = write_topology(workdir / "topology.yaml", listener_port, [s.url for s in servers])
    the_mesh = Mesh(servers, ControlPlaneThread(topology), None, topology, listener_port)
    try:
        xds_port = the_mesh.plane.plane.xds_port
        the_mesh.envoy = start_ads_envoy(
            workdir, xds_port, listener_port, request.param == "delta",
            otlp_port=the_mesh.plane.plane.otlp_port,
        )  # fmt: skip
        yield the_mesh
    finally:
        # Each stop runs even if one before it fails: no process may outlive the tests.
        with contextlib.ExitStack() as stops:
            for server in servers:
                stops.callback(server.stop)
            stops.callback(the_mesh.plane.stop)  # the current one: a test may restart it
            if the_mesh.envoy is not None:
                stops.callback(the_mesh.envoy.stop)


def images(batch: int = 1) -> np.ndarray:
    return np.random.default_rng(3).random((batch, 3, 32, 32), dtype=np.float32)


def infer(client: grpcclient.InferenceServerClient, **kwargs: object) -> grpcclient.InferResult:
    tensor = grpcclient.InferInput("input", [1, 3, 32, 32], "FP32")
    tensor.set_data_from_numpy(images())
    return client.infer("classifier", [tensor], **kwargs)


def wait_endpoints(mesh: Mesh, cluster: str, count: int) -> None:
    def ready() -> bool:
        text = mesh.admin("/clusters")
        healthy = [
            line for line in text.splitlines()
            if line.startswith(f"{cluster}::") and line.endswith("::health_flags::healthy")
        ]  # fmt: skip
        return len(healthy) == count

    wait_for(ready, 20, f"{count} healthy endpoints in {cluster}")


def test_infer_through_envoy_with_and_without_the_header(mesh: Mesh) -> None:
    wait_endpoints(mesh, model_cluster("classifier"), 2)
    client = mesh.client()
    direct = infer(mesh.servers[0].client()).as_numpy("probs")
    np.testing.assert_array_equal(infer(client).as_numpy("probs"), direct)
    with_header = infer(client, headers={"x-model-name": "classifier"})
    np.testing.assert_array_equal(with_header.as_numpy("probs"), direct)
    pinned = infer(client, headers={"x-model-name": "classifier", "x-model-version": "1"})
    assert pinned.get_response().model_version == "1"
    assert client.is_server_ready()
    status = mesh.plane.admin_get("/status")
    node = status["nodes"][0]
    assert node["connected"] and node["mode"] == ("delta" if "delta" in node["node_id"] else "sotw")
    for kind in ("CDS", "EDS", "LDS", "RDS"):
        assert node["types"][kind]["acked_version"], kind


def test_weights_split_traffic_nine_to_one(mesh: Mesh) -> None:
    wait_endpoints(mesh, model_cluster("classifier"), 2)
    first, second = (s.url for s in mesh.servers)
    try:
        mesh.plane.admin_post(f"/endpoints/{first}", {"weight": 9})
        mesh.plane.admin_post(f"/endpoints/{second}", {"weight": 1})
        cluster = model_cluster("classifier")
        wanted = (f"{cluster}::{first}::weight::9", f"{cluster}::{second}::weight::1")
        # Both: the two posts may reach Envoy in two pushes.
        wait_for(lambda: all(w in mesh.admin("/clusters") for w in wanted), 10, "weights 9 and 1")
        before = mesh.served()
        client = mesh.client()
        for _ in range(400):
            infer(client)
        after = mesh.served()
        share = (after[0] - before[0]) / 400
        assert 0.84 <= share <= 0.96, f"first server took {share:.2%}"
    finally:
        for server in mesh.servers:
            mesh.plane.admin_post(f"/endpoints/{server.url}", {"weight": None})


def test_draining_endpoint_gets_no_new_requests(mesh: Mesh) -> None:
    wait_endpoints(mesh, model_cluster("classifier"), 2)
    drained = mesh.servers[1].url
    try:
        mesh.plane.admin_post(f"/endpoints/{drained}", {"health": "DRAINING"})
        wait_for(
            lambda: f"{drained}::health_flags::/eds_status_draining" in mesh.admin("/clusters"),
            10,
            "DRAINING applied",
        )
        before = mesh.served()
        client = mesh.client()
        for _ in range(100):
            infer(client)
        after = mesh.served()
        assert after[1] == before[1] and after[0] == before[0] + 100
    finally:
        mesh.plane.admin_post(f"/endpoints/{drained}", {"health": None})


def test_nack_keeps_traffic_flowing_and_shows_in_status(mesh: Mesh) -> None:
    plane = mesh.plane.plane

    async def set_invalid() -> None:
        assert plane.mesh_state is not None
        resources = build_resources(plane.mesh_state)
        broken = cluster_pb2.Cluster()
        broken.CopyFrom(resources[CLUSTER_TYPE][model_cluster("classifier")])
        broken.connect_timeout.seconds = -1  # Envoy's validation rejects it
        resources[CLUSTER_TYPE][model_cluster("classifier")] = broken
        plane.cache.set_snapshot(build_snapshot(resources))

    with Traffic(mesh.url, clients=2) as traffic:
        traffic.wait_ok(20)
        mesh.plane.call(set_invalid())

        def nacked() -> bool:
            node = mesh.plane.admin_get("/status")["nodes"][0]
            return bool(node["types"]["CDS"]["last_nack"])

        wait_for(nacked, 10, "a NACK in status")
        traffic.wait_ok(50)
        assert (
            "Expected positive duration"
            in mesh.plane.admin_get("/status")["nodes"][0]["types"]["CDS"]["last_nack"]["error"]
        )
        metrics = mesh.plane.admin_get("/metrics")
        assert 'xds_nacks_total{type="CDS"}' in metrics
        mesh.plane.call(_rebuild(plane))  # a good snapshot again: accepted
        wait_for(
            lambda: mesh.plane.admin_get("/status")["nodes"][0]["types"]["CDS"]["in_sync"],
            10,
            "CDS back in sync",
        )
        traffic.wait_ok(20)
    assert traffic.errors == []


async def _rebuild(plane: object) -> None:
    plane.cache._snapshots.clear()  # type: ignore[attr-defined]
    plane.rebuild("test: restore")  # type: ignore[attr-defined]


def test_control_plane_restart_loses_no_request(mesh: Mesh) -> None:
    wait_endpoints(mesh, model_cluster("classifier"), 2)
    xds_port, otlp_port = mesh.plane.plane.xds_port, mesh.plane.plane.otlp_port
    with Traffic(mesh.url, clients=4) as traffic:
        traffic.wait_ok(50)
        mesh.plane.stop()
        traffic.wait_ok(100)  # Envoy serves on its last config while the plane is away
        mesh.plane = ControlPlaneThread(mesh.topology, xds_port=xds_port, otlp_port=otlp_port)

        def resynced() -> bool:
            nodes = mesh.plane.admin_get("/status")["nodes"]
            return (
                bool(nodes)
                and nodes[0]["connected"]
                and nodes[0]["types"].get("EDS", {}).get("acked_version", "") != ""
            )

        wait_for(resynced, 30, "Envoy resynced with the new control plane")
        traffic.wait_ok(50)
    assert traffic.errors == []


def test_topology_reload_adds_a_server_that_takes_traffic(
    mesh: Mesh, demo_repo: Path, tmp_path: Path
) -> None:
    third = start_server(demo_repo, tmp_path, "--models", "classifier")
    try:
        mesh.servers.append(third)
        write_topology(mesh.topology, mesh.listener_port, [s.url for s in mesh.servers])
        wait_endpoints(mesh, model_cluster("classifier"), 3)
        before = mesh.served()[2]
        client = mesh.client()
        for _ in range(60):
            infer(client)
        assert mesh.served()[2] > before
    finally:
        mesh.servers.remove(third)
        write_topology(mesh.topology, mesh.listener_port, [s.url for s in mesh.servers])
        wait_endpoints(mesh, model_cluster("classifier"), 2)
        third.stop()


def test_envoy_stats_arrive_through_its_opentelemetry_sink(mesh: Mesh) -> None:
    """Envoy's per-endpoint view reaches the control plane's /telemetry over OTLP."""
    wait_endpoints(mesh, model_cluster("classifier"), 2)
    client = mesh.client()
    servers = {s.url for s in mesh.servers}

    def both_seen_with_traffic() -> bool:
        infer(client)
        seen = mesh.plane.admin_get("/telemetry")["envoy"]["endpoints"]
        return all(seen.get(url, {}).get("requests_per_s", 0) > 0 for url in servers)

    wait_for(both_seen_with_traffic, 15, "Envoy's per-endpoint request rates", interval=0.05)
    envoy = mesh.plane.admin_get("/telemetry")["envoy"]
    assert envoy["last_report_age_s"] < 3
    assert all(envoy["endpoints"][url]["healthy"] for url in servers)


def test_version_split_changes_at_run_time_through_the_cli(mesh: Mesh) -> None:
    """`infermesh split` moves header-less traffic between versions through RDS."""
    wait_endpoints(mesh, model_cluster("classifier"), 2)
    client = mesh.client()
    admin = f"127.0.0.1:{mesh.plane.plane.admin_port}"

    def split(*pairs: str) -> None:
        out = subprocess.run(
            [sys.executable, "-m", "infermesh.cli", "split", "classifier", *pairs,
             "--admin", admin],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr

    def versions(n: int) -> set[str]:
        return {infer(client).get_response().model_version for _ in range(n)}

    try:
        split("1=100", "2=0")
        wait_for(lambda: versions(20) == {"1"}, 10, "every request on version 1")
        split("1=0", "2=100")
        wait_for(lambda: versions(20) == {"2"}, 10, "every request on version 2")
        split("1=50", "2=50")
        wait_for(lambda: versions(40) == {"1", "2"}, 10, "both versions")
        assert mesh.plane.admin_get("/status")["version_splits"]["classifier"] == {
            "1": 50, "2": 50,
        }  # fmt: skip
        bad = subprocess.run(
            [sys.executable, "-m", "infermesh.cli", "split", "classifier", "1=0", "--admin", admin],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert bad.returncode == 1 and "must not all be 0" in bad.stderr
        decisions = mesh.plane.admin_get("/decisions")["decisions"]
        assert any("version split v1=50 v2=50" in d["decision"] for d in decisions)
    finally:
        split()  # back to the topology's: no split
    wait_for(lambda: versions(10) == {"2"}, 10, "the newest version again")
