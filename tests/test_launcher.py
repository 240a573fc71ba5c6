"""``infermesh up`` runs compose.yaml for real: every service as a process, in order, healthy,
reachable through Envoy, and stopped in reverse order on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from infermesh.compose import ComposeError, interpolate, load_services, parse_duration
from tests.envoy_support import free_port
from tests.support import ROOT, wait_for

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
    ports = {p: str(free_port()) for p in ("8001", "8002")}
    compose = (ROOT / "compose.yaml").read_text()
    topology = (ROOT / "deploy" / "topology.yaml").read_text()
    for old, new in ports.items():
        compose, topology = compose.replace(old, new), topology.replace(old, new)
    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy" / "topology.yaml").write_text(topology)
    (tmp_path / "compose.yaml").write_text(compose)
    (tmp_path / "models").symlink_to(demo_repo)
    (tmp_path / "otel").symlink_to(ROOT / "otel")
    envoy_port = free_port()
    env = {
        **os.environ,
        "INFERMESH_ENVOY_PORT": str(envoy_port),
        "INFERMESH_ENVOY_ADMIN_PORT": str(free_port()),
        "INFERMESH_XDS_PORT": str(free_port()),
        "INFERMESH_ADMIN_PORT": str(free_port()),
        "INFERMESH_OTLP_PORT": str(free_port()),
        "INFERMESH_PROMETHEUS_PORT": str(free_port()),
    }
    log = tmp_path / "up.log"
    command = [
        sys.executable,
        "-m",
        "infermesh.cli",
        "up",
        "--compose",
        str(tmp_path / "compose.yaml"),
        "--log-dir",
        str(tmp_path / "logs"),
    ]
    with log.open("wb") as out:
        launcher = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        wait_for(
            lambda: "mesh is up" in log.read_text() or launcher.poll() is not None,
            120,
            "the mesh to come up",
        )
        text = log.read_text()
        assert launcher.poll() is None, text
        started = re.findall(r"infermesh: (\S+) started \(pid (\d+)", text)
        assert [name for name, _ in started] == [
            "model-server-1", "model-server-2", "control-plane", "envoy", "prometheus",
        ]  # fmt: skip
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{envoy_port}")
        tensor = grpcclient.InferInput("input", [1, 3, 32, 32], "FP32")
        tensor.set_data_from_numpy(np.zeros((1, 3, 32, 32), dtype=np.float32))
        wait_for(lambda: _infers(client, tensor), 30, "inference through Envoy")
        status = subprocess.run(
            [sys.executable, "-m", "infermesh.cli", "status"], cwd=ROOT, env=env,
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert status.returncode == 0 and "model:classifier" in status.stdout, status.stdout
        assert "routing classifier: version split none" in status.stdout, status.stdout
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=90) == 0
        stopped = re.findall(r"infermesh: (\S+) stopped \(exit (\S+)\)", log.read_text())
        order = ["prometheus", "envoy", "control-plane", "model-server-2", "model-server-1"]
        assert stopped == [(name, "0") for name in order]
        for _, pid in started:
            assert not Path(f"/proc/{pid}").exists() or _zombie(int(pid))
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=30)


def _infers(client: grpcclient.InferenceServerClient, tensor: grpcclient.InferInput) -> bool:
    try:
        return client.infer("classifier", [tensor]).as_numpy("probs").shape == (1, 10)
    except Exception:
        return False


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True
