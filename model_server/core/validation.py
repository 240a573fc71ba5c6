"""Checks every ModelInfer request against the model's declared inputs, and encodes answers.

Nothing reaches ONNX Runtime that does not match the model exactly: input names, datatypes,
rank and every fixed dim, the batch limit, the byte length of raw contents and the element
count of typed contents. Errors name the model, the input and what was expected.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2

from infermesh.wire import PRIORITY_HEADER
from model_server.core.datatypes import (
    CONTENTS_FIELDS,
    DATATYPES,
    Datatype,
    deserialize_bytes,
    serialize_bytes,
    to_onnx_strings,
)
from model_server.core.errors import InvalidInput
from model_server.core.memory import format_bytes
from model_server.core.model_config import ModelSpec, TensorSpec

UNSUPPORTED_OUTPUT_PARAMETERS = ("classification",)
# A request whose decoding is Python work per element (BYTES tensors) past this many bytes is
# decoded on a worker thread: 64 MiB of empty strings took seconds, the event loop (every other
# request, stream and health check) stalled behind it. Numeric tensors decode in place.
OFFLOAD_DECODE_BYTES = 256 << 10
# What one decoded BYTES element costs beyond its data, counted against --max-request-bytes:
# decoding makes a bytes and a str object per element and two array slots (98 bytes measured
# with tracemalloc on CPython 3.11), so 64 MiB of 4-byte empty elements held over 1 GB.
BYTES_ELEMENT_COST = 128


def slow_to_decode(request: service_pb2.ModelInferRequest) -> bool:
    """Whether decoding ``request`` should leave the event loop (OFFLOAD_DECODE_BYTES)."""
    if not any(t.datatype == "BYTES" for t in request.inputs):
        return False
    size = sum(len(part) for part in request.raw_input_contents)
    size += sum(len(t.contents.bytes_contents) for t in request.inputs)  # one per element
    return size > OFFLOAD_DECODE_BYTES


def is_decimal(text: str) -> bool:
    """Whether ``text`` is ASCII digits only: ``str.isdigit`` alone takes "²", which ``int``
    refuses."""
    return text.isascii() and text.isdigit()


# The longest axis a request may claim (int32): a longer one can only come with an empty tensor
# (another dim 0), which numpy then refuses to shape ("array is too big").
MAX_DIM = (1 << 31) - 1


@dataclass(frozen=True)
class DecodedRequest:
    feeds: dict[str, np.ndarray]  # ready for ONNX Runtime
    outputs: list[str]  # the outputs to compute, in answer order
    batch: int  # samples in the request (1 for a model without batching)


def decode_request(
    request: service_pb2.ModelInferRequest, spec: ModelSpec, max_request_bytes: int
) -> DecodedRequest:
    model = f"model {spec.name!r}"
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidInput(
            f"{model}: raw_input_contents has {len(raw)} entries for {len(request.inputs)} "
            "inputs; send raw contents for every input or for none"
        )
    feeds: dict[str, np.ndarray] = {}
    batch_sizes: dict[str, int] = {}
    total_bytes = 0
    charged_elements = False  # a BYTES tensor's elements are in total_bytes
    for index, tensor in enumerate(request.inputs):
        where = f"{model} input {tensor.name!r}"
        if tensor.name in feeds:
            raise InvalidInput(f"{where} appears more than once")
        declared = spec.input_named(tensor.name)
        if declared is None:
            expected = [t.name for t in spec.inputs]
            raise InvalidInput(f"{model} has no input {tensor.name!r} (expected {expected})")
        shape = _check_shape(tensor, declared, spec.max_batch_size, where)
        datatype = _check_datatype(tensor.datatype, declared, where)
        if spec.max_batch_size > 0:
            batch_sizes[tensor.name] = shape[0]
        count = math.prod(shape)  # Python ints: a hostile shape cannot overflow
        if datatype.is_bytes:  # charged before decoding makes the objects
            total_bytes += count * BYTES_ELEMENT_COST
            charged_elements = True
            _check_size(total_bytes, max_request_bytes, model, charged_elements)
        if raw:
            total_bytes += len(raw[index])
            _check_size(total_bytes, max_request_bytes, model, charged_elements)
            _check_no_typed_contents(tensor, where, "raw_input_contents are used")
            array = _from_raw(raw[index], datatype, shape, count, where)
        else:
            array = _from_contents(tensor, datatype, shape, count, where)
            total_bytes += array.nbytes if datatype.itemsize else sum(len(x) for x in array.flat)
            _check_size(total_bytes, max_request_bytes, model, charged_elements)
        feeds[tensor.name] = _onnx_ready(array, where)
    missing = [t.name for t in spec.inputs if t.name not in feeds and not t.optional]
    if missing:
        raise InvalidInput(f"{model}: missing input(s) {missing}")
    if len(set(batch_sizes.values())) > 1:
        raise InvalidInput(f"{model}: inputs disagree on the batch size: {batch_sizes}")
    batch = next(iter(batch_sizes.values()), 1)
    return DecodedRequest(feeds, _requested_outputs(request, spec, model), batch)


def _check_datatype(name: str, declared: TensorSpec, where: str) -> Datatype:
    if name != declared.datatype.name:
        known = "" if name in DATATYPES else " (not a KServe v2 datatype)"
        raise InvalidInput(
            f"{where}: datatype {name!r}{known} does not match the model's {declared.datatype.name}"
        )
    return declared.datatype


def _check_shape(
    tensor: service_pb2.ModelInferRequest.InferInputTensor,
    declared: TensorSpec,
    max_batch_size: int,
    where: str,
) -> list[int]:
    shape = list(tensor.shape)
    expected = declared.shape_with_batch(max_batch_size)
    # The usual request: every fixed dim as declared and a batch in range (a declared dim that
    # is -1 never compares equal to a sent one, so such a model takes the full check below).
    if -1 not in shape:  # a sent -1 would equal a declared dynamic dim
        if max_batch_size > 0:
            if shape and shape[1:] == expected[1:] and 1 <= shape[0] <= max_batch_size:
                return shape
        elif shape == expected:
            return shape
    if len(shape) != len(expected):
        raise InvalidInput(
            f"{where}: shape {shape} has rank {len(shape)}, expected rank {len(expected)} "
            f"{expected}"
        )
    for axis, (got, want) in enumerate(zip(shape, expected, strict=True)):
        if got < 0:
            raise InvalidInput(f"{where}: shape {shape} has a negative dim at axis {axis}")
        if got > MAX_DIM:
            raise InvalidInput(
                f"{where}: shape {shape} has {got} at axis {axis}, more than any tensor this "
                f"server takes ({MAX_DIM})"
            )
        if want != -1 and got != want:
            raise InvalidInput(f"{where}: shape {shape} has {got} at axis {axis}, expected {want}")
    if max_batch_size > 0:
        if shape[0] < 1:
            raise InvalidInput(f"{where}: batch size must be at least 1, got {shape[0]}")
        if shape[0] > max_batch_size:
            raise InvalidInput(
                f"{where}: batch size {shape[0]} exceeds the model's max_batch_size "
                f"{max_batch_size}"
            )
    return shape


def _check_size(total: int, limit: int, model: str, bytes_elements: bool = False) -> None:
    if total > limit:
        each = f"; each BYTES element counts {BYTES_ELEMENT_COST} bytes" if bytes_elements else ""
        raise InvalidInput(
            f"{model}: request tensors exceed the size limit of {format_bytes(limit)} "
            f"(--max-request-bytes{each})"
        )


def _check_no_typed_contents(
    tensor: service_pb2.ModelInferRequest.InferInputTensor, where: str, why: str
) -> None:
    if not tensor.HasField("contents"):
        return
    filled = [f for f in CONTENTS_FIELDS if len(getattr(tensor.contents, f))]
    if filled:
        raise InvalidInput(f"{where}: contents.{filled[0]} is set but {why}")


def _from_raw(
    data: bytes, datatype: Datatype, shape: list[int], count: int, where: str
) -> np.ndarray:
    if datatype.is_bytes:
        try:
            return deserialize_bytes(data, count).reshape(shape)
        except ValueError as exc:
            raise InvalidInput(f"{where}: BYTES raw contents do not decode: {exc}") from exc
    expected = count * datatype.itemsize
    if len(data) != expected:
        raise InvalidInput(
            f"{where}: raw contents are {len(data)} bytes, expected {expected} "
            f"(shape {shape} x {datatype.itemsize} bytes of {datatype.name})"
        )
    return np.frombuffer(data, dtype=datatype.numpy).reshape(shape)


def _from_contents(
    tensor: service_pb2.ModelInferRequest.InferInputTensor,
    datatype: Datatype,
    shape: list[int],
    count: int,
    where: str,
) -> np.ndarray:
    field = datatype.contents_field
    if field is None:
        raise InvalidInput(f"{where}: {datatype.name} data must be sent in raw_input_contents")
    others = [f for f in CONTENTS_FIELDS if f != field and len(getattr(tensor.contents, f))]
    if others:
        raise InvalidInput(f"{where}: contents.{others[0]} is set, {datatype.name} uses {field}")
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise InvalidInput(
            f"{where}: contents.{field} has {len(values)} values, shape {shape} needs {count}"
        )
    if datatype.is_bytes:
        array = np.empty(count, dtype=object)
        array[:] = list(values)
        return array.reshape(shape)
    if datatype.numpy.kind in "iu":
        wide = np.array(values, dtype=np.int64 if datatype.numpy.kind == "i" else np.uint64)
        info = np.iinfo(datatype.numpy)
        if wide.size and (wide.min() < info.min or wide.max() > info.max):
            raise InvalidInput(
                f"{where}: contents.{field} has values outside the {datatype.name} range "
                f"[{info.min}, {info.max}]"
            )
        return wide.astype(datatype.numpy).reshape(shape)
    return np.array(values, dtype=datatype.numpy).reshape(shape)


def _onnx_ready(array: np.ndarray, where: str) -> np.ndarray:
    if array.dtype != object:
        return array
    try:
        return to_onnx_strings(array)
    except ValueError as exc:
        raise InvalidInput(f"{where}: BYTES {exc}; this model takes UTF-8 strings") from exc


def _requested_outputs(
    request: service_pb2.ModelInferRequest, spec: ModelSpec, model: str
) -> list[str]:
    if not request.outputs:
        return list(spec.output_names)
    names: list[str] = []
    for output in request.outputs:
        if spec.output_named(output.name) is None:
            expected = [o.name for o in spec.outputs]
            raise InvalidInput(f"{model} has no output {output.name!r} (expected {expected})")
        if output.name in names:
            raise InvalidInput(f"{model}: output {output.name!r} is requested twice")
        for parameter in UNSUPPORTED_OUTPUT_PARAMETERS:
            if parameter in output.parameters:
                raise InvalidInput(
                    f"{model} output {output.name!r}: parameter {parameter!r} is not supported"
                )
        names.append(output.name)
    return names


def encode_response(
    request: service_pb2.ModelInferRequest,
    spec: ModelSpec,
    version: int,
    names: list[str],
    arrays: list[np.ndarray],
) -> service_pb2.ModelInferResponse:
    response = service_pb2.ModelInferResponse(
        model_name=spec.name, model_version=str(version), id=request.id
    )
    for name, array in zip(names, arrays, strict=True):
        declared = spec.output_named(name)
        assert declared is not None
        out = response.outputs.add(name=name, datatype=declared.datatype.name)
        out.shape.extend(array.shape)
        if declared.datatype.is_bytes:
            response.raw_output_contents.append(serialize_bytes(array))
        else:
            response.raw_output_contents.append(
                np.ascontiguousarray(array, dtype=declared.datatype.numpy).tobytes()
            )
    return response


def request_scheduling(
    request: service_pb2.ModelInferRequest,
    metadata: Sequence[tuple[str, Any]],
    time_remaining_s: float | None,
) -> tuple[int, float | None]:
    """(priority, timeout in seconds) as Triton reads them: the "priority" parameter (or the
    x-priority header; 0 is the model's default) and the sooner of the "timeout" parameter
    (microseconds; 0 is none) and the gRPC deadline."""
    priority = _whole_parameter(request, "priority")
    if priority is None:
        header = next((str(v) for k, v in metadata if k == PRIORITY_HEADER), None)
        if header is not None:
            if not is_decimal(header):
                raise InvalidInput(
                    f"header {PRIORITY_HEADER}: expected a number >= 0, got {header!r}"
                )
            priority = int(header)
    timeouts = [t for t in (time_remaining_s,) if t is not None]
    micros = _whole_parameter(request, "timeout")
    if micros:
        timeouts.append(micros / 1e6)
    return priority or 0, min(timeouts) if timeouts else None


def _whole_parameter(request: service_pb2.ModelInferRequest, name: str) -> int | None:
    if name not in request.parameters:
        return None
    return whole_number(request.parameters[name], f"parameters[{name!r}]")


def whole_number(parameter: Any, field: str) -> int:
    """An InferParameter's int64 or uint64 value, >= 0; InvalidInput naming ``field`` else."""
    kind = parameter.WhichOneof("parameter_choice")
    value = getattr(parameter, kind) if kind in ("int64_param", "uint64_param") else None
    if value is None or value < 0:
        shown = getattr(parameter, kind) if kind else None
        raise InvalidInput(
            f"{field}: expected an int64 or uint64 >= 0, got {kind or 'nothing'} {shown!r}"
        )
    return int(value)
