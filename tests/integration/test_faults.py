"""Fault injection through the admin HTTP endpoint, against real server processes."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.client import HTTPConnection
from pathlib import Path

import grpc
import numpy as np
import pytest

from model_server.core.faults import FaultError, Faults, parse_faults
from tests.support import (
    ServerProcess,
    classifier_request,
    metric_value,
    start_server,
    wait_for,
)

pytestmark = pytest.mark.integration

MiB = 1024 * 1024
NO_FAULTS = {"latency_ms": 0.0, "error_rate": 0.0, "ballast_bytes": 0, "version": ""}
IMAGES = np.zeros((1, 3, 32, 32), dtype=np.float32)


@pytest.fixture(scope="module")
def server(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(demo_repo, tmp_path_factory.mktemp("logs"), "--enable-fault-injection")
    yield proc
    proc.stop()


@pytest.fixture(autouse=True)
def reset_faults(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "server" in request.fixturenames:
        post(request.getfixturevalue("server"), {"reset": True})


def http(
    server: ServerProcess, method: str, path: str, body: bytes | None = None
) -> tuple[int, str]:
    url = f"http://127.0.0.1:{server.metrics_port}{path}"
    req = urllib.request.Request(url, data=body, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def post(server: ServerProcess, faults: dict[str, object]) -> dict[str, object]:
    status, text = http(server, "POST", "/faults", json.dumps(faults).encode())
    assert status == 200, text
    return dict(json.loads(text))


def timed_infer(server: ServerProcess, version: str = "") -> float:
    stub = server.stub()
    started = time.monotonic()
    stub.ModelInfer(classifier_request(IMAGES, version=version), timeout=30)
    return time.monotonic() - started


def vm_rss(server: ServerProcess) -> int:
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def scraped_memory(server: ServerProcess) -> float:
    _, text = http(server, "GET", "/metrics")
    return metric_value(text, "accelerator_memory_used_bytes", source="process")


def test_latency_fault_adds_to_client_time(server: ServerProcess) -> None:
    baseline = min(timed_infer(server) for _ in range(3))
    assert post(server, {"latency_ms": 300})["latency_ms"] == 300
    assert timed_infer(server) >= baseline + 0.3 - 0.01
    _, text = http(server, "GET", "/metrics")
    slow = metric_value(text, "inference_request_duration_seconds_bucket", le="0.25")
    total = metric_value(text, "inference_request_duration_seconds_count")
    assert total - slow >= 1, "the injected latency is counted in the request duration"
    post(server, {"latency_ms": 0})
    assert timed_infer(server) < baseline + 0.25


def test_error_rate_one_refuses_and_zero_restores(server: ServerProcess) -> None:
    post(server, {"error_rate": 1.0})
    for _ in range(3):
        with pytest.raises(grpc.RpcError) as info:
            timed_infer(server)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert info.value.details() == "injected fault"
    status, text = http(server, "GET", "/faults")
    assert status == 200 and json.loads(text)["error_rate"] == 1.0
    post(server, {"error_rate": 0})
    timed_infer(server)
    assert "fault injection changed" in server.log()


def test_ballast_moves_rss_and_the_memory_gauge(server: ServerProcess) -> None:
    before = vm_rss(server)
    post(server, {"ballast_bytes": 200 * MiB})
    grown = vm_rss(server)
    assert grown - before >= 180 * MiB, (before, grown)
    wait_for(lambda: scraped_memory(server) >= before + 180 * MiB, 2, "the gauge to follow")
    post(server, {"ballast_bytes": 0})
    assert vm_rss(server) <= grown - 180 * MiB
    wait_for(lambda: scraped_memory(server) <= grown - 180 * MiB, 2, "the gauge to drop")


def test_subsets_and_reset(server: ServerProcess) -> None:
    post(server, {"latency_ms": 5})
    assert post(server, {"error_rate": 0.25}) == {
        "latency_ms": 5.0,
        "error_rate": 0.25,
        "ballast_bytes": 0,
        "version": "",
    }
    assert post(server, {})["latency_ms"] == 5.0
    assert post(server, {"reset": True}) == NO_FAULTS


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"latency_ms": -1}', "latency_ms"),
        (b'{"latency_ms": "slow"}', "latency_ms"),
        (b'{"error_rate": 1.5}', "error_rate"),
        (b'{"ballast_bytes": 1.5}', "ballast_bytes"),
        (b'{"ballast_bytes": -4}', "ballast_bytes"),
        (b'{"version": 0}', "version"),
        (b'{"version": "v2"}', "version"),
        (b'{"typo": 1}', "typo"),
        (b"{not json", "JSON"),
        (b"[1]", "object"),
    ],
)
def test_bad_values_are_400_naming_the_field(
    server: ServerProcess, body: bytes, field: str
) -> None:
    status, text = http(server, "POST", "/faults", body)
    assert status == 400
    assert field in json.loads(text)["error"]
    _, current = http(server, "GET", "/faults")
    assert json.loads(current) == NO_FAULTS


@pytest.mark.parametrize("length", ["x", "-1", "²"])
def test_a_content_length_that_is_no_byte_count_is_400(server: ServerProcess, length: str) -> None:
    """Before, int() raised on "x" and "²" and the client got no answer."""
    connection = HTTPConnection("127.0.0.1", server.metrics_port, timeout=30)
    try:
        connection.putrequest("POST", "/faults")
        connection.putheader("Content-Length", length)
        connection.endheaders(b"{}")
        answer = connection.getresponse()
        assert answer.status == 400
        assert "Content-Length" in json.loads(answer.read())["error"]
    finally:
        connection.close()
    _, current = http(server, "GET", "/faults")
    assert json.loads(current) == NO_FAULTS


def test_version_scoped_faults_touch_only_that_version(server: ServerProcess) -> None:
    assert post(server, {"error_rate": 1.0, "latency_ms": 300, "version": 2})["version"] == "2"
    with pytest.raises(grpc.RpcError) as info:
        timed_infer(server, version="2")
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert timed_infer(server, version="1") < 0.25  # v1: neither the errors nor the latency
    assert post(server, {"version": None})["version"] == ""  # every version again
    with pytest.raises(grpc.RpcError):
        timed_infer(server, version="1")


@pytest.mark.parametrize(
    ("value", "expected"), [(2, "2"), ("2", "2"), ("02", "2"), ("", ""), (None, "")]
)
def test_version_field_accepts_numbers_and_clears_with_null(value: object, expected: str) -> None:
    faults = parse_faults({"version": value}, Faults(version="7"))
    assert faults.version == expected
    assert faults.applies_to(2) is (expected in ("", "2"))
    assert faults.applies_to(1) is (expected == "")
    assert parse_faults({"reset": True}, faults).version == ""


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "v2", "-2", "0", [2]])
def test_bad_versions_are_refused_naming_the_field(value: object) -> None:
    with pytest.raises(FaultError, match=r"^version: expected a model version"):
        parse_faults({"version": value}, Faults())


def test_faults_are_404_without_the_flag(demo_repo: Path, tmp_path: Path) -> None:
    plain = start_server(demo_repo, tmp_path)
    try:
        for method, body in (("GET", None), ("POST", b'{"error_rate": 1}')):
            status, text = http(plain, method, "/faults", body)
            assert status == 404
            assert "--enable-fault-injection" in text
        timed_infer(plain)
        status, text = http(plain, "GET", "/metrics")
        assert status == 200 and "inference_requests_total" in text
    finally:
        plain.stop()
