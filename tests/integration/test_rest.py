"""The KServe v2 HTTP/REST port against a real server: tritonclient.http, plain HTTP, hostile
input, metrics and the drain, all compared with what the gRPC port answers."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from model_server.cli import build_parser
from model_server.demo_models import build_identity_model, write_model
from model_server.server import ServerSettings
from tests.support import ServerProcess, metric_value, post_faults, start_server, wait_for

pytestmark = pytest.mark.integration
MAX_REQUEST_BYTES = 256 * 1024


@pytest.fixture(scope="module")
def repo(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("repo")
    shutil.copytree(demo_repo / "classifier", repo / "classifier")
    write_model(build_identity_model("BYTES", [-1]), repo / "text" / "1" / "model.onnx")
    write_model(build_identity_model("INT8", [-1, 4]), repo / "small_ints" / "1" / "model.onnx")
    write_model(build_identity_model("BOOL", [-1, 2]), repo / "flags" / "1" / "model.onnx")
    return repo


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(
        repo, tmp_path_factory.mktemp("logs"), "--max-request-bytes", str(MAX_REQUEST_BYTES)
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def base(server: ServerProcess) -> str:
    return f"http://127.0.0.1:{server.http_port}"


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    yield client
    client.close()


def call(
    url: str, body: bytes | None = None, headers: dict[str, str] | None = None, method: str = ""
) -> tuple[int, dict[str, str], bytes]:
    """One plain HTTP request: (status, headers, body), error statuses included."""
    request = urllib.request.Request(
        url, data=body, headers=headers or {}, method=method or ("POST" if body else "GET")
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def images(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((batch, 3, 32, 32), dtype=np.float32)


def grpc_infer(server: ServerProcess, model: str, name: str, x: np.ndarray, dtype: str) -> Any:
    tensor = grpcclient.InferInput(name, list(x.shape), dtype)
    tensor.set_data_from_numpy(x)
    return server.client().infer(model, [tensor])


def http_infer(
    client: httpclient.InferenceServerClient,
    model: str,
    name: str,
    output: str,
    x: np.ndarray,
    dtype: str,
    binary: bool,
    **kwargs: Any,
) -> httpclient.InferResult:
    tensor = httpclient.InferInput(name, list(x.shape), dtype)
    tensor.set_data_from_numpy(x, binary_data=binary)
    wanted = [httpclient.InferRequestedOutput(output, binary_data=binary)]
    return client.infer(model, [tensor], outputs=wanted, **kwargs)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_http_gets_the_grpc_numbers(
    server: ServerProcess, http: httpclient.InferenceServerClient, binary: bool
) -> None:
    x = images(3, seed=5)
    expected = grpc_infer(server, "classifier", "input", x, "FP32")
    result = http_infer(http, "classifier", "input", "probs", x, "FP32", binary)
    np.testing.assert_allclose(result.as_numpy("probs"), expected.as_numpy("probs"), atol=1e-6)
    response = result.get_response()
    assert response["model_name"] == "classifier" and response["model_version"] == "2"
    assert ("data" in response["outputs"][0]) is not binary


def test_default_outputs_come_back_binary(
    server: ServerProcess, http: httpclient.InferenceServerClient
) -> None:
    x = images(1, seed=9)
    tensor = httpclient.InferInput("input", [1, 3, 32, 32], "FP32")
    tensor.set_data_from_numpy(x)
    result = http.infer("classifier", [tensor], model_version="1", request_id="rest-7")
    expected = (
        server.client().infer("classifier", [_grpc_input(x)], model_version="1").as_numpy("probs")
    )
    np.testing.assert_allclose(result.as_numpy("probs"), expected, atol=1e-6)
    assert result.get_response()["id"] == "rest-7"
    assert result.get_response()["model_version"] == "1"


def _grpc_input(x: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return tensor


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize(
    ("model", "dtype", "x"),
    [
        ("text", "BYTES", np.array([b"hello", "w\u00f6rld".encode(), b""], dtype=object)),
        ("small_ints", "INT8", np.array([[-128, -1, 0, 127]], dtype=np.int8)),
        ("flags", "BOOL", np.array([[True, False], [False, True]])),
    ],
)
def test_other_datatypes_round_trip_like_grpc(
    server: ServerProcess,
    http: httpclient.InferenceServerClient,
    model: str,
    dtype: str,
    x: np.ndarray,
    binary: bool,
) -> None:
    expected = grpc_infer(server, model, "x", x, dtype).as_numpy("y")
    got = http_infer(http, model, "x", "y", x, dtype, binary).as_numpy("y")
    if dtype == "BYTES":
        # tritonclient.http decodes JSON strings to str and binary ones to bytes
        got = np.array([v.encode() if isinstance(v, str) else v for v in got], dtype=object)
    np.testing.assert_array_equal(got, expected)


def test_plain_http_json_infer_with_nested_data(server: ServerProcess, base: str) -> None:
    x = images(2, seed=3)
    body = {
        "id": "curl-1",
        "inputs": [{"name": "input", "shape": [2, 3, 32, 32], "datatype": "FP32",
                    "data": x.tolist()}],  # nested lists, as a hand-written client sends
    }  # fmt: skip
    status, headers, raw = call(
        f"{base}/v2/models/classifier/versions/2/infer",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    assert status == 200, raw
    assert headers["Content-Type"].startswith("application/json")
    answer = json.loads(raw)
    assert answer["id"] == "curl-1" and answer["model_version"] == "2"
    assert answer["outputs"][0]["shape"] == [2, 10]
    expected = grpc_infer(server, "classifier", "input", x, "FP32").as_numpy("probs")
    got = np.array(answer["outputs"][0]["data"], dtype=np.float32).reshape(2, 10)
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_routing_header_picks_the_version_like_grpc(base: str) -> None:
    body = {"inputs": [{"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32",
                        "data": [0.5] * 3072}]}  # fmt: skip
    for routed in ("1", "2"):
        status, _, raw = call(
            f"{base}/v2/models/classifier/infer",
            json.dumps(body).encode(),
            {"x-model-version": routed},
        )
        assert status == 200, raw
        assert json.loads(raw)["model_version"] == routed


def test_health_metadata_ready_config_and_stats(
    http: httpclient.InferenceServerClient, base: str
) -> None:
    assert http.is_server_live() and http.is_server_ready()
    assert http.is_model_ready("classifier") and http.is_model_ready("classifier", "1")
    assert not http.is_model_ready("classifier", "9") and not http.is_model_ready("nope")
    metadata = http.get_model_metadata("classifier")
    assert metadata["versions"] == ["1", "2"] and metadata["platform"] == "onnxruntime_onnx"
    assert metadata["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 32, 32]}]
    assert metadata["outputs"] == [{"name": "probs", "datatype": "FP32", "shape": [-1, 10]}]
    assert http.get_model_metadata("classifier", "1")["name"] == "classifier"
    server = http.get_server_metadata()
    assert server["name"] == "infermesh" and "binary_tensor_data" in server["extensions"]
    config = http.get_model_config("classifier")
    assert config["max_batch_size"] == 32 and config["input"][0]["dims"] == [3, 32, 32]
    assert config["parameters"]["execution_provider"]["string_value"] == "CPUExecutionProvider"
    stats = http.get_inference_statistics("classifier", "1")["model_stats"]
    assert stats[0]["name"] == "classifier" and isinstance(stats[0]["inference_count"], int)
    assert len(http.get_inference_statistics()["model_stats"]) >= 4
    status, _, raw = call(f"{base}/v2/models/nope/ready")
    assert status == 404 and json.loads(raw)["ready"] is False
    for path in ("/v2/health/live", "/v2/health/ready", "/v2"):
        assert call(base + path)[0] == 200


def _tensor(**fields: Any) -> dict[str, Any]:
    tensor = {"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": [0.0] * 3072}
    tensor.update(fields)
    return {"inputs": [{k: v for k, v in tensor.items() if v is not None}]}


def _json(document: Any) -> bytes:
    return json.dumps(document).encode()


def _binary(size: int, send: int, header_extra: int = 0) -> tuple[bytes, dict[str, str]]:
    header = _json(_tensor(data=None, parameters={"binary_data_size": size}))
    body = header + b"\0" * send
    return body, {"Inference-Header-Content-Length": str(len(header) + header_extra)}


INFER = "/v2/models/classifier/infer"
# case: (method, path, body, headers, status, fragments of the error message)
HOSTILE: dict[str, tuple[str, str, bytes, dict[str, str], int, list[str]]] = {
    "not JSON": ("POST", INFER, b"{nope", {}, 400, ["not valid JSON"]),
    "empty body": ("POST", INFER, b"", {}, 400, ["not valid JSON", "empty"]),
    "JSON not an object": ("POST", INFER, b"[1]", {}, 400, ["request body", "JSON object"]),
    "inputs not a list": ("POST", INFER, _json({"inputs": 3}), {}, 400, ["inputs", "list"]),
    "unknown model": ("POST", "/v2/models/nope/infer", _json(_tensor()), {}, 404,
                      ["'nope'", "not loaded"]),
    "unknown version": ("POST", "/v2/models/classifier/versions/7/infer", _json(_tensor()), {},
                        404, ["no version 7"]),
    "unknown input": ("POST", INFER, _json(_tensor(name="image")), {}, 400, ["no input 'image'"]),
    "wrong datatype": ("POST", INFER, _json(_tensor(datatype="FP64")), {}, 400,
                       ["'FP64'", "FP32"]),
    "not a datatype": ("POST", INFER, _json(_tensor(datatype="FLOAT")), {}, 400,
                       ["datatype", "'FLOAT'"]),
    "wrong rank": ("POST", INFER, _json(_tensor(shape=[3, 32, 32], data=[0.0] * 3072)), {}, 400,
                   ["rank 3", "expected rank 4"]),
    "shape not integers": ("POST", INFER, _json(_tensor(shape=[1, 3, 32, "x"])), {}, 400,
                           ["shape", "integers"]),
    "data length mismatch": ("POST", INFER, _json(_tensor(data=[0.0] * 100)), {}, 400,
                             ["data has 100 values", "needs 3072"]),
    "data not numbers": ("POST", INFER, _json(_tensor(data=["a"] * 3072)), {}, 400,
                         ["data", "FP32 takes numbers"]),
    "no data": ("POST", INFER, _json(_tensor(data=None)), {}, 400, ["binary_data_size"]),
    "binary size beyond the body": ("POST", INFER, *_binary(12288, 100), 400,
                                    ["binary_data_size", "12288 bytes"]),
    "binary sizes short of the body": ("POST", INFER, *_binary(100, 12288), 400,
                                       ["add up to 100", "12288 bytes follow"]),
    "binary size not the tensor's": ("POST", INFER, *_binary(100, 100), 400,
                                      ["100 bytes", "expected 12288"]),
    "header length beyond the body": ("POST", INFER, *_binary(12288, 12288, 10**6), 400,
                                      ["Inference-Header-Content-Length", "only"]),
    "header length not a number": ("POST", INFER, _json(_tensor()),
                                   {"Inference-Header-Content-Length": "-3"}, 400,
                                   ["Inference-Header-Content-Length", "'-3'"]),
    "body over --max-request-bytes": ("POST", INFER, b"{" + b" " * MAX_REQUEST_BYTES + b"}", {},
                                      413, ["--max-request-bytes"]),
    "bad priority header": ("POST", INFER, _json(_tensor()), {"x-priority": "high"}, 400,
                            ["x-priority", "'high'"]),
    "unknown path": ("GET", "/v2/nothing/here", b"", {}, 404, ["/v2/nothing/here"]),
    "wrong method": ("GET", INFER, b"", {}, 405, ["GET", "allowed: POST"]),
    "unknown model metadata": ("GET", "/v2/models/nope", b"", {}, 404, ["'nope'"]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_input_gets_the_mapped_status(base: str, case: str) -> None:
    method, path, body, headers, status, fragments = HOSTILE[case]
    got, answer_headers, raw = call(base + path, body or None, headers, method)
    assert got == status, raw
    assert answer_headers["Content-Type"].startswith("application/json")
    message = json.loads(raw)["error"]
    for fragment in fragments:
        assert fragment in message, message
    good, _, raw = call(base + INFER, _json(_tensor()))  # and the server goes on serving
    assert good == 200, raw


def test_tritonclient_sees_the_error_message(http: httpclient.InferenceServerClient) -> None:
    tensor = httpclient.InferInput("input", [1, 3, 32, 31], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, 3, 32, 31), dtype=np.float32))
    with pytest.raises(InferenceServerException) as caught:
        http.infer("classifier", [tensor])
    assert caught.value.status() == "400"
    assert "31 at axis 3" in caught.value.message()


def _counts(server: ServerProcess, code: str) -> float:
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return metric_value(
        text, "inference_requests_total", model="classifier", version="1", code=code
    )


def test_rest_requests_are_counted_like_grpc(server: ServerProcess, base: str) -> None:
    path = f"{base}/v2/models/classifier/versions/1/infer"
    ok, bad = _counts(server, "OK"), _counts(server, "INVALID_ARGUMENT")
    assert call(path, _json(_tensor()))[0] == 200
    assert call(path, _json(_tensor(shape=[1, 3, 32, 31])))[0] == 400  # refused by validation
    assert call(path, _json(_tensor(data=[1.0])))[0] == 400  # refused converting the JSON
    assert _counts(server, "OK") == ok + 1
    assert _counts(server, "INVALID_ARGUMENT") == bad + 2
    # the same over gRPC moves the same series
    server.client().infer("classifier", [_grpc_input(images(1))], model_version="1")
    assert _counts(server, "OK") == ok + 2


def test_a_client_that_disconnects_cancels_its_request(repo: Path, tmp_path: Path) -> None:
    """As over gRPC: the request stops when its client goes, and is counted CANCELLED."""
    server = start_server(repo, tmp_path, "--enable-fault-injection")
    try:
        post_faults(server, {"latency_ms": 5000})
        cancelled = _counts(server, "CANCELLED")
        body = _json(_tensor())
        head = (
            "POST /v2/models/classifier/versions/1/infer HTTP/1.1\r\nHost: test\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=5) as sock:
            sock.sendall(head.encode() + body)
            wait_for(lambda: _in_flight(server) == 1, 5, "the request in the server")
        gone = time.monotonic()
        wait_for(lambda: _counts(server, "CANCELLED") == cancelled + 1, 4, "CANCELLED counted")
        assert time.monotonic() - gone < 4  # well before the 5 s the request would have taken
        assert _in_flight(server) == 0 and _counts(server, "OK") == 0
    finally:
        server.stop()


def _in_flight(server: ServerProcess) -> float:
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        return metric_value(response.read().decode(), "inference_in_flight_requests")


def test_drain_turns_rest_readiness_off_then_stops(repo: Path, tmp_path: Path) -> None:
    proc = start_server(repo, tmp_path, "--models", "classifier", "--drain-delay", "3")
    try:
        base = f"http://127.0.0.1:{proc.http_port}"
        assert call(base + "/v2/health/ready")[0] == 200
        proc.signal(signal.SIGTERM)
        wait_for(lambda: call(base + "/v2/health/ready")[0] == 503, 10, "REST ready = 503")
        assert json.loads(call(base + "/v2/health/ready")[2]) == {"ready": False}
        assert proc.wait_exit(timeout=30) == 0
    finally:
        proc.stop()


def test_http_port_can_be_turned_off(repo: Path, tmp_path: Path) -> None:
    proc = start_server(repo, tmp_path, "--models", "", "--http-port", "-1", wait_ready=False)
    try:
        assert " http=off " in proc.log()
    finally:
        proc.stop()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [([], 10001), (["--port", "0"], 0), (["--http-port", "-1"], -1), (["--http-port", "7"], 7)],
)
def test_http_port_default_follows_the_grpc_port(argv: list[str], expected: int) -> None:
    args = build_parser().parse_args(argv)
    settings = ServerSettings(port=args.port, http_port=args.http_port)
    assert settings.resolved_http_port() == expected
