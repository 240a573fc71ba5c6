"""Telemetry bound to identity (``telemetry.tls``, control_plane.telemetry.identity): a real control
plane and a real TLS model server exporting to it. The server's own reports arrive; a report in
another server's name, sent with a valid mesh certificate, is refused with PERMISSION_DENIED
and counted; a plaintext client cannot connect; an operator certificate may not report."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from infermesh import pki
from tests.envoy_support import free_port
from tests.mesh_support import ControlPlaneThread, write_topology
from tests.otlp_support import Telemetry
from tests.support import start_server, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(params=[0, 2], ids=["in-process", "2-shards"])
def telemetry(
    demo_repo: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Telemetry]:
    """The receiver in the control plane's process, or in shard processes that read the
    certificates themselves."""
    pki_dir = tmp_path / "pki"
    authority = pki.init_authority(pki_dir)
    address, other = (f"127.0.0.1:{free_port()}" for _ in range(2))
    for who in (
        pki.envoy("envoy-sotw"), pki.control_plane(), pki.operator("alice"),
        pki.model_server(address), pki.model_server(other),
    ):  # fmt: skip
        pki.issue(authority, who, pki_dir)
    otlp = free_port()
    top = {
        "listener": {"upstream_tls": {"pki_dir": str(pki_dir)}},
        "telemetry": {"port": otlp, "tls": True, "shards": request.param},
    }
    topology = write_topology(tmp_path / "t.yaml", free_port(), [address], top=top)
    with contextlib.ExitStack() as stops:
        plane = ControlPlaneThread(topology)
        stops.callback(plane.stop)
        files = pki.model_server(address).file_stem
        server = start_server(
            demo_repo, tmp_path / "logs", "--port", address.rsplit(":", 1)[1],
            "--tls-cert", str(pki_dir / f"{files}.crt"), "--tls-key", str(pki_dir / f"{files}.key"),
            "--tls-ca", str(pki_dir / "ca.crt"),
            "--otlp-endpoint", f"127.0.0.1:{plane.plane.otlp_port}", "--telemetry-interval", "0.2",
            wait_ready=False,
        )  # fmt: skip
        stops.callback(server.stop)
        yield Telemetry(pki_dir, plane, server, other)


def test_reports_are_taken_only_from_the_server_they_are_for(telemetry: Telemetry) -> None:
    address = telemetry.server.url
    wait_for(
        lambda: address in telemetry.plane.admin_get("/telemetry")["endpoints"],
        30,
        "the server's own reports over mutual TLS",
    )
    assert telemetry.draining(address) in (0, 0.0, None)
    # Another server's valid certificate, claiming this server: refused, counted, logged.
    forger = pki.model_server(telemetry.other)
    assert telemetry.export(forger, address) == grpc.StatusCode.PERMISSION_DENIED
    # (a shard's count reaches the control plane with its next push)
    wait_for(lambda: telemetry.rejected("other_identity") == 1, 10, "the refusal counted")
    # Its own name is fine (the certificate names it).
    assert telemetry.export(forger, telemetry.other) == grpc.StatusCode.OK
    # An operator may not report at all; a plaintext client cannot even connect.
    assert telemetry.export(pki.operator("alice"), address) == grpc.StatusCode.PERMISSION_DENIED
    wait_for(lambda: telemetry.rejected("kind") == 1, 10, "the refusal counted")
    assert telemetry.export(None, address) == grpc.StatusCode.UNAVAILABLE
    # None of it reached the store: the server is still not draining.
    assert telemetry.draining(address) in (0, 0.0, None)
