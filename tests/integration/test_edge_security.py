"""The public listener is safe to expose: through the real Envoy, configured over xDS by the
control plane, no client can reach a model-control API, whatever path, method, header or body
it sends, and headers a client must not control are gone before routing.

The model servers here (tests/edge_mesh_support.py) run in ``explicit`` mode with no
restriction of their own, the worst case: anything that reached them would be obeyed. Their
own counter
``model_control_requests_total{call="load"|"unload"}`` proves that nothing did.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import string
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from tests.edge_mesh_support import EdgeMesh as Mesh
from tests.edge_mesh_support import edge_mesh, image_input, rest
from tests.support import post_faults, wait_for

pytestmark = pytest.mark.integration
OFFSET = 2000
GRPC = "/inference.GRPCInferenceService/"
CONTROL_METHODS = ("RepositoryModelLoad", "RepositoryModelUnload")
NEVER = (
    *CONTROL_METHODS,
    "SystemSharedMemoryRegister",
    "SystemSharedMemoryStatus",
    "CudaSharedMemoryRegister",
    "TraceSetting",
    "LogSettings",
)
OPERATOR_ONLY = ("RepositoryIndex", "ModelStatistics", "ModelConfig")


@pytest.fixture(scope="module")
def mesh(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with edge_mesh(demo_repo, tmp_path_factory.mktemp("edge-security"), {}) as the_mesh:
        yield the_mesh


# --- the findings of issue 25, each closed ------------------------------------------------------


@pytest.mark.parametrize("header", [True, False], ids=["with-model-header", "header-less"])
def test_grpc_unload_and_load_through_the_edge_are_refused(mesh: Mesh, header: bool) -> None:
    client = grpcclient.InferenceServerClient(mesh.url)
    headers = {"x-model-name": "classifier"} if header else None
    before = mesh.control_calls()
    for attempt in range(6):  # six unloads once took the model off all three servers
        for call in (
            lambda: client.unload_model("classifier", headers=headers),
            lambda: client.load_model(
                "classifier", headers=headers, config='{"max_batch_size": 1}'
            ),
        ):
            with pytest.raises(InferenceServerException) as caught:
                call()
            assert caught.value.status() == "StatusCode.PERMISSION_DENIED", attempt
            assert "is not exposed on this listener" in caught.value.message()
            assert "RepositoryModel" in caught.value.message()
    assert mesh.control_calls() == before
    assert mesh.all_ready()
    assert client.infer("classifier", [image_input()]).as_numpy("probs").shape == (1, 10)


@pytest.mark.parametrize("header", [True, False], ids=["with-model-header", "header-less"])
def test_rest_repository_calls_through_the_edge_answer_403_json(mesh: Mesh, header: bool) -> None:
    headers = {"x-model-name": "classifier"} if header else {}
    before = mesh.control_calls()
    for path in (
        "/v2/repository/models/classifier/unload",
        "/v2/repository/models/classifier/load",
        "/v2/repository/index",
        "/v2//repository/models/classifier/unload",
        "/v2/./repository/models/classifier/unload",
        "/v2/models/classifier/../../repository/models/classifier/unload",
        "/v2/%72epository/models/classifier/unload",
        "/v2/repository/models/classifier/unload?x=1",
    ):
        status, answer_headers, body = rest(mesh, "POST", path, b"{}", headers)
        assert status == 403, (path, body)
        assert answer_headers["content-type"] == "application/json", path
        assert "is not exposed on this listener" in json.loads(body)["error"], path
    status, _, _ = rest(mesh, "POST", "/v2/repository%2Fmodels/classifier/unload")
    assert status == 400  # escaped slashes are refused outright
    assert mesh.control_calls() == before
    assert mesh.all_ready()
    http_client = httpclient.InferenceServerClient(mesh.url)
    probs = http_client.infer("classifier", [image_input(httpclient)]).as_numpy("probs")
    assert probs.shape == (1, 10)


def test_never_exposed_and_operator_only_grpc_apis_are_refused(mesh: Mesh) -> None:
    before = mesh.control_calls()
    with grpc.insecure_channel(mesh.url) as channel:
        for method in (*NEVER, *OPERATOR_ONLY):
            call = channel.unary_unary(GRPC + method)
            for metadata in ((), (("x-model-name", "classifier"),)):
                with pytest.raises(grpc.RpcError) as caught:
                    call(b"", metadata=metadata, timeout=10)
                assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, method
                assert GRPC + method in (caught.value.details() or "")
    assert mesh.control_calls() == before


def test_the_default_exposure_serves_inference_metadata_and_health(mesh: Mesh) -> None:
    client = grpcclient.InferenceServerClient(mesh.url)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("classifier", headers={"x-model-name": "classifier"})
    assert client.get_model_metadata("classifier").name == "classifier"
    assert client.get_server_metadata().name
    result = client.infer("classifier", [image_input()], headers={"x-model-name": "classifier"})
    assert result.as_numpy("probs").shape == (1, 10)
    for path, code in (
        ("/v2/health/ready", 200),
        ("/v2/health/live", 200),
        ("/v2", 200),
        ("/v2/models/classifier", 200),
        ("/v2/models/classifier/versions/1/ready", 200),
        ("/v2/models/classifier/config", 403),
        ("/v2/models/classifier/stats", 403),
        ("/v2/models/stats", 403),
        ("/metrics", 403),
        ("/config_dump", 403),  # Envoy's admin: loopback-only, never behind the listener
        ("/quitquitquit", 403),
    ):
        status, _, body = rest(mesh, "GET", path)
        assert status == code, (path, body)


def test_client_set_mesh_and_envoy_headers_are_stripped_at_the_edge(mesh: Mesh) -> None:
    """A client naming a fallback (x-infermesh-fallback) would be served a model it did not
    ask for, one naming its tenant (x-infermesh-tenant*) would be counted, and allowed, as
    that tenant; a client setting x-envoy-upstream-rq-timeout-ms would choose Envoy's
    timeout."""
    with grpc.insecure_channel(mesh.url) as channel:
        infer = channel.unary_unary(
            GRPC + "ModelInfer",
            request_serializer=service_pb2.ModelInferRequest.SerializeToString,
            response_deserializer=service_pb2.ModelInferResponse.FromString,
        )
        request = service_pb2.ModelInferRequest(model_name="absent-model")
        metadata = (("x-model-name", "classifier"), ("x-infermesh-fallback", "classifier"))
        with pytest.raises(grpc.RpcError) as caught:
            infer(request, metadata=metadata, timeout=10)
        # Not the classifier's answer: the header and the body must name one model.
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    forged = {"x-infermesh-tenant": "forged", "x-infermesh-tenant-label": "forged",
              "x-infermesh-priority": "allowed"}  # fmt: skip
    grpcclient.InferenceServerClient(mesh.url).infer("classifier", [image_input()],
                                                     headers=forged)  # fmt: skip

    # Authentication is off here: the servers saw no tenant at all.
    assert mesh.served_for("forged") == mesh.served_for("other") == 0
    assert mesh.served_for("anonymous") >= 1
    try:
        for server in mesh.servers:
            post_faults(server, {"latency_ms": 300})
        client = grpcclient.InferenceServerClient(mesh.url)
        headers = {"x-envoy-upstream-rq-timeout-ms": "20", "x-envoy-max-retries": "0"}
        result = client.infer("classifier", [image_input()], headers=headers)
        assert result.as_numpy("probs").shape == (1, 10)  # Envoy's own timeout held
    finally:
        for server in mesh.servers:
            post_faults(server, {"latency_ms": 0})


# --- a property: nothing a client sends reaches model control --------------------------------

_SEGMENT = st.text(string.ascii_letters + string.digits + "._-%~", min_size=0, max_size=12)
_CONTROL_PATHS = [  # loads and unloads twice: they are what must never get through
    *(GRPC + m for m in (*NEVER, *CONTROL_METHODS)),
    GRPC + "RepositoryIndex",
    "/v2/repository/index",
    *["/v2/repository/models/classifier/load", "/v2/repository/models/classifier/unload"] * 2,
]


@st.composite
def hostile_paths(draw: st.DrawFn) -> str:
    base = draw(st.sampled_from(_CONTROL_PATHS))
    mutation = draw(st.sampled_from(
        ["none"] * 4
        + ["case", "double-slash", "dot", "dotdot", "encode", "query", "suffix", "random"]
    ))  # fmt: skip
    if mutation == "case":
        return "".join(c.swapcase() if draw(st.booleans()) else c for c in base)
    if mutation == "double-slash":
        return base.replace("/", "//", draw(st.integers(1, 3)))
    if mutation == "dot":
        return base.replace("/", "/./", 1)
    if mutation == "dotdot":
        return "/v2/models/classifier/../.." + base
    if mutation == "encode":
        index = draw(st.integers(1, len(base) - 1))
        return base[:index] + f"%{ord(base[index]):02X}" + base[index + 1 :]
    if mutation == "query":
        return base + "?" + draw(_SEGMENT)
    if mutation == "suffix":
        return base + draw(st.sampled_from(["/", ";x", "%00", "/.", "/..", "#"]))
    if mutation == "random":
        return "/" + "/".join(draw(st.lists(_SEGMENT, min_size=1, max_size=5)))
    return base


_HEADER_NAMES = st.sampled_from([
    "x-model-name", "x-model-version", "x-infermesh-fallback", "x-priority", ":authority",
    "x-envoy-original-path", "x-http-method-override", "x-original-url", "content-type",
])  # fmt: skip
_HEADER_VALUES = st.sampled_from(["classifier", "1", "application/grpc", "POST", "/v2/repository"])


# Well-formed control requests as often as noise: a call that got through must be obeyed.
UNLOAD = service_pb2.RepositoryModelUnloadRequest(model_name="classifier").SerializeToString()
LOAD = service_pb2.RepositoryModelLoadRequest(model_name="classifier").SerializeToString()
_BODIES = st.one_of(st.sampled_from([UNLOAD, LOAD, b'{"parameters": {}}']), st.binary(max_size=64))


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@example(GRPC + "RepositoryModelUnload", True, "POST", True, {}, UNLOAD)
@example("/v2/repository/models/classifier/unload", False, "POST", False, {}, b"")
@given(
    path=hostile_paths(),
    grpc_call=st.booleans(),
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
    model_header=st.booleans(),
    headers=st.dictionaries(_HEADER_NAMES, _HEADER_VALUES, max_size=4),
    body=_BODIES,
)
def test_no_client_request_reaches_model_control(
    mesh: Mesh,
    path: str,
    grpc_call: bool,
    method: str,
    model_header: bool,
    headers: dict[str, str],
    body: bytes,
) -> None:
    before = mesh.control_calls()
    headers.pop(":authority", None)
    if model_header:
        headers["x-model-name"] = "classifier"
    if grpc_call and path.startswith("/") and "#" not in path and "%00" not in path:
        with grpc.insecure_channel(mesh.url) as channel:
            metadata = tuple((k, v) for k, v in headers.items() if k != "content-type")
            with contextlib.suppress(grpc.RpcError):
                channel.unary_unary(path)(body, metadata=metadata, timeout=10)
    else:
        with contextlib.suppress(http.client.HTTPException, OSError):
            rest(mesh, method, path, body, headers)
    assert mesh.control_calls() == before, path


def test_after_the_property_every_server_still_serves(mesh: Mesh) -> None:
    assert mesh.control_calls() == 0
    assert mesh.all_ready()


def test_envoy_counts_each_refusal(mesh: Mesh) -> None:
    denied = "http.infermesh.rbac.exposure.denied"
    before = mesh.envoy.counter(denied)
    status, _, _ = rest(mesh, "POST", "/v2/repository/index")
    assert status == 403
    wait_for(lambda: mesh.envoy.counter(denied) == before + 1, 10, "the RBAC denial counted")
