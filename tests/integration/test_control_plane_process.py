"""The control plane as a process: bad topology, SIGHUP reload, SIGTERM."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceResponse,
)

from control_plane.telemetry.receiver import EXPORT_METHOD
from tests.envoy_support import free_port
from tests.mesh_support import start_control_plane, write_topology
from tests.otlp_support import gauge, request
from tests.support import ROOT, alive, children, wait_for

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
    proc, log = start_control_plane(topology, tmp_path / "cp.log")
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
        metrics_url = status_url.replace("/status", "/metrics")
        with urllib.request.urlopen(metrics_url, timeout=5) as response:
            assert "topology_reload_failures_total 1.0" in response.read().decode()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_decoder_processes_decode_and_go_with_the_control_plane(tmp_path: Path) -> None:
    top = {"telemetry": {"decoder_processes": 2}}
    topology = write_topology(tmp_path / "t.yaml", free_port(), ["127.0.0.1:1"], top=top)
    proc, log = start_control_plane(topology, tmp_path / "cp.log")
    try:
        match = wait_for(
            lambda: re.search(r"admin=[\d.]+:(\d+) otlp=[\d.]+:(\d+)", log.read_text()),
            30,
            "control plane up",
        )
        admin, otlp = match.group(1), match.group(2)
        with grpc.insecure_channel(f"127.0.0.1:{otlp}") as channel:
            export = channel.unary_unary(
                EXPORT_METHOD, response_deserializer=ExportMetricsServiceResponse.FromString
            )
            body = request([gauge("inference_queue_depth", 7.0, model="m")], "127.0.0.1:1")
            export(body.SerializeToString(), timeout=30)
            with pytest.raises(grpc.RpcError) as bad:
                export(b"\xff\xff not protobuf", timeout=30)
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        def queue_depth() -> float | None:
            with urllib.request.urlopen(f"http://127.0.0.1:{admin}/telemetry", timeout=5) as r:
                endpoint = json.loads(r.read())["endpoints"].get("127.0.0.1:1") or {}
            return (endpoint.get("queue_depth") or {}).get("value")

        assert wait_for(queue_depth, 10, "the decoded gauge in /telemetry") == 7.0
        decoders = children(proc.pid)
        assert len(decoders) >= 2  # the two decoders (and the pool's resource tracker)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        wait_for(lambda: not any(alive(p) for p in decoders), 10, "the decoders gone")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
