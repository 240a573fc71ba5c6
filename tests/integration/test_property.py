"""Property-based hostile input against a live server (hypothesis).

Random names, datatypes, shapes and byte lengths: the server answers every one with a clear
status, never crashes, and nothing that does not match the model exactly gets through.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from tests.support import ServerProcess, start_server

pytestmark = pytest.mark.integration

DATATYPES = ["FP32", "FP64", "FP16", "INT64", "INT32", "INT8", "UINT8", "BOOL", "BYTES", "fp32", ""]
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
}


@pytest.fixture(scope="module")
def server(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(
        demo_repo, tmp_path_factory.mktemp("logs"), "--models", "classifier",
        "--max-request-bytes", "1MiB",
    )  # fmt: skip
    yield proc
    proc.stop()


@st.composite
def requests(draw: st.DrawFn) -> tuple[service_pb2.ModelInferRequest, bool]:
    """A request near the valid one, and whether it is exactly valid (the oracle)."""
    model = draw(st.sampled_from(["classifier", "classifier", "Classifier", "", "x" * 300]))
    version = draw(st.sampled_from(["", "", "1", "2", "3", "0", "-1", "01x"]))
    name = draw(st.sampled_from(["input", "input", "input", "probs", "", "inp\u00fct"]))
    datatype = draw(st.sampled_from(DATATYPES[:2] + DATATYPES))
    rank = draw(st.sampled_from([4, 4, 4, 0, 1, 3, 5]))
    shape = [draw(st.sampled_from([1, 2, 3, 32, 0, 33, 31, 2**31, 2**62])) for _ in range(rank)]
    if rank == 4 and draw(st.booleans()):
        shape[1:] = [3, 32, 32]
        shape[0] = draw(st.integers(min_value=-2, max_value=40))
    valid_shape = rank == 4 and shape[1:] == [3, 32, 32] and 1 <= shape[0] <= 32
    exact = 4 * math.prod(shape) if valid_shape else draw(st.integers(0, 20000))
    length = draw(st.sampled_from([exact, exact, exact - 1, exact + 4, 0, 4]))
    length = max(0, min(length, 600_000))
    request = service_pb2.ModelInferRequest(model_name=model, model_version=version)
    tensor = request.inputs.add(name=name, datatype=datatype)
    tensor.shape.extend(shape)
    request.raw_input_contents.append(b"\x3f" * length)
    if draw(st.integers(0, 9)) == 0:
        request.inputs.append(request.inputs[0])
        request.raw_input_contents.append(request.raw_input_contents[0])
    valid = (
        model == "classifier"
        and version in {"", "1", "2"}
        and name == "input"
        and datatype == "FP32"
        and valid_shape
        and length == 4 * math.prod(shape)
        and len(request.inputs) == 1
    )
    return request, valid


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=requests())
def test_nothing_invalid_gets_through_and_nothing_crashes(
    server: ServerProcess, case: tuple[service_pb2.ModelInferRequest, bool]
) -> None:
    request, valid = case
    stub = server.stub()
    try:
        response = stub.ModelInfer(request, timeout=10)
        code = grpc.StatusCode.OK
    except grpc.RpcError as error:
        code = error.code()
        assert error.details(), "an error must say what was wrong"
    assert code in ALLOWED, f"{code} for {request.inputs[0].name!r} {list(request.inputs[0].shape)}"
    if valid:
        assert code == grpc.StatusCode.OK
        assert len(response.raw_output_contents[0]) == 40 * request.inputs[0].shape[0]
    else:
        assert code != grpc.StatusCode.OK, "an invalid request got through"


def test_server_survived(server: ServerProcess) -> None:
    assert server.proc.poll() is None
    assert server.client().is_server_ready()
