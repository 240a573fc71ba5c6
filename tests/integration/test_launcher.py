"""``infermesh up`` runs compose.yaml for real: every service as a process, in order, healthy,
reachable through Envoy, and stopped in reverse order on SIGTERM."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from infermesh import pki
from infermesh.api_keys import client_headers
from infermesh.compose import ComposeError, interpolate, load_services, parse_duration
from infermesh.launcher import Launcher
from tests.scenarios.harness import ComposeMesh
from tests.support import wait_for

pytestmark = pytest.mark.integration


def test_interpolation_durations_and_cycles(tmp_path: Path) -> None:
    env = {"A": "1"}
    assert interpolate(["${A}", "${B:-2}", "${B-3}", "x${A}y"], env) == ["1", "2", "3", "x1y"]
    assert parse_duration("1m30s", "t") == 90 and parse_duration("250ms", "t") == 0.25
    with pytest.raises(ComposeError, match="not a duration"):
        parse_duration("soon", "t")
    cyclic = tmp_path / "compose.yaml"
    cyclic.write_text(
        "services:\n  a: {command: [x], depends_on: [b]}\n  b: {command: [y], depends_on: [a]}\n"
    )
    with pytest.raises(ComposeError, match="dependency cycle"):
        load_services(cyclic, env={})


def test_up_runs_the_compose_mesh_and_stops_it_in_order(demo_repo: Path, tmp_path: Path) -> None:
    # The real compose.yaml and topology, with every port moved to a free one.
    mesh = ComposeMesh(tmp_path, demo_repo)
    try:
        mesh.start()
        started = list(mesh.pids().items())
        assert [name for name, _ in started] == [
            "mesh-certs", "model-server-1", "model-server-2", "model-server-3", "control-plane-1",
            "control-plane-2", "envoy", "prometheus",
        ]  # fmt: skip
        # Edge TLS is on in compose: the mesh CA (mesh-certs keeps it) signs the edge's.
        ca = tmp_path / ".infermesh" / "pki" / "ca.crt"
        client = grpcclient.InferenceServerClient(
            f"127.0.0.1:{mesh.envoy_port}", ssl=True, root_certificates=str(ca)
        )
        tensor = grpcclient.InferInput("input", [1, 3, 32, 32], "FP32")
        tensor.set_data_from_numpy(np.zeros((1, 3, 32, 32), dtype=np.float32))
        headers = client_headers(tmp_path)  # the key `infermesh up` made
        assert headers, "infermesh up made no API key"
        with pytest.raises(InferenceServerException, match="UNAUTHENTICATED"):
            client.infer("classifier", [tensor])  # authentication is on in compose
        wait_for(lambda: _infers(client, tensor, headers), 30, "inference through Envoy")
        status = mesh.cli("status")
        assert "model:classifier" in status, status
        assert "routing classifier: version split none" in status, status
        # Every inner hop is mutual TLS: a plaintext client gets nothing from a model server;
        # the operator CLI, run in the mesh's directory, works over mTLS as the local operator;
        # Envoy's stats reach the control plane over mTLS as its own node.
        direct = grpcclient.InferenceServerClient(
            f"127.0.0.1:{mesh.server_ports['model-server-1']}"
        )
        with pytest.raises(InferenceServerException):
            direct.is_server_ready()
        index = subprocess.run(
            [sys.executable, "-m", "infermesh.cli", "models", "index", "--admin", mesh.admin],
            cwd=tmp_path, env=mesh.env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert index.stdout.count("classifier v1  READY") == 3, index.stdout + index.stderr
        wait_for(
            lambda: mesh.admin_get("/telemetry")["envoy"]["nodes"] == ["envoy-1"],
            15,
            "Envoy's stats over mTLS",
        )
        # Every certificate renewed under load (as mesh-certs does when they are due): no
        # failed call, no restart, and Envoy holds only the new certificate (for xDS over
        # file SDS and for the servers over ADS SDS, and the edge's over ADS SDS).
        pki_dir = tmp_path / ".infermesh" / "pki"
        old = pki.read_certificate(pki_dir / "envoy_envoy-1.crt").serial_number
        old_edge = pki.read_certificate(pki_dir / "edge_localhost.crt").serial_number
        pids = mesh.pids()
        with mesh.traffic(clients=2, deadline_s=60) as traffic:
            traffic.wait_ok(20)
            rotate = subprocess.run(
                [sys.executable, "-m", "infermesh.cli", "certs", "rotate", "--force",
                 "--dir", str(pki_dir)],
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            assert "renewed 7 certificate(s)" in rotate.stdout, rotate.stdout + rotate.stderr
            new = pki.read_certificate(pki_dir / "envoy_envoy-1.crt").serial_number
            edge = pki.read_certificate(pki_dir / "edge_localhost.crt").serial_number
            wait_for(
                lambda: _envoy_serials(mesh) == {new, edge}, 30, "Envoy's renewed certificates"
            )
            traffic.wait_ok(40)
        assert not traffic.errors, traffic.errors[:3]
        assert old != new and old_edge != edge and mesh.pids() == pids
        assert mesh.stop() == 0
        stopped = re.findall(r"infermesh: (\S+) stopped \(exit (\S+)\)", mesh.log.read_text())
        order = ["prometheus", "envoy", "control-plane-2", "control-plane-1", "model-server-3",
                 "model-server-2", "model-server-1", "mesh-certs"]  # fmt: skip
        assert stopped == [(name, "0") for name in order]
        for _, pid in started:
            assert not Path(f"/proc/{pid}").exists() or _zombie(pid)
    finally:
        mesh.stop()


def _infers(
    client: grpcclient.InferenceServerClient,
    tensor: grpcclient.InferInput,
    headers: dict[str, str],
) -> bool:
    try:
        result = client.infer("classifier", [tensor], headers=headers)
        return bool(result.as_numpy("probs").shape == (1, 10))
    except Exception:
        return False


def _envoy_serials(mesh: ComposeMesh) -> set[int]:
    """The serial numbers of Envoy's own certificates (not the CA's) in its admin /certs."""
    url = f"http://127.0.0.1:{mesh.env['INFERMESH_ENVOY_ADMIN_PORT']}/certs"
    with urllib.request.urlopen(url, timeout=5) as response:
        entries = json.loads(response.read())["certificates"]
    return {int(c["serial_number"], 16) for e in entries for c in e.get("cert_chain", [])}


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_restart_policies(tmp_path: Path) -> None:
    compose = tmp_path / "compose.yaml"
    compose.write_text(
        "services:\n  a: {command: [x], restart: on-failure}\n  b: {command: [y]}\n"
        "  c: {command: [z], restart: unless-stopped}\n"
    )
    a, b, c = load_services(compose, env={})
    assert (a.restarts_after(1), a.restarts_after(0)) == (True, False)
    assert not b.restarts_after(137)  # the default: no
    assert c.restarts_after(0) and c.restarts_after(-9)
    compose.write_text("services:\n  a: {command: [x], restart: sometimes}\n")
    with pytest.raises(ComposeError, match="restart: expected one of"):
        load_services(compose, env={})


def test_one_service_exiting_leaves_the_others_running_and_a_crash_loop_slows_down(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Before, a service that exited for good (restart: no), or whose restart failed, ended
    `infermesh up` and stopped every other service; and a service that kept crashing was
    restarted at once, forever. Now it is like docker compose: the others keep running, and
    quick failures back off (1 s, 2 s, ...)."""
    python = sys.executable
    compose = tmp_path / "compose.yaml"
    compose.write_text(
        "services:\n"
        f"  steady: {{command: [{python}, -c, 'import time; time.sleep(120)']}}\n"
        f"  quits: {{command: [{python}, -c, 'raise SystemExit(1)']}}\n"
        f"  loops: {{command: [{python}, -c, 'raise SystemExit(3)'], restart: on-failure}}\n"
    )
    launcher = Launcher(compose, tmp_path, tmp_path / "logs")
    loops_pids: set[int] = set()
    checked: list[bool] = []

    def watch() -> None:  # the launcher must run in the main thread: this one watches it
        def restarted_twice() -> bool:
            loops_pids.update(r.proc.pid for r in list(launcher.running)
                              if r.service.name == "loops")  # fmt: skip
            return len(loops_pids) >= 3

        try:
            wait_for(restarted_twice, 20, "loops started three times", interval=0.02)
            checked.append(steady.poll() is None)  # the others keep running
        finally:
            launcher.stopping.set()

    try:
        launcher.start_all()
        steady = next(r.proc for r in launcher.running if r.service.name == "steady")
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        outcome = launcher.wait()
        watcher.join(10)
    finally:
        launcher.stopping.set()
        launcher.stop_all()
    seen = "".join(capfd.readouterr())
    assert outcome == 0 and checked == [True], seen
    assert "quits not restarted (restart: no); the others keep running" in seen
    assert "loops restarting in 1 s" in seen and "loops restarting in 2 s" in seen
    assert steady.poll() is not None  # and stop_all stopped it
