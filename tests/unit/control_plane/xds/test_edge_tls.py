"""TLS on the public listener (``listener.tls``, control_plane.xds.edge_tls): the certificate from
files, served to Envoy over SDS; gRPC over TLS and HTTPS with h2 by ALPN; a plaintext client
gets nothing; a renewed certificate is served on new connections with no restart; a bad file
is refused naming it. Real Envoy, real model servers, real TLS clients."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import socket
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from cryptography import x509
from tritonclient.utils import InferenceServerException

from control_plane.config.topology import TopologyError, parse_topology
from control_plane.xds import edge_tls
from infermesh import pki
from tests import edge_mesh_support
from tests.envoy_support import Envoy
from tests.mesh_support import ControlPlaneThread
from tests.support import wait_for


def _edge_files(pki_dir: Path) -> tuple[Path, Path]:
    who = pki.edge("localhost")
    return pki_dir / f"{who.file_stem}.crt", pki_dir / f"{who.file_stem}.key"


def test_a_listener_certificate_is_checked_when_the_topology_is_read(tmp_path: Path) -> None:
    authority = pki.init_authority(tmp_path)
    files = pki.issue(authority, pki.edge("localhost"), tmp_path)
    models = [{"name": "classifier", "sla_p99_ms": 50, "capacity_qps": 100}]

    def parse(cert: Path, key: Path) -> list[str]:
        tls = {"cert_file": str(cert), "key_file": str(key)}
        try:
            parse_topology({"listener": {"tls": tls}, "models": models})
        except TopologyError as exc:
            return list(exc.errors)
        return []

    assert parse(files.cert, files.key) == []
    other = pki.issue(authority, pki.edge("example.com"), tmp_path)
    assert (
        f"{other.key}: this key does not belong to {files.cert}" in parse(files.cert, other.key)[0]
    )
    assert "private key file not found" in parse(files.cert, tmp_path / "none.key")[0]
    old = pki.issue(authority, pki.edge("old"), tmp_path, start=pki._now() - dt.timedelta(days=2))
    assert f"{old.cert}: expired" in parse(old.cert, old.key)[0]
    listener = parse_topology(
        {"listener": {"tls": {"cert_file": str(files.cert), "key_file": str(files.key)}},
         "models": models}
    ).listener  # fmt: skip
    assert listener.tls is not None and "PRIVATE" not in repr(listener.tls)
    assert set(listener.tls.names) == {"localhost", "127.0.0.1", "::1"}


def test_the_expiry_warning_waits_for_a_late_renewal(tmp_path: Path) -> None:
    """A fresh 24 h certificate (the mesh CA's edge certificate, renewed with a third left) is
    not warned about; one with under a quarter of its life left is, and a long-lived public
    one is a week before it expires."""
    authority = pki.init_authority(tmp_path)
    files = pki.issue(authority, pki.edge("localhost"), tmp_path)
    tls = {"cert_file": str(files.cert), "key_file": str(files.key)}
    models = [{"name": "classifier", "sla_p99_ms": 50, "capacity_qps": 100}]
    edge = parse_topology({"listener": {"tls": tls}, "models": models}).listener.tls
    assert edge is not None and edge.not_after - edge.not_before == pytest.approx(86400, abs=600)
    assert edge_tls.warnings(edge) == []  # at start: 24 h left
    assert edge_tls.warnings(edge, now=edge.not_after - 10 * 3600) == []  # due, not late
    (late,) = edge_tls.warnings(edge, now=edge.not_after - 5 * 3600)
    assert "expires in 5.0 h: renew it" in late
    public = dataclasses.replace(edge, not_before=edge.not_after - 90 * 86400)
    assert edge_tls.warnings(public, now=public.not_after - 8 * 86400) == []
    assert edge_tls.warnings(public, now=public.not_after - 6 * 86400)


@dataclass
class TlsEdge:
    pki_dir: Path
    authority: pki.Authority
    plane: ControlPlaneThread
    envoy: Envoy

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.envoy.port}"

    def context(self, alpn: list[str]) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.pki_dir / "ca.crt"))
        context.set_alpn_protocols(alpn)
        return context

    def handshake(self, alpn: list[str]) -> tuple[str | None, int]:
        """(the protocol the listener chose, the serial of the certificate it showed)."""
        raw = socket.create_connection(("127.0.0.1", self.envoy.port), timeout=10)
        with self.context(alpn).wrap_socket(raw, server_hostname="localhost") as tls:
            der = tls.getpeercert(binary_form=True)
            assert der is not None
            serial = x509.load_der_x509_certificate(der).serial_number
            return tls.selected_alpn_protocol(), serial


@pytest.fixture
def edge_mesh(demo_repo: Path, tmp_path: Path) -> Iterator[TlsEdge]:
    pki_dir = tmp_path / "pki"
    authority = pki.init_authority(pki_dir)
    pki.issue(authority, pki.edge("localhost"), pki_dir)
    cert, key = _edge_files(pki_dir)
    listener = {"tls": {"cert_file": str(cert), "key_file": str(key)}}
    with edge_mesh_support.edge_mesh(demo_repo, tmp_path, listener) as mesh:
        yield TlsEdge(pki_dir, authority, mesh.plane, mesh.envoy)


def _infer(client: grpcclient.InferenceServerClient) -> bool:
    tensor = grpcclient.InferInput("input", [1, 3, 32, 32], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, 3, 32, 32), dtype=np.float32))
    return bool(client.infer("classifier", [tensor]).as_numpy("probs").shape == (1, 10))


@pytest.mark.integration
def test_clients_reach_the_edge_over_tls_and_only_so(edge_mesh: TlsEdge) -> None:
    ca = str(edge_mesh.pki_dir / "ca.crt")
    secure = grpcclient.InferenceServerClient(edge_mesh.target, ssl=True, root_certificates=ca)
    wait_for(lambda: _infers(secure), 30, "inference over TLS through Envoy")
    # A plaintext client gets no answer from a TLS listener.
    with pytest.raises(InferenceServerException):
        _infer(grpcclient.InferenceServerClient(edge_mesh.target))
    # ALPN: h2 for gRPC clients, HTTP/1.1 for those that offer only it; HTTPS REST works.
    assert edge_mesh.handshake(["h2", "http/1.1"])[0] == "h2"
    assert edge_mesh.handshake(["http/1.1"])[0] == "http/1.1"
    url = f"https://localhost:{edge_mesh.envoy.port}/v2/health/ready"
    https = urllib.request.build_opener(
        urllib.request.HTTPSHandler(context=edge_mesh.context(["http/1.1"]))
    )

    def rest_ready() -> bool:
        try:
            with https.open(url, timeout=10) as response:
                return bool(response.status == 200)
        except urllib.error.HTTPError:  # 503 until Envoy's REST twin has a healthy host
            return False

    wait_for(rest_ready, 30, "HTTPS REST through the TLS listener")
    shown = edge_mesh.plane.admin_get("/status")["edge_tls"]
    assert shown["alpn"] == ["h2", "http/1.1"] and 23.9 < shown["hours_left"] <= 24.0
    assert "PRIVATE KEY" not in json.dumps(shown) and "PRIVATE KEY" not in edge_mesh.envoy.log()


@pytest.mark.integration
def test_a_renewed_certificate_is_served_without_a_restart(edge_mesh: TlsEdge) -> None:
    _, before = edge_mesh.handshake(["h2"])
    cert, _ = _edge_files(edge_mesh.pki_dir)
    assert before == pki.read_certificate(cert).serial_number
    ca = str(edge_mesh.pki_dir / "ca.crt")
    client = grpcclient.InferenceServerClient(edge_mesh.target, ssl=True, root_certificates=ca)
    wait_for(lambda: _infers(client), 30, "inference over TLS through Envoy")
    pid = edge_mesh.envoy.proc.pid
    renewed = pki.issue(edge_mesh.authority, pki.edge("localhost"), edge_mesh.pki_dir)
    serial = pki.read_certificate(renewed.cert).serial_number
    wait_for(lambda: edge_mesh.handshake(["h2"])[1] == serial, 20, "the renewed certificate")
    assert edge_mesh.envoy.proc.pid == pid and edge_mesh.envoy.proc.poll() is None
    assert _infer(client)  # the connection made before the renewal still serves


def _infers(client: grpcclient.InferenceServerClient) -> bool:
    try:
        return _infer(client)
    except InferenceServerException:
        return False
