"""The mesh CA and workload certificates (infermesh.pki, ``infermesh certs``): real X.509
made with ``cryptography``, checked the way a starting process checks its files."""

from __future__ import annotations

import datetime as dt
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509

from infermesh import certs, pki

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def authority(tmp_path: Path) -> pki.Authority:
    return pki.init_authority(tmp_path / "pki")


def _load(files: pki.IssuedFiles, ca: Path, expect: str | None = None) -> pki.Credentials:
    return pki.load_credentials(files.cert, files.key, ca, expect)


def test_a_workload_certificate_names_its_identity_and_addresses(
    authority: pki.Authority, tmp_path: Path
) -> None:
    who = pki.model_server("127.0.0.1:8001")
    files = pki.issue(authority, who, tmp_path / "pki")
    creds = _load(files, tmp_path / "pki" / "ca.crt", who.spiffe_id)
    assert creds.spiffe_id == "spiffe://infermesh.local/model-server/127.0.0.1/8001"
    cert = x509.load_pem_x509_certificate(creds.cert_pem)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    lifetime = creds.not_after - creds.not_before
    assert dt.timedelta(hours=24) <= lifetime <= dt.timedelta(hours=24, minutes=6)
    assert stat.S_IMODE(os.stat(files.key).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "pki" / "ca.key").st_mode) == 0o600
    assert "PRIVATE" not in repr(creds) and "model-server" in repr(creds)


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (lambda f, a, d: f.cert.unlink(), "certificate file not found"),
        (lambda f, a, d: f.cert.write_text("junk"), "not a PEM certificate"),
        (lambda f, a, d: f.key.write_bytes(b"-----BEGIN PRIVATE KEY-----\n"), "not an unencrypted"),
        (
            lambda f, a, d: f.key.write_bytes(pki.issue(a, pki.envoy("x"), d).key.read_bytes()),
            "does not belong to",
        ),
        (
            lambda f, a, d: pki.issue(
                a, pki.model_server("127.0.0.1:8001"), d, start=pki._now() - dt.timedelta(days=2)
            ),
            "expired at",
        ),
        (
            lambda f, a, d: pki.issue(
                pki.init_authority(d / "other-ca"), pki.model_server("127.0.0.1:8001"), d
            ),
            "not signed by the mesh CA",
        ),
    ],
    ids=["missing", "not-pem", "bad-key", "key-of-another", "expired", "other-ca"],
)
def test_unusable_files_are_refused_naming_the_file_and_the_problem(
    authority: pki.Authority, tmp_path: Path, break_it: object, message: str
) -> None:
    directory = tmp_path / "pki"
    files = pki.issue(authority, pki.model_server("127.0.0.1:8001"), directory)
    break_it(files, authority, directory)  # type: ignore[operator]
    with pytest.raises(pki.CertificateError) as caught:
        _load(files, directory / "ca.crt")
    assert message in str(caught.value)
    assert str(directory) in str(caught.value)
    assert "BEGIN" not in str(caught.value)  # never key material


def test_a_certificate_for_another_identity_is_refused(
    authority: pki.Authority, tmp_path: Path
) -> None:
    files = pki.issue(authority, pki.model_server("127.0.0.1:8002"), tmp_path / "pki")
    expect = pki.model_server("127.0.0.1:8001").spiffe_id
    with pytest.raises(pki.CertificateError, match=r"model-server/127\.0\.0\.1/8002, expected"):
        _load(files, tmp_path / "pki" / "ca.crt", expect)


@pytest.mark.parametrize(
    ("kind", "name", "message"),
    [
        ("robot", ("a",), "workload kind"),
        ("envoy", ("a:b",), "name segment"),
        ("envoy", ("..",), "name segment"),
    ],
)
def test_spiffe_ids_are_checked(kind: str, name: tuple[str, ...], message: str) -> None:
    with pytest.raises(pki.CertificateError, match=message):
        pki.workload(kind, name)
    with pytest.raises(pki.CertificateError, match="trust domain"):
        pki.workload("envoy", ("a",), "Bad Domain")


def test_parse_spiffe_id_round_trips_and_rejects_foreign_ids() -> None:
    who = pki.envoy("envoy-1")
    parsed = pki.parse_spiffe_id(who.spiffe_id)
    assert parsed is not None and parsed.kind == "envoy" and parsed.name == ("envoy-1",)
    assert pki.parse_spiffe_id("spiffe://infermesh.local/robot/x") is None
    assert pki.parse_spiffe_id("https://infermesh.local/envoy/x") is None


def test_init_refuses_to_replace_a_ca(tmp_path: Path) -> None:
    pki.init_authority(tmp_path)
    with pytest.raises(pki.CertificateError, match="already there"):
        pki.init_authority(tmp_path)


def test_rotate_renews_only_what_is_due_keeping_identities(
    authority: pki.Authority, tmp_path: Path
) -> None:
    directory = tmp_path / "pki"
    fresh = pki.issue(authority, pki.envoy("envoy-1"), directory)
    old_start = pki._now() - dt.timedelta(hours=20)  # past 2/3 of 24 h
    due = pki.issue(authority, pki.model_server("10.0.0.7:8001"), directory, start=old_start)
    fresh_serial = pki.read_certificate(fresh.cert).serial_number
    due_serial = pki.read_certificate(due.cert).serial_number
    assert certs.rotate(authority, directory, 24, force=False) == [
        "spiffe://infermesh.local/model-server/10.0.0.7/8001"
    ]
    assert pki.read_certificate(fresh.cert).serial_number == fresh_serial
    renewed = pki.read_certificate(due.cert)
    assert renewed.serial_number != due_serial
    san = renewed.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
    assert not pki.needs_renewal(due.cert)
    _load(due, directory / "ca.crt", pki.model_server("10.0.0.7:8001").spiffe_id)


def test_the_certs_command(tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "infermesh.cli", "certs", *args, "--dir", str(tmp_path)],
            capture_output=True, text=True, cwd=ROOT, timeout=60, check=False,
        )  # fmt: skip

    assert cli("issue", "envoy", "e1").returncode == 1  # no CA yet: named
    assert cli("init").returncode == 0
    done = cli("issue", "model-server", "127.0.0.1:8001")
    assert done.returncode == 0, done.stderr
    assert "spiffe://infermesh.local/model-server/127.0.0.1/8001" in done.stdout
    shown = cli("show").stdout
    assert "model-server_127.0.0.1_8001.crt: spiffe://" in shown and "24.0 h left" in shown
    assert "renewed 1" in cli("rotate", "--force").stdout
    plane = cli("issue", "control-plane", "cp-1", "--dns", "control-plane-1")
    assert plane.returncode == 0, plane.stderr
    cert = pki.read_certificate(tmp_path / "control-plane_cp-1.crt")
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "control-plane-1"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    bad = cli("issue", "model-server", "no-port")
    assert bad.returncode == 1 and "expected host:port" in bad.stderr


def test_a_pods_certificate_names_the_pod_and_is_checked_as_that_server(tmp_path: Path) -> None:
    """cert-manager's csi-driver knows a pod's name, not its IP: the model server started
    with --tls-pod checks its certificate names that pod."""
    authority = pki.init_authority(tmp_path)
    who = pki.model_server_pod("infermesh", "ms-7d9f")
    pki.issue(authority, who, tmp_path)
    assert pki.server_workload("10.1.2.3:8001", "infermesh/ms-7d9f") == who
    assert pki.server_name("10.1.2.3:8001", "infermesh/ms-7d9f") == who.dns[0]
    assert pki.server_name("10.1.2.3:8001") == pki.server_dns_name("10.1.2.3:8001")
    creds = pki.load_workload(tmp_path, who)
    assert pki.spiffe_id_of(x509.load_pem_x509_certificate(creds.cert_pem)) == who.spiffe_id
    with pytest.raises(pki.CertificateError, match="name segment"):
        pki.model_server_pod("infermesh", "a/b")
    for malformed in ("ms-7d9f", "infermesh/", "/ms-7d9f"):
        with pytest.raises(pki.CertificateError, match="expected NAMESPACE/POD"):
            pki.server_name("10.1.2.3:8001", malformed)
