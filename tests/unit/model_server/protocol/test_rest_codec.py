"""REST body <-> ModelInferRequest/Response conversion, table-driven, checked against
tritonclient.http's own encoder and decoder."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2
from tritonclient.http._utils import _get_inference_request

from model_server.core.datatypes import DATATYPES, deserialize_bytes, serialize_bytes
from model_server.core.errors import InvalidInput
from model_server.protocol.rest_codec import (
    RestInferRequest,
    decode_infer,
    encode_infer,
    header_length,
    message_json,
)

SAMPLES: dict[str, list[Any]] = {
    "BOOL": [True, False, True, True, False, False],
    "UINT8": [0, 1, 2, 3, 254, 255],
    "UINT16": [0, 1, 2, 3, 65534, 65535],
    "UINT32": [0, 1, 2, 3, 4, 2**32 - 1],
    "UINT64": [0, 1, 2, 3, 4, 2**64 - 1],
    "INT8": [-128, -1, 0, 1, 2, 127],
    "INT16": [-32768, -1, 0, 1, 2, 32767],
    "INT32": [-(2**31), -1, 0, 1, 2, 2**31 - 1],
    "INT64": [-(2**63), -1, 0, 1, 2, 2**63 - 1],
    "FP16": [-1.5, 0.0, 0.25, 1.0, 2.0, 65504.0],
    "FP32": [-1.5, 0.0, 0.1, 1.0, 2.0, 3e38],
    "FP64": [-1.5, 0.0, 0.1, 1.0, 2.0, 1e308],
    "BYTES": ["a", "", "w\u00f6rld", "4", "five", "6"],
}


def expected_raw(datatype: str, values: list[Any]) -> bytes:
    if datatype == "BYTES":
        return serialize_bytes(np.array(values, dtype=object))
    return np.array(values, dtype=DATATYPES[datatype].numpy).tobytes()


def body(inputs: list[Any], **extra: Any) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


@pytest.mark.parametrize("datatype", sorted(SAMPLES))
@pytest.mark.parametrize(
    ("shape", "nest"),
    [
        ([6], lambda v: v),
        ([2, 3], lambda v: [v[:3], v[3:]]),
        ([1, 2, 3], lambda v: [[v[:3], v[3:]]]),
    ],
    ids=["flat", "nested", "deep"],
)
def test_json_data_becomes_raw_contents(datatype: str, shape: list[int], nest: Any) -> None:
    values = SAMPLES[datatype]
    tensor = {"name": "x", "shape": shape, "datatype": datatype, "data": nest(values)}
    decoded = decode_infer(body([tensor]), None, "m", "3")
    request = decoded.request
    assert (request.model_name, request.model_version) == ("m", "3")
    assert list(request.inputs[0].shape) == shape and request.inputs[0].datatype == datatype
    assert request.raw_input_contents[0] == expected_raw(datatype, values)


@pytest.mark.parametrize("datatype", sorted(SAMPLES))
@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_encoding_decodes_to_the_same_tensor(datatype: str, binary: bool) -> None:
    values = SAMPLES[datatype]
    if datatype == "BYTES":
        array = np.array([v.encode() for v in values], dtype=object).reshape(2, 3)
    else:
        array = np.array(values, dtype=DATATYPES[datatype].numpy).reshape(2, 3)
    first = httpclient.InferInput("a", [2, 3], datatype)
    first.set_data_from_numpy(array, binary_data=binary)
    second = httpclient.InferInput("b", [1], "INT32")
    second.set_data_from_numpy(np.array([7], dtype=np.int32), binary_data=True)
    outputs = [httpclient.InferRequestedOutput("y", binary_data=binary)]
    payload, json_size = _get_inference_request(
        [first, second], "req", outputs, 0, False, False, 5, 1000, {"custom": "v"}
    )
    decoded = decode_infer(payload, header_length(_str(json_size), len(payload)), "m", "")
    request = decoded.request
    assert request.id == "req"
    assert request.raw_input_contents[0] == expected_raw(datatype, values)
    assert request.raw_input_contents[1] == np.array([7], dtype=np.int32).tobytes()
    assert request.parameters["priority"].int64_param == 5
    assert request.parameters["timeout"].int64_param == 1000
    assert request.parameters["custom"].string_param == "v"
    assert decoded.binary_outputs == {"y": binary} and [o.name for o in request.outputs] == ["y"]


def _str(value: int | None) -> str | None:
    return None if value is None else str(value)


def _response(datatype: str, values: list[Any]) -> service_pb2.ModelInferResponse:
    response = service_pb2.ModelInferResponse(model_name="m", model_version="1", id="r")
    response.outputs.add(name="y", datatype=datatype, shape=[2, 3])
    response.outputs.add(name="z", datatype="FP32", shape=[1])
    response.raw_output_contents.extend(
        [expected_raw(datatype, values), np.array([0.5], np.float32).tobytes()]
    )
    return response


@pytest.mark.parametrize("datatype", sorted(SAMPLES))
@pytest.mark.parametrize(
    ("default", "per_output"),
    [(False, {}), (True, {}), (False, {"y": True}), (True, {"z": False})],
    ids=["json", "binary_data_output", "one-binary", "one-json"],
)
def test_answers_decode_in_tritonclient(
    datatype: str, default: bool, per_output: dict[str, bool]
) -> None:
    values = SAMPLES[datatype]
    decoded = RestInferRequest(service_pb2.ModelInferRequest(), default, per_output)
    payload, json_size = encode_infer(_response(datatype, values), decoded)
    binary = [name for name in ("y", "z") if per_output.get(name, default)]
    assert (json_size is None) == (not binary)
    result = httpclient.InferResult.from_response_body(payload, header_length=json_size)
    got = result.as_numpy("y")
    assert got.shape == (2, 3) and result.get_response()["id"] == "r"
    if datatype == "BYTES":
        flat = [v.decode() if isinstance(v, bytes) else v for v in got.reshape(-1)]
        assert flat == values
    else:
        want = np.array(values, dtype=DATATYPES[datatype].numpy).reshape(2, 3)
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(result.as_numpy("z"), np.array([0.5], np.float32))
    entries = {o["name"]: o for o in result.get_response()["outputs"]}
    for name in ("y", "z"):
        assert ("parameters" in entries[name]) == (name in binary)


def test_binary_offsets_follow_input_order() -> None:
    inputs = [
        {"name": "a", "shape": [2], "datatype": "INT32", "parameters": {"binary_data_size": 8}},
        {"name": "b", "shape": [1], "datatype": "FP32", "data": [1.0]},
        {"name": "c", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": 7}},
        {"name": "d", "shape": [0], "datatype": "UINT8", "parameters": {"binary_data_size": 0}},
    ]
    header = body(inputs)
    tail = np.array([1, 2], np.int32).tobytes() + serialize_bytes(np.array([b"abc"], object))
    request = decode_infer(header + tail, len(header), "m", "").request
    assert request.raw_input_contents[0] == np.array([1, 2], np.int32).tobytes()
    assert request.raw_input_contents[1] == np.array([1.0], np.float32).tobytes()
    assert list(deserialize_bytes(request.raw_input_contents[2], 1)) == [b"abc"]
    assert request.raw_input_contents[3] == b""


X = {"name": "x", "shape": [2], "datatype": "INT8", "data": [1, 2]}
BAD: dict[str, tuple[bytes, int | None, list[str]]] = {
    "not JSON": (b"{", None, ["not valid JSON"]),
    "not UTF-8": (b"\xff\xfe{}", None, ["request body"]),
    "lone surrogate": (b'{"id": "\\ud800"}', None, ["id:", "lone UTF-16 surrogate"]),
    "lone surrogate in data": (
        body([{**X, "datatype": "BYTES", "shape": [1], "data": ["ok\udc00"]}]), None,
        ["inputs[0].data[0]", "lone UTF-16 surrogate"]),
    "top level a list": (b"[]", None, ["request body", "JSON object"]),
    "id a number": (body([X], id=3), None, ["id", "string"]),
    "parameters a list": (body([X], parameters=[1]), None, ["parameters", "object"]),
    "parameter an object": (body([X], parameters={"p": {}}), None, ["parameters.p"]),
    "binary_data_output not bool": (
        body([X], parameters={"binary_data_output": 1}), None, ["binary_data_output"]),
    "no inputs": (b"{}", None, ["inputs", "list"]),
    "input not an object": (body([3]), None, ["inputs[0]", "object"]),
    "input without name": (body([{**X, "name": None}]), None, ["inputs[0].name"]),
    "negative dim": (body([{**X, "shape": [-2]}]), None, ["shape", "integers in 0..2147483647"]),
    "bool dim": (body([{**X, "shape": [True]}]), None, ["shape"]),
    "BF16": (body([{**X, "datatype": "BF16"}]), None, ["'BF16'", "not a supported"]),
    "count mismatch": (body([{**X, "data": [1, 2, 3]}]), None, ["data has 3 values", "needs 2"]),
    "out of range": (body([{**X, "data": [1, 300]}]), None, ["outside the INT8 range"]),
    "floats for ints": (body([{**X, "data": [1.5, 2]}]), None, ["INT8 takes integers"]),
    "numbers for BOOL": (body([{**X, "datatype": "BOOL", "data": [1, 0]}]), None, ["true/false"]),
    "numbers for BYTES": (body([{**X, "datatype": "BYTES"}]), None, ["must be strings"]),
    "null inside data": (body([{**X, "data": [1, None]}]), None, ["data", "null"]),
    "data not a list": (body([{**X, "data": 5}]), None, ["data", "list"]),
    "data and binary": (
        body([{**X, "parameters": {"binary_data_size": 2}}]), None, ["both data"]),
    "binary size negative": (
        body([{"name": "x", "shape": [2], "datatype": "INT8",
               "parameters": {"binary_data_size": -1}}]), None, ["binary_data_size", ">= 0"]),
    "binary past the end": (
        body([{"name": "x", "shape": [2], "datatype": "INT8",
               "parameters": {"binary_data_size": 5}}]) + b"ab", -2, ["5 bytes", "only 2"]),
    "binary left over": (
        body([{"name": "x", "shape": [2], "datatype": "INT8",
               "parameters": {"binary_data_size": 1}}]) + b"ab", -2, ["add up to 1", "2 bytes"]),
    "output without name": (body([X], outputs=[{}]), None, ["outputs[0].name"]),
    # Each of these was an uncaught ValueError or OverflowError: HTTP 500 and a stack trace.
    "5000-digit integer": (b'{"id": "a", "x": ' + b"9" * 5000 + b"}", None,
                           ["request body", "4300"]),
    "shape past 64 bits": (body([{**X, "shape": [2**64]}]), None,
                           ["('x').shape", "integers in 0..2147483647"]),
    "parameter past 64 bits": (body([{**X, "parameters": {"p": 2**65}}]), None,
                               ["('x').parameters.p", "must fit 64 bits"]),
    "negative parameter past 64 bits": (body([X], parameters={"p": -(2**64)}), None,
                                        ["parameters.p", "must fit 64 bits"]),
    "FP32 beyond any float": (
        body([{**X, "datatype": "FP32", "shape": [1], "data": [10**400]}]), None,
        ["('x').data", "too large for any floating-point type"]),
    "binary_data not bool": (
        body([X], outputs=[{"name": "y", "parameters": {"binary_data": "yes"}}]), None,
        ["outputs[0].parameters.binary_data"]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_bodies_name_the_field(case: str) -> None:
    payload, json_length, fragments = BAD[case]
    if json_length is not None and json_length < 0:  # that many bytes of binary data at the end
        json_length = len(payload) + json_length
    with pytest.raises(InvalidInput) as caught:
        decode_infer(payload, json_length, "m", "")
    for fragment in fragments:
        assert fragment in caught.value.message, caught.value.message


@pytest.mark.parametrize(
    ("value", "size", "expected"),
    [(None, 10, None), ("0", 10, 0), ("10", 10, 10), (" 4 ", 10, 4)],
)
def test_header_length(value: str | None, size: int, expected: int | None) -> None:
    assert header_length(value, size) == expected


@pytest.mark.parametrize("value", ["11", "-1", "x", "", "1e3", "\u00b2"])  # "²": a digit to isdigit
def test_bad_header_length(value: str) -> None:
    with pytest.raises(InvalidInput, match="Inference-Header-Content-Length"):
        header_length(value, 10)


def test_message_json_prints_64_bit_integers_as_numbers() -> None:
    stats = service_pb2.ModelStatisticsResponse()
    entry = stats.model_stats.add(name="m", version="1", inference_count=2**40)
    entry.inference_stats.success.count = 3
    entry.batch_stats.add(batch_size=4)
    document = message_json(stats)
    model = document["model_stats"][0]
    assert model["version"] == "1" and model["inference_count"] == 2**40
    assert model["inference_stats"]["success"] == {"count": 3, "ns": 0}
    assert model["batch_stats"][0]["batch_size"] == 4
    metadata = service_pb2.ModelMetadataResponse(name="m")
    metadata.inputs.add(name="x", datatype="FP32", shape=[-1, 3])
    assert message_json(metadata)["inputs"][0]["shape"] == [-1, 3]
