"""listener.upstream_tls (control_plane.xds.upstream_tls): what the topology accepts and refuses,
and the resources Envoy gets: TLS clusters with SNI and SAN checks, EDS hostnames, the CA
for every node and each node's identity for that node alone. Real certificates; no Envoy
here (tests/integration/test_mtls_mesh.py runs one)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from envoy.extensions.transport_sockets.tls.v3 import secret_pb2, tls_pb2

from control_plane.config.topology import TopologyError, parse_topology
from control_plane.model.mesh import (
    EndpointAddress,
    EndpointAssignment,
    MeshState,
    ServerPods,
    model_cluster,
)
from control_plane.telemetry.identity import plaintext_warnings
from control_plane.xds import upstream_tls
from control_plane.xds.resources import build_resources
from control_plane.xds.snapshot import CLUSTER_TYPE, ENDPOINT_TYPE, SECRET_TYPE, Snapshot
from control_plane.xds.upstream_tls import CA_SECRET, IDENTITY_SECRET, node_secrets
from infermesh import pki


@pytest.fixture
def pki_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "pki"
    authority = pki.init_authority(directory)
    for who in (pki.envoy("envoy-1"), pki.envoy("envoy-2"), pki.control_plane()):
        pki.issue(authority, who, directory)
    return directory


def _topology(pki_dir: Path, **more: Any) -> dict[str, Any]:
    return {
        "listener": {"upstream_tls": {"pki_dir": str(pki_dir)}},
        "models": [{"name": "classifier", "sla_p99_ms": 50, "capacity_qps": 1000}],
        **more,
    }


def _errors(data: dict[str, Any]) -> list[str]:
    with pytest.raises(TopologyError) as info:
        parse_topology(data, "t.yaml")
    return list(info.value.errors)


def test_the_pki_directory_is_read_and_keys_stay_out_of_reprs(pki_dir: Path) -> None:
    tls = parse_topology(_topology(pki_dir)).listener.upstream_tls
    assert tls is not None and tls.trust_domain == "infermesh.local"
    assert [e.name for e in tls.envoys] == ["envoy-1", "envoy-2"]
    assert tls.control_plane is not None and tls.control_plane.name == "control-plane"
    assert "PRIVATE" not in repr(tls) and b"PRIVATE KEY" in tls.envoys[0].key_pem


def test_unusable_files_are_topology_errors_naming_them(pki_dir: Path) -> None:
    (pki_dir / "envoy_envoy-2.key").write_bytes((pki_dir / "envoy_envoy-1.key").read_bytes())
    (errors,) = _errors(_topology(pki_dir))
    assert "listener.upstream_tls.pki_dir:" in errors and "envoy_envoy-2.key" in errors
    assert "does not belong to" in errors and "BEGIN" not in errors
    (errors,) = _errors(_topology(pki_dir / "nowhere"))
    assert "ca.crt: certificate file not found" in errors


def test_keys_are_served_off_loopback_only_over_mutual_tls(pki_dir: Path) -> None:
    (error,) = _errors(_topology(pki_dir, xds={"host": "0.0.0.0", "port": 18000}))
    assert "with xds.host 0.0.0.0 (not loopback) set xds.tls: true" in error
    secured = parse_topology(_topology(pki_dir, xds={"host": "0.0.0.0", "tls": True}))
    assert secured.xds_tls and secured.xds.host == "0.0.0.0"
    needs = {"models": _topology(pki_dir)["models"], "xds": {"tls": True}}
    assert "xds.tls: needs listener.upstream_tls" in _errors(needs)[0]


def _state(pki_dir: Path) -> MeshState:
    listener = parse_topology(_topology(pki_dir)).listener
    members = (EndpointAssignment(EndpointAddress("127.0.0.1", 8001)),)
    return MeshState(listener, (), {model_cluster("classifier"): members})


def test_clusters_check_each_servers_own_name(pki_dir: Path) -> None:
    state = _state(pki_dir)
    built: Any = build_resources(state)
    cluster = built[CLUSTER_TYPE][model_cluster("classifier")]
    context = tls_pb2.UpstreamTlsContext()
    assert cluster.transport_socket.typed_config.Unpack(context)
    assert context.auto_host_sni and context.auto_sni_san_validation
    common = context.common_tls_context
    assert [s.name for s in common.tls_certificate_sds_secret_configs] == [IDENTITY_SECRET]
    assert common.validation_context_sds_secret_config.name == CA_SECRET
    assert list(common.alpn_protocols) == ["h2"]
    (entry,) = built[ENDPOINT_TYPE][model_cluster("classifier")].endpoints[0].lb_endpoints
    assert entry.endpoint.hostname == "p8001.127.0.0.1.model-server.infermesh.local"
    assert entry.endpoint.hostname in pki.model_server("127.0.0.1:8001").dns


def test_a_discovered_pod_is_checked_by_its_pods_name(pki_dir: Path) -> None:
    """On Kubernetes the certificate names the pod (cert-manager cannot name a pod IP): the
    EDS entry of an address discovery put a pod at carries the pod's name; the others
    keep their address's."""
    state = _state(pki_dir)
    tls = state.listener.upstream_tls
    assert tls is not None
    pods = ServerPods({"127.0.0.1:8001": "infermesh/model-server-7d9f-x2x"})
    listener = dataclasses.replace(state.listener, upstream_tls=dataclasses.replace(tls, pods=pods))
    members = (*state.clusters[model_cluster("classifier")],
               EndpointAssignment(EndpointAddress("127.0.0.1", 8002)))  # fmt: skip
    built: Any = build_resources(MeshState(listener, (), {model_cluster("classifier"): members}))
    entries = built[ENDPOINT_TYPE][model_cluster("classifier")].endpoints[0].lb_endpoints
    names = [e.endpoint.hostname for e in entries]
    who = pki.model_server_pod("infermesh", "model-server-7d9f-x2x")
    assert names == [
        "model-server-7d9f-x2x.infermesh.pod.model-server.infermesh.local",
        "p8002.127.0.0.1.model-server.infermesh.local",
    ]
    assert names[0] in who.dns
    assert (
        who.spiffe_id == "spiffe://infermesh.local/model-server/pod/infermesh/model-server-7d9f-x2x"
    )
    assert pki.parse_spiffe_id(who.spiffe_id) == dataclasses.replace(who, dns=())


def test_server_pods_match_a_servers_own_ipv6_form() -> None:
    pods = ServerPods({"fd00::1:8001": "ns/pod"})
    assert pods.get("[fd00::1]:8001") == pods.get("fd00::1:8001") == "ns/pod"
    assert pods.get("[fd00::1]:8002") == "" and not ServerPods()


def test_each_node_gets_its_own_identity_and_the_shared_ca(pki_dir: Path) -> None:
    state = _state(pki_dir)
    snapshot = Snapshot.build(build_resources(state), node_secrets(state.listener.upstream_tls))

    def identity_of(node: str) -> bytes:
        secret = secret_pb2.Secret()
        assert snapshot.of(SECRET_TYPE, node).items[IDENTITY_SECRET].packed.Unpack(secret)
        return bytes(secret.tls_certificate.certificate_chain.inline_bytes)

    assert identity_of("envoy-1") == (pki_dir / "envoy_envoy-1.crt").read_bytes()
    assert identity_of("envoy-2") == (pki_dir / "envoy_envoy-2.crt").read_bytes()
    assert set(snapshot.of(SECRET_TYPE, "stranger").items) == {CA_SECRET}  # no one else's key
    assert snapshot.of(SECRET_TYPE, "envoy-1").version != snapshot.of(SECRET_TYPE, "x").version
    # A renewed identity is a new snapshot version (so it is pushed).
    renewed_dir = pki_dir
    authority = pki.load_authority(renewed_dir)
    pki.issue(authority, pki.envoy("envoy-2"), renewed_dir)
    again = _state(pki_dir)
    later = Snapshot.build(build_resources(again), node_secrets(again.listener.upstream_tls))
    assert later.versions()["SDS"] != snapshot.versions()["SDS"]
    assert later.versions()["CDS"] == snapshot.versions()["CDS"]


def test_status_lists_each_identity_and_warns_when_renewal_is_overdue(pki_dir: Path) -> None:
    tls = parse_topology(_topology(pki_dir)).listener.upstream_tls
    assert tls is not None
    shown = upstream_tls.status(tls)
    assert shown is not None and shown["trust_domain"] == "infermesh.local"
    names = [i["identity"] for i in shown["identities"]]
    assert names == [
        "spiffe://infermesh.local/envoy/envoy-1",
        "spiffe://infermesh.local/envoy/envoy-2",
        "spiffe://infermesh.local/control-plane/control-plane",
    ]
    assert all(23.9 < i["hours_left"] <= 24.0 for i in shown["identities"])
    assert "PRIVATE" not in str(shown)
    assert upstream_tls.warnings(tls) == []  # fresh: nothing to say
    expiry = tls.envoys[0].not_after
    late = upstream_tls.warnings(tls, now=expiry - 3600)  # an hour left on every one
    assert len(late) == 3 and "envoy/envoy-1 expires in 1.0 h" in late[0]
    assert f"infermesh certs rotate --dir {pki_dir}" in late[0]
    assert upstream_tls.status(None) is None and upstream_tls.warnings(None) == []


def test_telemetry_tls_needs_the_pki_and_is_refused_where_not_built_yet(pki_dir: Path) -> None:
    needs = {"models": _topology(pki_dir)["models"], "telemetry": {"tls": True}}
    assert "telemetry.tls: needs listener.upstream_tls" in _errors(needs)[0]
    sharded = _topology(pki_dir, telemetry={"tls": True, "shards": 2})
    assert parse_topology(sharded).telemetry.shards == 2  # each shard reads the certificates
    model_checks = _topology(pki_dir, telemetry={"tls": True})
    model_checks["listener"]["health_checks"] = "model"
    assert "needs xds.tls too" in _errors(model_checks)[0]
    model_checks["xds"] = {"tls": True}
    assert parse_topology(model_checks).listener.health_checks == "model"
    assert parse_topology(_topology(pki_dir, telemetry={"tls": True})).telemetry.tls


def test_plaintext_telemetry_is_taken_on_loopback_only_unless_a_topology_says_otherwise(
    pki_dir: Path,
) -> None:
    models = _topology(pki_dir)["models"]
    (error,) = _errors({"models": models, "telemetry": {"host": "0.0.0.0"}})
    assert "telemetry.host 0.0.0.0: plaintext telemetry is taken on loopback only" in error
    anyway = parse_topology(
        {"models": models, "telemetry": {"host": "0.0.0.0", "insecure_plaintext": True}}
    )
    (warning,) = plaintext_warnings(anyway.telemetry)
    assert "0.0.0.0:14317 is plaintext and taken from the network" in warning
    (local,) = plaintext_warnings(parse_topology({"models": models}).telemetry)
    assert "127.0.0.1:14317 is plaintext (development: loopback only)" in local
    both = _topology(pki_dir, telemetry={"tls": True, "insecure_plaintext": True})
    assert "contradict" in _errors(both)[0]
    secured = _topology(pki_dir, telemetry={"tls": True, "host": "0.0.0.0"})
    assert plaintext_warnings(parse_topology(secured).telemetry) == []


def test_a_plaintext_member_is_marked_and_flagged_and_the_rest_stay_checked(
    pki_dir: Path,
) -> None:
    endpoints = [{"address": "127.0.0.1:8001"},
                 {"address": "127.0.0.1:8101", "kind": "triton", "tls": False}]  # fmt: skip
    topology = parse_topology(_topology(pki_dir, endpoints=endpoints))
    tls = topology.listener.upstream_tls
    assert tls is not None and tls.plaintext == frozenset({"127.0.0.1:8101"})
    members = tuple(EndpointAssignment(EndpointAddress("127.0.0.1", p)) for p in (8001, 8101))
    built: Any = build_resources(
        MeshState(topology.listener, (), {model_cluster("classifier"): members})
    )
    cluster = built[CLUSTER_TYPE][model_cluster("classifier")]
    (match,) = cluster.transport_socket_matches
    assert match.transport_socket.name == "envoy.transport_sockets.raw_buffer"
    assert dict(match.match) == {"infermesh_plaintext": True}
    checked, plain = built[ENDPOINT_TYPE][model_cluster("classifier")].endpoints[0].lb_endpoints
    assert checked.endpoint.hostname == "p8001.127.0.0.1.model-server.infermesh.local"
    assert not checked.metadata.filter_metadata
    assert plain.endpoint.hostname == ""
    meta = plain.metadata.filter_metadata["envoy.transport_socket_match"]
    assert dict(meta) == {"infermesh_plaintext": True}
    shown = upstream_tls.status(tls)
    assert shown is not None and shown["plaintext_members"] == ["127.0.0.1:8101"]
    (warning,) = upstream_tls.warnings(tls)
    assert "endpoint 127.0.0.1:8101 is a plaintext member (tls: false)" in warning
    # Without upstream_tls every member is plaintext: "tls: false" would mean nothing.
    bare = {"models": _topology(pki_dir)["models"], "endpoints": endpoints}
    assert "only means something with listener.upstream_tls" in _errors(bare)[0]


def test_a_shards_watch_takes_renewals_and_keeps_the_last_good(
    pki_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(upstream_tls.PkiWatch, "CHECK_EVERY_S", 0.0)
    watch = upstream_tls.PkiWatch(str(pki_dir), "control-plane")
    first = watch.current()
    assert first is not None and first.control_plane is not None
    authority = pki.load_authority(pki_dir)
    renewed = pki.issue(authority, pki.control_plane(), pki_dir)
    watch.refresh()
    now = watch.current()
    assert now is not None and now.control_plane is not None
    assert now.control_plane.cert_pem == renewed.cert.read_bytes() != first.control_plane.cert_pem
    renewed.key.write_bytes(pki.issue(authority, pki.envoy("x"), pki_dir).key.read_bytes())
    watch.refresh()  # a key that does not match: logged, the last good kept
    assert watch.current() is now
    with pytest.raises(pki.CertificateError, match="certificate file not found"):
        upstream_tls.PkiWatch(str(pki_dir / "nowhere"), "control-plane")
