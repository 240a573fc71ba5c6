"""``infermesh certs keep`` (infermesh.cert_keeper): the local mesh's certificates made at the
first start, left alone while good, made again when unusable or due; the health check that
waits for them; and Envoy's start refusing unusable files, naming them."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from control_plane.xds.bootstrap import prepare_xds_tls
from infermesh import cert_keeper, pki, probe

ROOT = Path(__file__).resolve().parents[3]
MESH = ("model-server:127.0.0.1:8001", "envoy:envoy-1", "control-plane:control-plane",
        "operator:local")  # fmt: skip


def _serials(directory: Path) -> dict[str, int]:
    return {path.name: pki.read_certificate(path).serial_number for path in directory.glob("*.crt")}


def test_a_first_pass_makes_everything_and_a_second_changes_nothing(tmp_path: Path) -> None:
    directory = tmp_path / "pki"
    assert probe.main(["certs", str(directory)]) == 1  # nothing kept yet
    issued = cert_keeper.keep_once(directory, MESH, "infermesh.local", 24)
    assert issued[0] == "a new CA for infermesh.local"
    assert "spiffe://infermesh.local/model-server/127.0.0.1/8001" in issued
    assert len(issued) == 1 + len(MESH)
    assert cert_keeper.ready(directory) is None
    assert probe.main(["certs", str(directory)]) == 0
    before = _serials(directory)
    assert cert_keeper.keep_once(directory, MESH, "infermesh.local", 24) == []
    assert _serials(directory) == before


def test_unusable_or_due_certificates_are_made_again(tmp_path: Path) -> None:
    directory = tmp_path / "pki"
    cert_keeper.keep_once(directory, MESH, "infermesh.local", 24)
    ca = pki.load_authority(directory)
    before = _serials(directory)
    # The envoy's certificate expired, the operator's replaced by another identity's, and
    # the model server's past two thirds of its life.
    pki.issue(ca, pki.envoy("envoy-1"), directory, start=pki._now() - dt.timedelta(days=2))
    (directory / "operator_local.crt").write_bytes(
        pki.issue(ca, pki.operator("mallory"), directory).cert.read_bytes()
    )
    pki.issue(
        ca, pki.model_server("127.0.0.1:8001"), directory,
        start=pki._now() - dt.timedelta(hours=17),
    )  # fmt: skip
    problem = cert_keeper.ready(directory)
    assert problem is not None and "envoy_envoy-1.crt: expired" in problem
    issued = cert_keeper.keep_once(directory, MESH, "infermesh.local", 24)
    assert sorted(issued) == [
        "spiffe://infermesh.local/envoy/envoy-1",
        "spiffe://infermesh.local/model-server/127.0.0.1/8001",
        "spiffe://infermesh.local/operator/local",
    ]
    after = _serials(directory)
    assert after["control-plane_control-plane.crt"] == before["control-plane_control-plane.crt"]
    assert after["ca.crt"] == before["ca.crt"]
    assert cert_keeper.ready(directory) is None


def test_a_bad_workload_name_fails_the_start_naming_it(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "infermesh.cli", "certs", "keep", "envoy:e1",
         "model-server:no-port", "--dir", str(tmp_path / "p")],
        capture_output=True, text=True, cwd=ROOT, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert "model server address 'no-port': expected host:port" in done.stderr
    with pytest.raises(pki.CertificateError, match="expected KIND:NAME"):
        cert_keeper.parse_workload("envoy", "infermesh.local")


def test_envoys_start_names_a_missing_or_expired_certificate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the SDS directory, removed after
    directory = tmp_path / "pki"
    cert_keeper.keep_once(directory, MESH, "infermesh.local", 24)
    with pytest.raises(pki.CertificateError, match=r"envoy_envoy-2\.crt: certificate file not"):
        prepare_xds_tls(directory, "envoy-2")
    tls = prepare_xds_tls(directory, "envoy-1")
    assert tls.trust_domain == "infermesh.local" and tls.pki_dir == str(directory.resolve())
    sds = Path(tls.sds_dir) / "envoy_envoy-1.sds.json"
    assert str(directory.resolve() / "envoy_envoy-1.key") in sds.read_text()
    pki.issue(
        pki.load_authority(directory), pki.envoy("envoy-1"), directory,
        start=pki._now() - dt.timedelta(days=2),
    )  # fmt: skip
    with pytest.raises(pki.CertificateError, match=r"envoy_envoy-1\.crt: expired"):
        prepare_xds_tls(directory, "envoy-1")


def test_a_workload_may_name_more_hosts_it_is_reached_by() -> None:
    """compose.private.yaml's control planes are reached by their container names."""
    who = cert_keeper.parse_workload(
        "control-plane:control-plane=control-plane-1,control-plane-2,10.0.0.5", "infermesh.local"
    )
    assert who.spiffe_id == "spiffe://infermesh.local/control-plane/control-plane"
    assert {"control-plane-1", "control-plane-2", "localhost"} <= set(who.dns)
    assert {"10.0.0.5", "127.0.0.1"} <= set(who.ips)
    with pytest.raises(pki.CertificateError, match=r"KIND:NAME\[=HOST"):
        cert_keeper.parse_workload("control-plane:control-plane=", "infermesh.local")
