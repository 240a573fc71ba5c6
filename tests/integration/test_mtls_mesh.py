"""Mutual TLS from Envoy (and the control plane's probes) to real model servers, with Envoy's
certificate and the CA served over SDS on the ADS stream (control_plane.xds.upstream_tls).

Real certificates (infermesh.pki), real Envoy, real TLS model servers: traffic flows through
Envoy over mTLS; a process on a server's address with another server's valid certificate gets
no traffic (Envoy checks the certificate against that server's own name); every certificate
is renewed under load without a failed request and without a restart."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from prometheus_client import generate_latest

from control_plane.xds.bootstrap import XdsTls
from control_plane.xds.snapshot import CLUSTER_TYPE
from infermesh import pki
from tests.envoy_support import Envoy, free_port
from tests.mesh_support import ControlPlaneThread, start_plane_and_envoy, write_topology
from tests.support import ServerProcess, Traffic, metric_value, start_server, wait_for

pytestmark = pytest.mark.integration
NODE = "envoy-sotw"  # tests.mesh_support's Envoy node id


@dataclass
class TlsMesh:
    pki_dir: Path
    authority: pki.Authority
    repo: Path
    logs: Path
    addresses: list[str]  # the topology's endpoints: two servers run, the third is free
    servers: dict[str, ServerProcess]  # address -> server
    plane: ControlPlaneThread
    envoy: Envoy
    xds_tls: bool  # also: telemetry.tls, and Envoy's stat sink over mTLS


def start_tls_server(
    pki_dir: Path, repo: Path, logs: Path, address: str, identity: str | None = None
) -> ServerProcess:
    """A TLS server on ``address`` presenting the certificate of the server at ``identity``
    (its own by default; another's makes it a rogue, which then also claims that address)."""
    who = pki.model_server(identity or address)
    args = ["--port", address.rsplit(":", 1)[1],
            "--tls-cert", str(pki_dir / f"{who.file_stem}.crt"),
            "--tls-key", str(pki_dir / f"{who.file_stem}.key"),
            "--tls-ca", str(pki_dir / "ca.crt")]  # fmt: skip
    if identity is not None:
        args += ["--advertise-address", identity]
    return start_server(repo, logs, *args, wait_ready=False)


def _issue_all(authority: pki.Authority, directory: Path, addresses: list[str]) -> None:
    for who in (pki.envoy(NODE), pki.control_plane(), *map(pki.model_server, addresses)):
        pki.issue(authority, who, directory)


@pytest.fixture(params=[False, True], ids=["xds-plaintext", "xds-mtls"])
def tls_mesh(demo_repo: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[TlsMesh]:
    """The mesh with mTLS to the servers; xDS itself in plaintext (loopback) or over mTLS."""
    xds_tls = bool(request.param)
    pki_dir, logs = tmp_path / "pki", tmp_path / "logs"
    authority = pki.init_authority(pki_dir)
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    _issue_all(authority, pki_dir, addresses)
    repo = tmp_path / "repo"
    shutil.copytree(demo_repo / "classifier", repo / "classifier")
    with contextlib.ExitStack() as stops:
        servers = {}
        for address in addresses[:2]:
            servers[address] = start_tls_server(pki_dir, repo, logs, address)
            stops.callback(servers[address].stop)
        listener = free_port()
        # Slow to drop an unreachable endpoint (50 failed probes, 10 s), so Envoy's own
        # certificate check is what keeps a rogue out in the rogue test.
        top = {
            "listener": {"upstream_tls": {"pki_dir": str(pki_dir)}},
            "placement": {"poll_interval_s": 0.2, "timeout_s": 1.0, "unreachable_after": 50},
            "xds": {"host": "127.0.0.1", "port": 18000, "tls": xds_tls},
            "telemetry": {"tls": xds_tls},
        }
        topology = write_topology(tmp_path / "topology.yaml", listener, addresses, top=top)
        envoy_tls = XdsTls(str(pki_dir), authority.trust_domain) if xds_tls else None
        plane, envoy = start_plane_and_envoy(
            stops, tmp_path, topology, listener, healthy=6, envoy_stats=xds_tls, xds_tls=envoy_tls
        )
        yield TlsMesh(pki_dir, authority, repo, logs, addresses, servers, plane, envoy, xds_tls)


def _served(server: ServerProcess) -> float:
    return metric_value(server.metrics(), "inference_requests_total", code="OK")


def _envoy_serials(envoy: Envoy) -> set[int]:
    """Serial numbers of the certificates Envoy holds (its identity and the CA). Envoy writes
    them in hex with the certificate's leading zeros: compared as numbers."""
    found = set()
    for entry in json.loads(envoy.admin("/certs"))["certificates"]:
        for cert in entry.get("cert_chain", []) + entry.get("ca_cert", []):
            found.add(int(cert["serial_number"], 16))
    return found


def _serial(path: Path) -> int:
    return int(pki.read_certificate(path).serial_number)


def _counter_sum(envoy: Envoy, pattern: str) -> int:
    text = envoy.admin(f"/stats?filter={pattern}")
    return sum(int(line.rsplit(":", 1)[1]) for line in text.splitlines() if ":" in line)


def test_traffic_flows_over_mutual_tls(tls_mesh: TlsMesh) -> None:
    with Traffic(f"127.0.0.1:{tls_mesh.envoy.port}", clients=2) as traffic:
        traffic.wait_ok(40)
        # Both servers, over mTLS (a server that joined later ramps up from a tenth of its
        # weight, so it may take more than 40 calls to be picked).
        wait_for(
            lambda: all(_served(s) > 0 for s in tls_mesh.servers.values()),
            30,
            "both servers to serve through Envoy",
        )
    assert not traffic.errors, traffic.errors[:3]
    envoy_cert = tls_mesh.pki_dir / f"envoy_{NODE}.crt"
    assert _serial(envoy_cert) in _envoy_serials(tls_mesh.envoy)  # it came over SDS
    assert _counter_sum(tls_mesh.envoy, r"model_classifier\.ssl\.handshake$") > 0
    status = tls_mesh.plane.admin_get("/status")
    identities = [i["identity"] for i in status["upstream_tls"]["identities"]]
    assert f"spiffe://infermesh.local/envoy/{NODE}" in identities
    assert "PRIVATE KEY" not in json.dumps(status) and "PRIVATE KEY" not in tls_mesh.envoy.log()
    metrics = generate_latest(tls_mesh.plane.plane.metrics.registry).decode()
    series = (
        f'certificate_expiry_timestamp_seconds{{identity="spiffe://infermesh.local/envoy/{NODE}"}}'
    )
    assert series in metrics
    if tls_mesh.xds_tls:  # Envoy's stats reach the control plane over mTLS, as its own node
        wait_for(
            lambda: tls_mesh.plane.admin_get("/telemetry")["envoy"]["nodes"] == [NODE],
            15,
            "Envoy's stats over mutual TLS",
        )
        assert "telemetry_reports_rejected_total{" not in metrics


def test_a_process_with_another_servers_certificate_gets_no_traffic(tls_mesh: TlsMesh) -> None:
    """The first server dies and a process takes its address with a valid mesh certificate,
    the second server's: Envoy refuses it (the certificate does not name that address) and
    the traffic goes on to the second server."""
    first, second = tls_mesh.addresses[:2]
    tls_mesh.servers[first].stop()
    rogue = start_tls_server(tls_mesh.pki_dir, tls_mesh.repo, tls_mesh.logs, first, identity=second)
    try:
        wait_for(lambda: _listening(rogue), 30, "the rogue to listen")
        refused = r"model_classifier\.ssl\.fail_verify_san$"
        wait_for(lambda: _counter_sum(tls_mesh.envoy, refused) > 0, 15, "Envoy's SAN refusal")
        with Traffic(f"127.0.0.1:{tls_mesh.envoy.port}", clients=2) as traffic:
            traffic.wait_ok(40)
        assert _served(rogue) == 0
        assert _served(tls_mesh.servers[second]) >= 40
    finally:
        rogue.stop()


def _reloaded(server: ServerProcess) -> Callable[[], bool]:
    return lambda: "certificate reloaded" in server.log()


def _listening(server: ServerProcess) -> bool:
    try:
        server.metrics()
    except OSError:
        return False
    return True


def test_every_certificate_is_renewed_under_load_without_a_failure(tls_mesh: TlsMesh) -> None:
    envoy_cert = tls_mesh.pki_dir / f"envoy_{NODE}.crt"
    with Traffic(f"127.0.0.1:{tls_mesh.envoy.port}", clients=2) as traffic:
        traffic.wait_ok(20)
        _issue_all(tls_mesh.authority, tls_mesh.pki_dir, tls_mesh.addresses)
        new_serial = _serial(envoy_cert)
        wait_for(
            lambda: new_serial in _envoy_serials(tls_mesh.envoy),
            30,
            "Envoy to hold its renewed certificate (SDS)",
        )
        for server in tls_mesh.servers.values():
            wait_for(_reloaded(server), 30, "a server's reload")
        traffic.wait_ok(40)
    assert not traffic.errors, traffic.errors[:3]


def test_a_plaintext_member_serves_and_is_flagged(tls_mesh: TlsMesh) -> None:
    """A member marked ``tls: false`` (a Triton server without TLS, say) gets plaintext from
    Envoy and the probes while the others keep mTLS, and /status flags it."""
    plain = start_server(tls_mesh.repo, tls_mesh.logs)
    try:
        path = Path(tls_mesh.plane.plane.settings.topology)
        data = yaml.safe_load(path.read_text())
        data["endpoints"].append({"address": plain.url, "tls": False})
        path.write_text(yaml.safe_dump(data))
        with Traffic(f"127.0.0.1:{tls_mesh.envoy.port}", clients=2) as traffic:
            wait_for(lambda: _served(plain) > 0, 40, "the plaintext member to serve")
            traffic.wait_ok(20)
        assert not traffic.errors, traffic.errors[:3]
        assert all(_served(s) > 0 for s in tls_mesh.servers.values())
        status = tls_mesh.plane.admin_get("/status")
        assert status["upstream_tls"]["plaintext_members"] == [plain.url]
        assert any(f"endpoint {plain.url} is a plaintext member" in w for w in status["warnings"])
    finally:
        plain.stop()


def _ads_call(tls_mesh: TlsMesh, who: pki.Workload | None, node_id: str) -> grpc.StatusCode:
    """One ADS stream to the control plane as ``who`` (None: no client certificate), sending
    ``node_id``: OK once it is answered, else the refusal's code."""
    target = f"127.0.0.1:{tls_mesh.plane.plane.xds_port}"
    ca = (tls_mesh.pki_dir / "ca.crt").read_bytes()
    if who is None:
        credentials = grpc.ssl_channel_credentials(ca)
    else:
        key, cert = (tls_mesh.pki_dir / f"{who.file_stem}.{x}" for x in ("key", "crt"))
        credentials = grpc.ssl_channel_credentials(ca, key.read_bytes(), cert.read_bytes())
    first = discovery_pb2.DiscoveryRequest(
        node=base_pb2.Node(id=node_id, cluster="infermesh"), type_url=CLUSTER_TYPE
    )
    with grpc.secure_channel(target, credentials) as channel:
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
        try:
            next(iter(stub.StreamAggregatedResources(iter([first]), timeout=10)))
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_xds_serves_only_a_proven_envoy_its_own_node(tls_mesh: TlsMesh) -> None:
    if not tls_mesh.plane.plane.topology.xds_tls:
        pytest.skip("xDS over mTLS only")
    envoy = pki.envoy(NODE)
    assert _ads_call(tls_mesh, envoy, NODE) == grpc.StatusCode.OK
    assert _ads_call(tls_mesh, envoy, "envoy-other") == grpc.StatusCode.PERMISSION_DENIED
    assert _ads_call(tls_mesh, pki.control_plane(), NODE) == grpc.StatusCode.PERMISSION_DENIED
    assert _ads_call(tls_mesh, None, NODE) == grpc.StatusCode.UNAVAILABLE
    # A new Envoy's certificate, issued while the mesh runs, is served with no reload asked.
    pki.issue(tls_mesh.authority, pki.envoy("envoy-new"), tls_mesh.pki_dir)

    def served() -> list[str]:
        return [i["identity"] for i in tls_mesh.plane.admin_get("/status")["upstream_tls"]
                ["identities"]]  # fmt: skip

    wait_for(lambda: "spiffe://infermesh.local/envoy/envoy-new" in served(), 15, "envoy-new")
    assert _ads_call(tls_mesh, pki.envoy("envoy-new"), "envoy-new") == grpc.StatusCode.OK
    plain = grpc.insecure_channel(f"127.0.0.1:{tls_mesh.plane.plane.xds_port}")
    with plain:
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(plain)
        with pytest.raises(grpc.RpcError) as caught:
            request = discovery_pb2.DiscoveryRequest(node=base_pb2.Node(id=NODE))
            next(iter(stub.StreamAggregatedResources(iter([request]), timeout=10)))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
