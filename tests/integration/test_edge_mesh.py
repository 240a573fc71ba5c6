"""Edge protocols for real: tritonclient.http, plain HTTP/1.1 and gRPC-Web clients -> Envoy ->
model servers, configured over xDS by the control plane, next to tritonclient.grpc.

Servers listen on explicit gRPC ports P with --http-port P + OFFSET (the topology's
listener.rest.port_offset), so the REST twins' endpoints are where the servers serve REST.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import functools
import http.client
import json
import shutil
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from control_plane.model.mesh import model_cluster, rest_cluster
from control_plane.xds import edge
from model_server.demo_models import build_identity_model, write_model
from tests.edge_mesh_support import EdgeMesh
from tests.envoy_support import free_port, free_port_pair
from tests.mesh_support import start_plane_and_envoy, write_topology
from tests.support import post_faults, start_server, wait_for

pytestmark = pytest.mark.integration
OFFSET = 3000  # not the default, so the test shows the option is applied
ORIGIN = "https://app.example"
MAX_CONCURRENT = 6
INFER = "/inference.GRPCInferenceService/ModelInfer"


class Mesh(EdgeMesh):
    def served(self) -> list[int]:
        """Classifier inferences each server has answered (its own statistics)."""
        counts = []
        for server in self.servers:
            stats = server.client().get_inference_statistics("classifier").model_stats
            counts.append(sum(s.inference_count for s in stats))
        return counts

    def healthy(self, cluster: str) -> int:
        return sum(
            1 for line in self.envoy.admin("/clusters").splitlines()
            if line.startswith(f"{cluster}::") and line.endswith("::health_flags::healthy")
        )  # fmt: skip

    def wait_healthy(self) -> None:
        for name in ("servers", model_cluster("classifier"), model_cluster("limited")):
            for cluster in (name, rest_cluster(name)):
                wait_for(functools.partial(self.all_healthy, cluster), 30, f"2 in {cluster}")

    def all_healthy(self, cluster: str) -> bool:
        return self.healthy(cluster) == 2


@pytest.fixture(scope="module")
def mesh(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    workdir = tmp_path_factory.mktemp("edge")
    repo = workdir / "models"
    shutil.copytree(demo_repo / "classifier", repo / "classifier")
    write_model(build_identity_model("FP32", [-1, 4]), repo / "limited" / "1" / "model.onnx")
    with contextlib.ExitStack() as stops:
        servers = []
        for index in (1, 2):
            port = free_port_pair(OFFSET)
            server = start_server(
                repo, workdir / f"s{index}", "--port", str(port), "--http-port",
                str(port + OFFSET), "--enable-fault-injection",
                "--max-concurrent-rpcs", str(MAX_CONCURRENT),
            )  # fmt: skip
            stops.callback(server.stop)
            servers.append(server)
        listener_port = free_port()
        listener = {
            "host": "127.0.0.1", "port": listener_port, "health_check_interval_s": 0.5,
            "rest": {"port_offset": OFFSET}, "cors": {"allow_origins": [ORIGIN]},
            # More than the default (tests/integration/test_edge_security.py): statistics is
            # exposed here.
            "expose": ["inference", "metadata", "health", "statistics"],
        }  # fmt: skip
        more = [
            {"name": "limited", "sla_p99_ms": 100, "capacity_qps": 100,
             "rate_limit": {"requests_per_s": 0.5, "burst": 2}},
            {"name": "ghost", "sla_p99_ms": 100, "capacity_qps": 100},  # served nowhere
        ]  # fmt: skip
        topology = write_topology(
            workdir / "topology.yaml", listener_port, [s.url for s in servers],
            top={"listener": listener}, more_models=more,
        )  # fmt: skip
        plane, envoy = start_plane_and_envoy(stops, workdir, topology, listener_port, 8)
        the_mesh = Mesh(servers, plane, envoy, listener_port)
        the_mesh.wait_healthy()
        yield the_mesh


def images(batch: int = 1) -> np.ndarray:
    return np.random.default_rng(5).random((batch, 3, 32, 32), dtype=np.float32)


def grpc_infer(mesh: Mesh, **kwargs: Any) -> grpcclient.InferResult:
    tensor = grpcclient.InferInput("input", [1, 3, 32, 32], "FP32")
    tensor.set_data_from_numpy(images())
    return grpcclient.InferenceServerClient(mesh.url).infer("classifier", [tensor], **kwargs)


def http_infer(mesh: Mesh, binary: bool, **kwargs: Any) -> httpclient.InferResult:
    tensor = httpclient.InferInput("input", [1, 3, 32, 32], "FP32")
    tensor.set_data_from_numpy(images(), binary_data=binary)
    output = httpclient.InferRequestedOutput("probs", binary_data=binary)
    client = httpclient.InferenceServerClient(mesh.url)
    return client.infer("classifier", [tensor], outputs=[output], **kwargs)


def request(
    mesh: Mesh, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One plain HTTP/1.1 request to Envoy's listener: status, headers (lower case), body."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    connection = http.client.HTTPConnection("127.0.0.1", mesh.port, timeout=30)
    try:
        connection.request(method, path, body=data, headers=headers or {})
        response = connection.getresponse()
        return (
            response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        )  # fmt: skip
    finally:
        connection.close()


def json_infer_body(data: np.ndarray | None = None, **tensor: Any) -> dict[str, Any]:
    array = images() if data is None else data
    fields = {"name": "input", "shape": list(array.shape), "datatype": "FP32",
              "data": array.flatten().tolist(), **tensor}  # fmt: skip
    return {"inputs": [fields]}


def json_error(status: int, headers: dict[str, str], body: bytes, expected: int) -> str:
    assert status == expected, body
    assert headers["content-type"].startswith("application/json"), headers
    document = json.loads(body)
    assert set(document) == {"error"} and isinstance(document["error"], str), document
    return str(document["error"])


# --- the same numbers over every protocol ---------------------------------------------------


def test_rest_json_binary_and_plain_http_get_the_grpc_numbers(mesh: Mesh) -> None:
    expected = grpc_infer(mesh).as_numpy("probs")
    direct = grpc_infer(mesh, headers={"x-model-name": "classifier"}).as_numpy("probs")
    np.testing.assert_array_equal(direct, expected)
    for binary in (True, False):
        got = http_infer(mesh, binary).as_numpy("probs")
        np.testing.assert_allclose(got, expected, rtol=1e-6)  # JSON prints floats in decimal
    status, _, body = request(
        mesh, "POST", "/v2/models/classifier/infer", json_infer_body(),
        {"content-type": "application/json"},
    )  # fmt: skip
    assert status == 200, body
    (output,) = json.loads(body)["outputs"]
    np.testing.assert_allclose(np.array(output["data"]).reshape(1, 10), expected, rtol=1e-6)
    curl = shutil.which("curl")
    if curl is not None:  # what a script would do (Debian has it; not a Python dependency)
        done = subprocess.run(
            [curl, "-sS", "--fail-with-body", "-H", "content-type: application/json",
             "--data-binary", "@-", f"http://{mesh.url}/v2/models/classifier/infer"],
            input=json.dumps(json_infer_body()).encode(), capture_output=True, timeout=30,
            check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        (output,) = json.loads(done.stdout)["outputs"]
        np.testing.assert_allclose(np.array(output["data"]).reshape(1, 10), expected, rtol=1e-6)
    client = httpclient.InferenceServerClient(mesh.url)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("classifier") and client.is_model_ready("classifier", "2")
    assert client.get_model_metadata("classifier")["name"] == "classifier"
    assert request(mesh, "GET", "/v2/models/stats")[0] == 200  # exposed by the topology
    assert request(mesh, "GET", "/v2/models/classifier/config")[0] == 403  # not exposed


# --- version routing ------------------------------------------------------------------------


def rest_version(mesh: Mesh, path: str = "/v2/models/classifier/infer", **headers: str) -> str:
    status, _, body = request(mesh, "POST", path, json_infer_body(), headers)
    assert status == 200, body
    return str(json.loads(body)["model_version"])


def test_rest_version_routing_by_path_header_and_split(mesh: Mesh) -> None:
    for version in ("1", "2"):
        assert rest_version(mesh, f"/v2/models/classifier/versions/{version}/infer") == version
        assert rest_version(mesh, **{"x-model-version": version}) == version
        result = http_infer(mesh, True, model_version=version)
        assert result.get_response()["model_version"] == version
    try:
        mesh.plane.admin_post("/models/classifier/split", {"1": 0, "2": 100})
        wait_for(lambda: rest_version(mesh) == "2", 20, "the split to reach Envoy", 0.1)
        assert {rest_version(mesh) for _ in range(10)} == {"2"}  # header-less REST: the split
        mesh.plane.admin_post("/models/classifier/split", {"1": 100, "2": 0})
        wait_for(lambda: rest_version(mesh) == "1", 20, "the split to reach Envoy", 0.1)
        assert {rest_version(mesh) for _ in range(10)} == {"1"}
    finally:
        mesh.plane.admin_post("/models/classifier/split", {})


# --- weights and drains apply to REST -------------------------------------------------------


def test_draining_a_server_moves_rest_traffic_off_it(mesh: Mesh) -> None:
    drained = mesh.servers[0]
    rest_address = f"127.0.0.1:{drained.port + OFFSET}"
    line = f"{rest_cluster(model_cluster('classifier'))}::{rest_address}::health_flags::"
    try:
        mesh.plane.admin_post(f"/endpoints/{drained.url}", {"health": "DRAINING"})
        wait_for(
            lambda: any(
                row.startswith(line) and "draining" in row
                for row in mesh.envoy.admin("/clusters").splitlines()
            ),
            20, "the REST twin to drain the endpoint",
        )  # fmt: skip

        def twenty_all_to_the_other() -> bool:
            before = mesh.served()
            for _ in range(20):
                http_infer(mesh, True)
            after = mesh.served()
            return after[0] == before[0] and after[1] - before[1] == 20

        # The admin's /clusters is the main thread's view; Envoy's worker takes the update a
        # moment later, so the first batch may still reach the drained server. Then it never
        # does again.
        wait_for(twenty_all_to_the_other, 10, "REST traffic off the drained server", 0.05)
        assert twenty_all_to_the_other()
    finally:
        mesh.plane.admin_post(f"/endpoints/{drained.url}", {"health": None})
    wait_for(lambda: mesh.healthy(rest_cluster(model_cluster("classifier"))) == 2, 20, "undrain")
    before = mesh.served()
    for _ in range(20):
        http_infer(mesh, True)
    after = mesh.served()
    assert after[0] > before[0] and after[1] > before[1]  # both serve again


# --- errors: the gRPC code's HTTP status, JSON bodies ---------------------------------------


@pytest.mark.parametrize(
    ("body", "content"),
    [
        (json_infer_body(shape=[1, 3, 32, 31]), "shape"),
        (json_infer_body(datatype="INT32"), "INT32"),
        (json_infer_body(name="nope"), "nope"),
        (b"{not json", "JSON"),
    ],
    ids=["shape", "datatype", "input-name", "malformed"],
)
def test_bad_input_over_rest_is_400_like_invalid_argument_over_grpc(
    mesh: Mesh, body: Any, content: str
) -> None:
    status, headers, answer = request(mesh, "POST", "/v2/models/classifier/infer", body)
    assert content.lower() in json_error(status, headers, answer, 400).lower()


def test_invalid_argument_over_grpc_through_envoy(mesh: Mesh) -> None:
    tensor = grpcclient.InferInput("input", [1, 3, 32, 31], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, 3, 32, 31), np.float32))
    with pytest.raises(InferenceServerException) as error:
        grpcclient.InferenceServerClient(mesh.url).infer("classifier", [tensor])
    assert "INVALID_ARGUMENT" in str(error.value.status())


def test_not_found_is_404_from_envoy_and_from_the_server(mesh: Mesh) -> None:
    status, headers, body = request(mesh, "POST", "/v2/models/nope/infer", json_infer_body())
    assert json_error(status, headers, body, 404) == edge.REST_NOT_FOUND_MESSAGE
    status, headers, body = request(mesh, "GET", "/v2/models/nope/ready")
    json_error(status, headers, body, 404)
    path = "/v2/models/classifier/versions/9/infer"  # the server's NOT_FOUND
    status, headers, body = request(mesh, "POST", path, json_infer_body())
    assert "9" in json_error(status, headers, body, 404)


def test_no_healthy_upstream_is_503_json_for_rest_and_unavailable_for_grpc(mesh: Mesh) -> None:
    status, headers, body = request(mesh, "POST", "/v2/models/ghost/infer", json_infer_body())
    assert "no healthy upstream" in json_error(status, headers, body, 503)
    with grpc.insecure_channel(mesh.url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            stub.ModelInfer(service_pb2.ModelInferRequest(model_name="ghost"), timeout=10)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no healthy upstream" in str(error.value.details())  # gRPC replies as they were


def test_envoy_rate_limit_is_429_json_for_rest_and_resource_exhausted_for_grpc(
    mesh: Mesh,
) -> None:
    body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    answers = [request(mesh, "POST", "/v2/models/limited/infer", body) for _ in range(5)]
    statuses = [status for status, _, _ in answers]
    assert 200 in statuses and 429 in statuses, statuses
    status, headers, answer = next(a for a in answers if a[0] == 429)
    assert json_error(status, headers, answer, 429) == edge.RATE_LIMITED_MESSAGE
    assert headers["x-infermesh-rate-limited"] == "limited" and "retry-after" in headers
    # The gRPC route has its own bucket (as each route has): the same limit, refused the same.
    codes = set()
    with grpc.insecure_channel(mesh.url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(5):
            try:
                stub.ModelInfer(service_pb2.ModelInferRequest(model_name="limited"), timeout=10)
            except grpc.RpcError as error:
                codes.add(error.code())
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes, codes


def test_server_overload_is_429_and_server_unavailable_is_503(mesh: Mesh) -> None:
    try:
        for server in mesh.servers:
            post_faults(server, {"latency_ms": 600})
        with concurrent.futures.ThreadPoolExecutor(4 * MAX_CONCURRENT) as pool:
            answers = list(pool.map(
                lambda _: request(mesh, "POST", "/v2/models/classifier/infer", json_infer_body()),
                range(4 * MAX_CONCURRENT),
            ))  # fmt: skip
        statuses = sorted(status for status, _, _ in answers)
        assert 200 in statuses and 429 in statuses, statuses
        assert set(statuses) == {200, 429}, statuses
        status, headers, body = next(a for a in answers if a[0] == 429)
        assert "max-concurrent-rpcs" in json_error(status, headers, body, 429)
        for server in mesh.servers:
            post_faults(server, {"latency_ms": 0, "error_rate": 1.0})
        status, headers, body = request(
            mesh, "POST", "/v2/models/classifier/infer", json_infer_body()
        )
        assert "injected" in json_error(status, headers, body, 503)  # retried, then answered
    finally:
        for server in mesh.servers:
            post_faults(server, {"latency_ms": 0, "error_rate": 0.0})
    mesh.wait_healthy()


# --- gRPC-Web and CORS ----------------------------------------------------------------------


def grpc_web_frames(body: bytes) -> list[tuple[int, bytes]]:
    frames, pos = [], 0
    while pos < len(body):
        flag, length = struct.unpack(">BI", body[pos : pos + 5])
        frames.append((flag, body[pos + 5 : pos + 5 + length]))
        pos += 5 + length
    assert pos == len(body)
    return frames


@pytest.mark.parametrize("with_header", [True, False])
def test_grpc_web_model_infer(mesh: Mesh, with_header: bool) -> None:
    message = service_pb2.ModelInferRequest(model_name="classifier", model_version="2")
    message.inputs.add(name="input", datatype="FP32", shape=[1, 3, 32, 32])
    message.raw_input_contents.append(images().tobytes())
    payload = message.SerializeToString()
    headers = {
        "content-type": "application/grpc-web+proto", "x-grpc-web": "1",
        "accept": "application/grpc-web+proto", "origin": ORIGIN,
    }  # fmt: skip
    if with_header:
        headers["x-model-name"] = "classifier"
    body = struct.pack(">BI", 0, len(payload)) + payload
    status, answer_headers, answer = request(mesh, "POST", INFER, body, headers)
    assert status == 200 and answer_headers["content-type"].startswith("application/grpc-web")
    assert answer_headers["access-control-allow-origin"] == ORIGIN
    assert "grpc-status" in answer_headers["access-control-expose-headers"]
    (data_flag, data), (trailer_flag, trailer) = grpc_web_frames(answer)
    assert (data_flag, trailer_flag) == (0x00, 0x80)
    trailers = dict(line.split(":", 1) for line in trailer.decode().strip().split("\r\n") if line)
    assert trailers["grpc-status"].strip() == "0", trailers
    response = service_pb2.ModelInferResponse.FromString(data)
    assert response.model_name == "classifier" and response.model_version == "2"
    probs = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(1, 10)
    expected = grpc_infer(mesh, model_version="2").as_numpy("probs")
    np.testing.assert_array_equal(probs, expected)


def test_grpc_web_text_mode_is_body_routed(mesh: Mesh) -> None:
    # application/grpc-web-text: base64 both ways; the grpc_web filter decodes it before the
    # Lua filter reads the model name, so no header is needed here either.
    message = service_pb2.ModelInferRequest(model_name="classifier", model_version="1")
    message.inputs.add(name="input", datatype="FP32", shape=[1, 3, 32, 32])
    message.raw_input_contents.append(images().tobytes())
    payload = message.SerializeToString()
    body = base64.b64encode(struct.pack(">BI", 0, len(payload)) + payload)
    headers = {"content-type": "application/grpc-web-text", "x-grpc-web": "1",
               "accept": "application/grpc-web-text"}  # fmt: skip
    status, answer_headers, answer = request(mesh, "POST", INFER, body, headers)
    assert status == 200 and answer_headers["content-type"].startswith("application/grpc-web-text")
    frames = grpc_web_frames(b"".join(base64.b64decode(part + b"=" * (-len(part) % 4))
                                      for part in answer.split(b"=") if part))  # fmt: skip
    (_, data), (_, trailer) = frames
    assert b"grpc-status:0" in trailer.replace(b" ", b"")
    assert service_pb2.ModelInferResponse.FromString(data).model_version == "1"


def test_grpc_web_error_carries_grpc_status(mesh: Mesh) -> None:
    payload = service_pb2.ModelInferRequest(model_name="nope").SerializeToString()
    headers = {"content-type": "application/grpc-web+proto", "x-grpc-web": "1"}
    body = struct.pack(">BI", 0, len(payload)) + payload
    status, answer_headers, answer = request(mesh, "POST", INFER, body, headers)
    assert status == 200
    grpc_status = answer_headers.get("grpc-status")
    if grpc_status is None:  # in a trailer frame instead of trailers-only headers
        (_, trailer), *_ = [f for f in grpc_web_frames(answer) if f[0] == 0x80]
        grpc_status = trailer.decode().split("grpc-status:")[1].split("\r\n")[0]
    assert grpc_status.strip() == str(grpc.StatusCode.NOT_FOUND.value[0])


def preflight(mesh: Mesh, origin: str) -> tuple[int, dict[str, str]]:
    headers = {
        "origin": origin, "access-control-request-method": "POST",
        "access-control-request-headers": "content-type,x-grpc-web,x-model-name",
    }  # fmt: skip
    status, answer_headers, _ = request(mesh, "OPTIONS", INFER, None, headers)
    return status, answer_headers


def test_cors_preflight_allows_the_configured_origin_only(mesh: Mesh) -> None:
    status, headers = preflight(mesh, ORIGIN)
    assert status == 200
    assert headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in headers["access-control-allow-methods"]
    assert "x-model-name" in headers["access-control-allow-headers"]
    assert headers["access-control-max-age"] == "86400"
    _, headers = preflight(mesh, "https://evil.example")
    assert "access-control-allow-origin" not in headers
    status, headers, _ = request(mesh, "OPTIONS", "/v2/models/classifier/infer", None, {
        "origin": ORIGIN, "access-control-request-method": "POST",
    })  # fmt: skip
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN  # REST too
