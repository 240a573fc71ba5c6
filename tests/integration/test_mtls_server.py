"""Mutual TLS on a real model server (``--tls-cert/--tls-key/--tls-ca``): real certificates
from infermesh.pki, stock tritonclient over TLS, raw ``ssl`` for REST. Plaintext and foreign
clients are refused at the handshake; mesh identities get only their API groups; renewed
files are taken into use without a restart; unusable files stop the start-up."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from cryptography import x509
from tritonclient.utils import InferenceServerException

from infermesh import pki, probe
from tests.envoy_support import free_port
from tests.support import EXPLICIT, ROOT, ServerProcess, metric_value, start_server, wait_for

pytestmark = pytest.mark.integration
HEADER = "infermesh-operator-key"
SECRET = "s3cr3t-operator-credential-0123456789"


@dataclass(frozen=True)
class Mesh:
    directory: Path
    authority: pki.Authority
    server_address: str
    http_port: int

    @property
    def ca(self) -> Path:
        return self.directory / "ca.crt"

    def files(self, who: pki.Workload) -> pki.IssuedFiles:
        return pki.IssuedFiles(
            self.directory / f"{who.file_stem}.crt", self.directory / f"{who.file_stem}.key"
        )


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Mesh:
    directory = tmp_path_factory.mktemp("pki")
    authority = pki.init_authority(directory)
    address = f"127.0.0.1:{free_port()}"
    for who in (
        pki.model_server(address),
        pki.envoy("envoy-1"),
        pki.operator("alice"),
        pki.control_plane(),
    ):
        pki.issue(authority, who, directory)
    foreign = pki.init_authority(directory / "foreign")
    pki.issue(foreign, pki.envoy("envoy-1"), directory / "foreign")
    return Mesh(directory, authority, address, free_port())


@pytest.fixture(scope="module")
def server(
    mesh: Mesh, demo_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    repo = tmp_path_factory.mktemp("repo")
    shutil.copytree(demo_repo / "classifier", repo / "classifier")
    key_file = tmp_path_factory.mktemp("secrets") / "operator.key"
    key_file.write_text(SECRET)
    files = mesh.files(pki.model_server(mesh.server_address))
    proc = start_server(
        repo, tmp_path_factory.mktemp("logs"), *EXPLICIT,
        "--port", mesh.server_address.rsplit(":", 1)[1], "--http-port", str(mesh.http_port),
        "--restricted-api", f"model-repository:{HEADER}=@{key_file}",
        "--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(mesh.ca),
        wait_ready=False,
    )  # fmt: skip
    try:
        client = _client(mesh, pki.envoy("envoy-1"))
        wait_for(lambda: _ready(client), 60, f"the TLS server to be ready:\n{proc.log()}")
        yield proc
    finally:
        proc.stop()


def _ready(client: grpcclient.InferenceServerClient) -> bool:
    try:
        return bool(client.is_model_ready("classifier"))
    except InferenceServerException:
        return False


def _client(
    mesh: Mesh, who: pki.Workload, directory: Path | None = None
) -> grpcclient.InferenceServerClient:
    """Stock tritonclient over mutual TLS, as ``who``."""
    base = directory or mesh.directory
    return grpcclient.InferenceServerClient(
        mesh.server_address,
        ssl=True,
        root_certificates=str(mesh.ca),
        private_key=str(base / f"{who.file_stem}.key"),
        certificate_chain=str(base / f"{who.file_stem}.crt"),
    )


def _infer(client: grpcclient.InferenceServerClient) -> np.ndarray:
    tensor = grpcclient.InferInput("input", [1, 3, 32, 32], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, 3, 32, 32), np.float32))
    result = client.infer("classifier", [tensor], client_timeout=10)
    output = result.as_numpy("probs")
    assert output is not None
    return output


def _context(mesh: Mesh, who: pki.Workload | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(mesh.ca))
    if who is not None:
        files = mesh.files(who)
        context.load_cert_chain(str(files.cert), str(files.key))
    return context


def _rest(
    mesh: Mesh, who: pki.Workload | None, path: str, body: dict[str, Any] | None = None
) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"https://127.0.0.1:{mesh.http_port}{path}", data=data)
    try:
        with urllib.request.urlopen(request, timeout=10, context=_context(mesh, who)) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


INFER_BODY = {
    "inputs": [{"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": [0] * 3072}]
}


def test_envoy_identity_infers_over_grpc_and_rest(mesh: Mesh, server: ServerProcess) -> None:
    envoy = pki.envoy("envoy-1")
    assert _infer(_client(mesh, envoy)).shape[0] == 1
    status, answer = _rest(mesh, envoy, "/v2/models/classifier/infer", INFER_BODY)
    assert status == 200, answer
    assert answer["outputs"][0]["name"] == "probs"


def test_plaintext_and_certificate_less_clients_are_refused(
    mesh: Mesh, server: ServerProcess
) -> None:
    plain = grpcclient.InferenceServerClient(mesh.server_address)
    with pytest.raises(InferenceServerException):
        plain.is_server_live(client_timeout=5)
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(f"http://127.0.0.1:{mesh.http_port}/v2/health/live", timeout=5)
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        _rest(mesh, None, "/v2/health/live")  # TLS, but no client certificate
    _infer(_client(mesh, pki.envoy("envoy-1")))  # and the server still serves


def test_a_certificate_from_another_ca_is_refused(mesh: Mesh, server: ServerProcess) -> None:
    foreign = _client(mesh, pki.envoy("envoy-1"), mesh.directory / "foreign")
    with pytest.raises(InferenceServerException):
        foreign.is_server_live(client_timeout=5)
    context = ssl.create_default_context(cafile=str(mesh.ca))
    context.load_cert_chain(
        str(mesh.directory / "foreign" / "envoy_envoy-1.crt"),
        str(mesh.directory / "foreign" / "envoy_envoy-1.key"),
    )
    url = f"https://127.0.0.1:{mesh.http_port}/v2/health/live"
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(url, timeout=5, context=context)


def test_each_identity_gets_only_its_api_groups(mesh: Mesh, server: ServerProcess) -> None:
    operator, envoy, plane = pki.operator("alice"), pki.envoy("envoy-1"), pki.control_plane()
    with pytest.raises(InferenceServerException) as caught:
        _infer(_client(mesh, operator))
    assert "PERMISSION_DENIED" in str(caught.value.status())
    assert "operator/alice may not call the inference API" in caught.value.message()
    with pytest.raises(InferenceServerException) as caught:
        _client(mesh, envoy).get_model_repository_index()
    assert "may not call the model-repository API" in caught.value.message()
    # An operator certificate satisfies --restricted-api; the control plane still needs the
    # header (it is not an operator), and with it may list the repository.
    assert _client(mesh, operator).get_model_repository_index().models
    with pytest.raises(InferenceServerException, match=HEADER):
        _client(mesh, plane).get_model_repository_index()
    index = _client(mesh, plane).get_model_repository_index(headers={HEADER: SECRET})
    assert {m.name for m in index.models} == {"classifier"}
    # REST: the same table, as 403 with a JSON error naming the identity and the group.
    status, answer = _rest(mesh, operator, "/v2/models/classifier/infer", INFER_BODY)
    assert status == 403 and "may not call the inference API" in answer["error"]
    status, answer = _rest(mesh, envoy, "/v2/repository/index", {})
    assert status == 403 and "model-repository" in answer["error"]
    assert _rest(mesh, plane, "/v2/health/ready")[0] == 200


def test_a_server_probes_its_own_health_with_its_own_certificate(
    mesh: Mesh, server: ServerProcess
) -> None:
    """compose.private.yaml's health check: the server's own certificate, so no server
    container holds an operator's (which may load and unload models on every server)."""
    own = mesh.files(pki.model_server(mesh.server_address))
    files = (str(own.cert), str(own.key), str(mesh.ca))
    assert probe.main(["grpc", mesh.server_address, *files]) == 0
    server_itself = _client(mesh, pki.model_server(mesh.server_address))
    with pytest.raises(InferenceServerException, match="may not call the metadata API"):
        server_itself.get_server_metadata()
    with pytest.raises(InferenceServerException, match="may not call the model-repository API"):
        server_itself.get_model_repository_index(headers={HEADER: SECRET})


def _served_serial(mesh: Mesh) -> int:
    """The serial number of the certificate the REST port presents to a new connection."""
    context = _context(mesh, pki.envoy("envoy-1"))
    with (
        socket.create_connection(("127.0.0.1", mesh.http_port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def test_renewed_certificates_are_taken_into_use_without_a_restart(
    mesh: Mesh, server: ServerProcess
) -> None:
    who = pki.model_server(mesh.server_address)
    before = _served_serial(mesh)
    renewed = pki.issue(mesh.authority, who, mesh.directory)
    serial = pki.read_certificate(renewed.cert).serial_number
    wait_for(lambda: _served_serial(mesh) == serial, 15, "the renewed certificate on REST")
    _infer(_client(mesh, pki.envoy("envoy-1")))  # a new gRPC channel: a new handshake
    assert serial != before
    # A broken renewal (the key of another workload) is refused and counted; the last good
    # certificate stays in use.
    failures = metric_value(server.metrics(), "certificate_reload_failures_total")
    renewed.key.write_bytes(mesh.files(pki.envoy("envoy-1")).key.read_bytes())
    wait_for(
        lambda: metric_value(server.metrics(), "certificate_reload_failures_total") > failures,
        15,
        "the failed reload to be counted",
    )
    assert _served_serial(mesh) == serial
    _infer(_client(mesh, pki.envoy("envoy-1")))
    assert "certificate reload failed, keeping the current one" in server.log()
    assert "BEGIN" not in server.log()
    pki.issue(mesh.authority, who, mesh.directory)  # leave a good pair for other tests


def _start_refused(
    mesh: Mesh, demo_repo: Path, files: pki.IssuedFiles, port: str, *more: str
) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "model_server", "--model-repository", str(demo_repo),
         "--port", port, "--metrics-port", "-1", "--http-port", "-1",
         "--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(mesh.ca),
         *more],
        capture_output=True, text=True, cwd=ROOT, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    return done.stderr


def test_unusable_certificates_stop_the_start_up(
    mesh: Mesh, demo_repo: Path, tmp_path: Path
) -> None:
    port = str(free_port())
    who = pki.model_server(f"127.0.0.1:{port}")
    expired = pki.issue(mesh.authority, who, tmp_path, start=pki._now().replace(year=2020))
    message = _start_refused(mesh, demo_repo, expired, port)
    assert f"{expired.cert}: expired at 2020-" in message
    other = pki.issue(mesh.authority, pki.model_server("127.0.0.1:1"), tmp_path)
    message = _start_refused(mesh, demo_repo, other, port)
    expected = f"is for spiffe://infermesh.local/model-server/127.0.0.1/1, expected {who.spiffe_id}"
    assert f"{other.cert}: {expected}" in message
    fresh = pki.issue(mesh.authority, who, tmp_path)
    assert "not 0" in _start_refused(mesh, demo_repo, fresh, "0")
    assert "BEGIN" not in message
    # --tls-pod (Kubernetes): the certificate must name that pod, not the address.
    pod = pki.model_server_pod("infermesh", "ms-1")
    message = _start_refused(mesh, demo_repo, fresh, port, "--tls-pod", "infermesh/ms-1")
    assert f"{fresh.cert}: is for {who.spiffe_id}, expected {pod.spiffe_id}" in message
