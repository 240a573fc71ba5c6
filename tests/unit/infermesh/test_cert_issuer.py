"""Model-server certificates for the caller's own address (compose.private.yaml's scaled
servers): the issuer in-process on loopback, the requester against it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from infermesh import cert_issuer, pki
from tests.envoy_support import free_port


@pytest.fixture
def issuer(tmp_path: Path) -> Iterator[str]:
    pki.init_authority(tmp_path / "pki", "infermesh.local")
    listen = f"127.0.0.1:{free_port()}"
    server = cert_issuer.serve(tmp_path / "pki", listen, hours=24)
    try:
        yield f"http://{listen}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_caller_is_certified_for_its_own_address(issuer: str, tmp_path: Path) -> None:
    out = tmp_path / "server"
    address = cert_issuer.request_once(issuer, 8001, tmp_path / "pki" / "ca.crt", out)
    assert address == "127.0.0.1:8001"
    assert (out / "server.key").stat().st_mode & 0o777 == 0o600
    expected = pki.model_server(address).spiffe_id
    credentials = pki.load_credentials(
        out / "server.crt", out / "server.key", tmp_path / "pki" / "ca.crt", expect=expected
    )
    assert credentials.spiffe_id == "spiffe://infermesh.local/model-server/127.0.0.1/8001"


def post(url: str, body: bytes) -> tuple[int, str]:
    request = urllib.request.Request(url, data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read()).get("error", "")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["error"]


@pytest.mark.parametrize(
    ("path", "body", "status", "error"),
    [
        ("/v1/model-server?port=8001", b"not a csr", 400, "not a PEM CSR"),
        ("/v1/model-server?port=0", b"x", 400, "port: expected ?port=N"),
        ("/v1/model-server", b"x", 400, "port: expected ?port=N"),
        ("/v1/other?port=8001", b"x", 404, "expected /v1/model-server"),
    ],
)
def test_bad_requests_are_refused_by_name(
    issuer: str, path: str, body: bytes, status: int, error: str
) -> None:
    assert post(issuer + path, body)[0] == status
    assert error in post(issuer + path, body)[1]


def test_an_answer_from_another_ca_is_not_taken(issuer: str, tmp_path: Path) -> None:
    other = pki.init_authority(tmp_path / "other", "infermesh.local")
    assert other.trust_domain == "infermesh.local"
    with pytest.raises(pki.CertificateError, match="is not signed by"):
        cert_issuer.request_once(issuer, 8001, tmp_path / "other" / "ca.crt", tmp_path / "out")
    assert not (tmp_path / "out" / "server.crt").exists()


def test_a_request_for_a_key_it_does_not_hold_is_refused(tmp_path: Path) -> None:
    """The CSR's signature proves the sender holds the key it asks to be certified."""
    authority = pki.init_authority(tmp_path / "pki", "infermesh.local")
    _, request = pki.new_request()
    tampered = request.replace(request.splitlines()[3], request.splitlines()[3][::-1])
    with pytest.raises(pki.CertificateError):
        pki.sign_request(authority, pki.model_server("10.0.0.1:8001"), tampered)
