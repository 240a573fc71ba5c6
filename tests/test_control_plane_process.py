"""The control plane as a process: bad topology, SIGHUP reload, SIGTERM."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.envoy_support import free_port
from tests.mesh_support import write_topology
from tests.support import ROOT, wait_for

pytestmark = pytest.mark.integration


def test_a_bad_topology_is_refused_with_every_error(tmp_path: Path) -> None:
    topology = tmp_path / "topology.yaml"
    topology.write_text("listener: {port: 70000}\nmodels: [{name: 'a b', sla_p99_ms: -1}]\n")
    result = subprocess.run(
        [sys.executable, "-m", "control_plane", "--topology", str(topology)],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    for fragment in ("listener.port", "models[0].name", "models[0].sla_p99_ms", "capacity_qps"):
        assert fragment in result.stderr


def test_sighup_reloads_and_a_broken_reload_keeps_the_last_good(tmp_path: Path) -> None:
    topology = write_topology(tmp_path / "topology.yaml", free_port(), ["127.0.0.1:1"])
    log = tmp_path / "cp.log"
    command = [
        sys.executable, "-m", "control_plane", "--topology", str(topology),
        "--xds-port", "0", "--admin-port", "0", "--otlp-port", "0",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        match = wait_for(
            lambda: re.search(r"admin=[\d.]+:(\d+)", log.read_text()), 30, "control plane up"
        )
        status_url = f"http://127.0.0.1:{match.group(1)}/status"
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "topology reloaded (SIGHUP)" in log.read_text(), 10, "SIGHUP reload")
        topology.write_text("models: []\n")
        proc.send_signal(signal.SIGHUP)

        def error_shown() -> str:
            with urllib.request.urlopen(status_url, timeout=5) as response:
                return str(json.loads(response.read())["topology"]["error"])

        assert "models" in wait_for(error_shown, 10, "the reload error in status")
        with urllib.request.urlopen(status_url, timeout=5) as response:
            assert "127.0.0.1:1" in json.loads(response.read())["endpoints"]  # last good kept
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
