"""Hostile and malformed requests: each gets the right status and a message naming the field.

After the whole suite the server still answers valid requests correctly.
"""

from __future__ import annotations

import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from model_server.demo_models import build_identity_model, write_model
from tests.support import ServerProcess, classifier_request, start_server

pytestmark = pytest.mark.integration
Request = service_pb2.ModelInferRequest
MAX_REQUEST_BYTES = 256 * 1024


@pytest.fixture(scope="module")
def server(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repo = tmp_path_factory.mktemp("repo")
    shutil.copytree(demo_repo / "classifier", repo / "classifier")
    write_model(build_identity_model("BYTES", [-1]), repo / "text" / "1" / "model.onnx")
    write_model(build_identity_model("BYTES", [-1, -1]), repo / "texts" / "1" / "model.onnx")
    write_model(build_identity_model("INT8", [-1, 4]), repo / "small_ints" / "1" / "model.onnx")
    write_model(build_identity_model("FP16", [-1, 4]), repo / "halves" / "1" / "model.onnx")
    proc = start_server(
        repo, tmp_path_factory.mktemp("logs"), "--max-request-bytes", str(MAX_REQUEST_BYTES)
    )
    yield proc
    proc.stop()


def good(batch: int = 1) -> service_pb2.ModelInferRequest:
    return classifier_request(np.zeros((batch, 3, 32, 32), dtype=np.float32))


def mutate(
    change: Callable[[service_pb2.ModelInferRequest], None], batch: int = 1
) -> service_pb2.ModelInferRequest:
    request = good(batch)
    change(request)
    return request


def _set_shape(shape: list[int]) -> Callable[[service_pb2.ModelInferRequest], None]:
    def change(r: service_pb2.ModelInferRequest) -> None:
        del r.inputs[0].shape[:]
        r.inputs[0].shape.extend(shape)

    return change


def _add_duplicate(r: service_pb2.ModelInferRequest) -> None:
    r.inputs.append(r.inputs[0])
    r.raw_input_contents.append(r.raw_input_contents[0])


def _typed_and_raw(r: service_pb2.ModelInferRequest) -> None:
    r.inputs[0].contents.fp32_contents.extend([0.0] * 3072)


def _typed_wrong_count(r: service_pb2.ModelInferRequest) -> None:
    del r.raw_input_contents[:]
    r.inputs[0].contents.fp32_contents.extend([0.0] * 100)


def _typed_wrong_field(r: service_pb2.ModelInferRequest) -> None:
    del r.raw_input_contents[:]
    r.inputs[0].contents.int_contents.extend([0] * 3072)


def _classification(r: service_pb2.ModelInferRequest) -> None:
    r.outputs.add(name="probs").parameters["classification"].int64_param = 3


BAD = {
    "unknown model": (
        mutate(lambda r: setattr(r, "model_name", "nope")),
        grpc.StatusCode.NOT_FOUND, ["'nope'", "not loaded"],
    ),
    "unknown version": (
        mutate(lambda r: setattr(r, "model_version", "7")),
        grpc.StatusCode.NOT_FOUND, ["'classifier'", "no version 7"],
    ),
    "version not a number": (
        mutate(lambda r: setattr(r, "model_version", "latest")),
        grpc.StatusCode.INVALID_ARGUMENT, ["'classifier'", "'latest'"],
    ),
    "unknown input": (
        mutate(lambda r: setattr(r.inputs[0], "name", "image")),
        grpc.StatusCode.INVALID_ARGUMENT, ["'classifier'", "no input 'image'", "['input']"],
    ),
    "duplicated input": (
        mutate(_add_duplicate), grpc.StatusCode.INVALID_ARGUMENT,
        ["input 'input'", "more than once"],
    ),
    "missing input": (
        Request(model_name="classifier"),
        grpc.StatusCode.INVALID_ARGUMENT, ["'classifier'", "missing input", "'input'"],
    ),
    "wrong datatype": (
        mutate(lambda r: setattr(r.inputs[0], "datatype", "FP64")),
        grpc.StatusCode.INVALID_ARGUMENT, ["input 'input'", "'FP64'", "FP32"],
    ),
    "not a datatype": (
        mutate(lambda r: setattr(r.inputs[0], "datatype", "FLOAT")),
        grpc.StatusCode.INVALID_ARGUMENT, ["'FLOAT'", "not a KServe v2 datatype"],
    ),
    "wrong rank": (
        mutate(_set_shape([3, 32, 32])),
        grpc.StatusCode.INVALID_ARGUMENT, ["input 'input'", "rank 3", "expected rank 4"],
    ),
    "wrong dim": (
        mutate(_set_shape([1, 3, 32, 31])),
        grpc.StatusCode.INVALID_ARGUMENT, ["input 'input'", "31 at axis 3", "expected 32"],
    ),
    "negative dim": (
        mutate(_set_shape([-1, 3, 32, 32])),
        grpc.StatusCode.INVALID_ARGUMENT, ["input 'input'", "negative"],
    ),
    "batch zero": (
        mutate(_set_shape([0, 3, 32, 32])),
        grpc.StatusCode.INVALID_ARGUMENT, ["input 'input'", "at least 1"],
    ),
    "batch above max_batch_size": (
        mutate(_set_shape([33, 3, 32, 32]), batch=33),
        grpc.StatusCode.INVALID_ARGUMENT, ["batch size 33", "max_batch_size 32"],
    ),
    "raw too short": (
        mutate(lambda r: r.raw_input_contents.__setitem__(0, b"\0" * 12287)),
        grpc.StatusCode.INVALID_ARGUMENT, ["input 'input'", "12287 bytes", "expected 12288"],
    ),
    "raw too long (no silent truncation)": (
        mutate(lambda r: r.raw_input_contents.__setitem__(0, b"\0" * 24576)),
        grpc.StatusCode.INVALID_ARGUMENT, ["24576 bytes", "expected 12288"],
    ),
    "shape says 2, data holds 1 (no broadcast)": (
        mutate(_set_shape([2, 3, 32, 32])),
        grpc.StatusCode.INVALID_ARGUMENT, ["12288 bytes", "expected 24576"],
    ),
    "raw for some inputs only": (
        mutate(lambda r: r.raw_input_contents.append(b"x")),
        grpc.StatusCode.INVALID_ARGUMENT, ["raw_input_contents has 2 entries for 1 inputs"],
    ),
    "typed and raw contents": (
        mutate(_typed_and_raw), grpc.StatusCode.INVALID_ARGUMENT,
        ["contents.fp32_contents is set", "raw_input_contents"],
    ),
    "typed contents wrong count": (
        mutate(_typed_wrong_count), grpc.StatusCode.INVALID_ARGUMENT,
        ["contents.fp32_contents has 100 values", "needs 3072"],
    ),
    "typed contents wrong field": (
        mutate(_typed_wrong_field), grpc.StatusCode.INVALID_ARGUMENT,
        ["contents.int_contents is set", "fp32_contents"],
    ),
    "unknown output": (
        mutate(lambda r: r.outputs.add(name="logits")),
        grpc.StatusCode.INVALID_ARGUMENT, ["no output 'logits'", "['probs']"],
    ),
    "duplicated output": (
        mutate(lambda r: r.outputs.extend([Request.InferRequestedOutputTensor(name="probs")] * 2)),
        grpc.StatusCode.INVALID_ARGUMENT, ["output 'probs' is requested twice"],
    ),
    "classification output": (
        mutate(_classification), grpc.StatusCode.INVALID_ARGUMENT,
        ["'classification' is not supported"],
    ),
    "above the request size limit": (
        good(batch=32), grpc.StatusCode.INVALID_ARGUMENT,
        ["size limit of 0.2 MiB", "--max-request-bytes"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_request_is_refused_with_a_clear_error(server: ServerProcess, case: str) -> None:
    request, code, fragments = BAD[case]
    with pytest.raises(grpc.RpcError) as caught:
        server.stub().ModelInfer(request, timeout=10)
    error = caught.value
    assert error.code() == code, error.details()
    for fragment in fragments:
        assert fragment in error.details()


def _bytes_request(raw: bytes, count: int, model: str = "text") -> service_pb2.ModelInferRequest:
    request = Request(model_name=model)
    shape = [count] if model == "text" else [1, count]  # texts: a batch of one row of count
    request.inputs.add(name="x", datatype="BYTES", shape=shape)
    request.raw_input_contents.append(raw)
    return request


def _framed(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


@pytest.mark.parametrize(
    ("raw", "count", "fragments"),
    [
        (_framed(b"ab") + b"\x05\0", 2, ["length prefix runs past the end"]),
        (_framed(b"ab")[:-1], 1, ["declares 2 bytes but only 1 remain"]),
        (_framed(b"ab", b"cd"), 1, ["left over after 1 elements"]),
        (_framed(b"\xff\xfe"), 1, ["not valid UTF-8"]),
    ],
)
def test_bytes_that_do_not_decode_are_refused(
    server: ServerProcess, raw: bytes, count: int, fragments: list[str]
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        server.stub().ModelInfer(_bytes_request(raw, count), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model 'text' input 'x'" in caught.value.details()
    for fragment in fragments:
        assert fragment in caught.value.details()


def test_many_small_bytes_elements_count_against_the_size_limit(server: ServerProcess) -> None:
    # 80 KB of raw contents, under the 256 KiB limit, but decoding 20,000 elements makes two
    # Python objects each: 64 MiB of such elements once held over 1 GB in a server.
    with pytest.raises(grpc.RpcError) as caught:
        server.stub().ModelInfer(_bytes_request(_framed(*[b""] * 20_000), 20_000, "texts"), 10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "size limit of 0.2 MiB" in caught.value.details()
    assert "each BYTES element counts 128 bytes" in caught.value.details()
    many = [b"%d" % i for i in range(1_000)]  # well within the limit: still served
    response = server.stub().ModelInfer(_bytes_request(_framed(*many), len(many), "texts"), 10)
    assert response.raw_output_contents[0] == _framed(*many)


def test_bytes_round_trip(server: ServerProcess) -> None:
    response = server.stub().ModelInfer(_bytes_request(_framed(b"hello", b"", "é".encode()), 3))
    assert response.outputs[0].datatype == "BYTES"
    assert response.raw_output_contents[0] == _framed(b"hello", b"", "é".encode())


def test_integer_contents_out_of_range_are_refused(server: ServerProcess) -> None:
    request = Request(model_name="small_ints")
    request.inputs.add(name="x", datatype="INT8", shape=[1, 4]).contents.int_contents.extend(
        [1, 2, 300, 4]
    )
    with pytest.raises(grpc.RpcError) as caught:
        server.stub().ModelInfer(request, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the INT8 range [-128, 127]" in caught.value.details()


def test_fp16_needs_raw_contents(server: ServerProcess) -> None:
    request = Request(model_name="halves")
    request.inputs.add(name="x", datatype="FP16", shape=[1, 4]).contents.fp32_contents.extend(
        [1.0] * 4
    )
    with pytest.raises(grpc.RpcError) as caught:
        server.stub().ModelInfer(request, timeout=10)
    assert "FP16 data must be sent in raw_input_contents" in caught.value.details()
    ok = Request(model_name="halves")
    ok.inputs.add(name="x", datatype="FP16", shape=[1, 4])
    ok.raw_input_contents.append(np.arange(4, dtype=np.float16).tobytes())
    response = server.stub().ModelInfer(ok)
    np.testing.assert_array_equal(
        np.frombuffer(response.raw_output_contents[0], np.float16), np.arange(4)
    )


def test_server_still_serves_after_the_suite(server: ServerProcess) -> None:
    x = np.random.default_rng(1).random((1, 3, 32, 32), dtype=np.float32)
    response = server.stub().ModelInfer(classifier_request(x), timeout=10)
    probs = np.frombuffer(response.raw_output_contents[0], dtype=np.float32)
    assert probs.shape == (10,) and abs(float(probs.sum()) - 1) < 1e-5
    assert server.client().is_server_live() and server.proc.poll() is None
