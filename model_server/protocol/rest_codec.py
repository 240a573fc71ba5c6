"""KServe v2 REST bodies <-> the gRPC messages the inference path takes (Triton's HTTP protocol).

A request body is JSON, or with the binary tensor extension (header
``Inference-Header-Content-Length: N``) N bytes of JSON followed by the raw bytes of each input
that has ``parameters.binary_data_size``, in input order. Every input becomes raw contents of
a ``ModelInferRequest`` (JSON data converted to the datatype's little-endian bytes, BYTES as
4-byte length-prefixed elements, exactly as gRPC raw contents), so ``model_server.core.validation``
checks REST and gRPC requests alike. Answers go the other way: an output is JSON ``data`` (a
flat list) or, when asked for with ``binary_data``, raw bytes after the JSON header.

Errors are InvalidInput naming the field (``inputs[0].shape``) and what was expected.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf import descriptor, json_format, message
from tritonclient.grpc import service_pb2

from model_server.core.datatypes import DATATYPES, Datatype, deserialize_bytes, serialize_bytes
from model_server.core.errors import InvalidInput
from model_server.core.validation import MAX_DIM, is_decimal
from model_server.protocol.json_checks import load_json_object

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_OUTPUT_PARAMETER = "binary_data_output"  # REST only: every output as binary data
BINARY_SIZE_PARAMETER = "binary_data_size"
BINARY_PARAMETER = "binary_data"
JSON_CONTENT_TYPE = "application/json"
BINARY_CONTENT_TYPE = "application/octet-stream"
_INT64_MAX = 2**63 - 1
_UINT64_MAX = 2**64 - 1
_SCALARS = {int, float, str, bool}


@dataclass
class RestInferRequest:
    request: service_pb2.ModelInferRequest
    binary_default: bool = False  # parameters.binary_data_output
    binary_outputs: dict[str, bool] = field(default_factory=dict)  # outputs[i].binary_data


def header_length(value: str | None, body_size: int) -> int | None:
    """The JSON part's length from the Inference-Header-Content-Length header (None: all)."""
    if value is None:
        return None
    text = value.strip()
    if not is_decimal(text):
        raise InvalidInput(f"header {HEADER_LENGTH}: expected a byte count >= 0, got {value!r}")
    length = int(text)
    if length > body_size:
        raise InvalidInput(
            f"header {HEADER_LENGTH}: {length} bytes of JSON, but the body has only "
            f"{body_size} bytes"
        )
    return length


def decode_infer(
    body: bytes, json_length: int | None, model: str, version: str
) -> RestInferRequest:
    """A REST infer body as a ModelInferRequest for ``model`` (``version``: "" for any)."""
    json_length = len(body) if json_length is None else json_length
    document = load_json_object(body[:json_length])
    binary = memoryview(body)[json_length:]
    request = service_pb2.ModelInferRequest(model_name=model, model_version=version)
    decoded = RestInferRequest(request)
    request_id = document.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidInput(f"id: expected a string, got {_kind(request_id)}")
    request.id = request_id
    parameters = dict(_object(document.get("parameters", {}), "parameters"))
    binary_output = parameters.pop(BINARY_OUTPUT_PARAMETER, False)
    if not isinstance(binary_output, bool):
        raise InvalidInput(
            f"parameters.{BINARY_OUTPUT_PARAMETER}: expected true or false, got "
            f"{_kind(binary_output)}"
        )
    decoded.binary_default = binary_output
    _set_parameters(request.parameters, parameters, "parameters")
    inputs = _list(document.get("inputs"), "inputs")
    offset = 0
    for index, item in enumerate(inputs):
        offset = _decode_input(request, item, index, model, binary, offset)
    if offset != len(binary):
        raise InvalidInput(
            f"binary data: the inputs' parameters.{BINARY_SIZE_PARAMETER} add up to {offset} "
            f"bytes, but {len(binary)} bytes follow the {json_length}-byte JSON header "
            f"({HEADER_LENGTH})"
        )
    for index, item in enumerate(_list(document.get("outputs", []), "outputs")):
        where = f"outputs[{index}]"
        output = _object(item, where)
        name = _string(output.get("name"), f"{where}.name")
        wanted = request.outputs.add(name=name)
        params = dict(_object(output.get("parameters", {}), f"{where}.parameters"))
        if BINARY_PARAMETER in params:
            flag = params.pop(BINARY_PARAMETER)
            if not isinstance(flag, bool):
                raise InvalidInput(
                    f"{where}.parameters.{BINARY_PARAMETER}: expected true or false, got "
                    f"{_kind(flag)}"
                )
            decoded.binary_outputs[name] = flag
        _set_parameters(wanted.parameters, params, f"{where}.parameters")
    return decoded


def _decode_input(
    request: service_pb2.ModelInferRequest,
    item: Any,
    index: int,
    model: str,
    binary: memoryview,
    offset: int,
) -> int:
    where = f"inputs[{index}]"
    tensor = _object(item, where)
    name = _string(tensor.get("name"), f"{where}.name")
    where = f"model {model!r} inputs[{index}] ({name!r})"
    shape = _list(tensor.get("shape"), f"{where}.shape")
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM for d in shape):
        raise InvalidInput(
            f"{where}.shape: expected a list of integers in 0..{MAX_DIM}, got {str(shape)[:80]}"
        )
    datatype_name = _string(tensor.get("datatype"), f"{where}.datatype")
    datatype = DATATYPES.get(datatype_name)
    if datatype is None:
        raise InvalidInput(
            f"{where}.datatype: {datatype_name!r} is not a supported KServe v2 datatype "
            f"(expected one of {', '.join(DATATYPES)})"
        )
    params = dict(_object(tensor.get("parameters", {}), f"{where}.parameters"))
    size = params.pop(BINARY_SIZE_PARAMETER, None)
    entry = request.inputs.add(name=name, datatype=datatype_name, shape=shape)
    _set_parameters(entry.parameters, params, f"{where}.parameters")
    if size is not None:
        if "data" in tensor:
            raise InvalidInput(
                f"{where}: has both data and parameters.{BINARY_SIZE_PARAMETER}; send one"
            )
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidInput(
                f"{where}.parameters.{BINARY_SIZE_PARAMETER}: expected a byte count >= 0, got "
                f"{size!r}"
            )
        if offset + size > len(binary):
            raise InvalidInput(
                f"{where}.parameters.{BINARY_SIZE_PARAMETER}: {size} bytes at offset {offset} "
                f"of the binary data, which has only {len(binary)} bytes"
            )
        request.raw_input_contents.append(bytes(binary[offset : offset + size]))
        return offset + size
    if "data" not in tensor:
        raise InvalidInput(f"{where}: needs data or parameters.{BINARY_SIZE_PARAMETER}")
    request.raw_input_contents.append(json_to_raw(tensor["data"], datatype, shape, where))
    return offset


def json_to_raw(data: Any, datatype: Datatype, shape: list[int], where: str) -> bytes:
    """JSON ``data`` (flat or nested) as raw contents: little-endian values, or BYTES framing."""
    flat = _flatten(data, f"{where}.data")
    count = math.prod(shape)
    if len(flat) != count:
        raise InvalidInput(f"{where}.data has {len(flat)} values, shape {shape} needs {count}")
    if datatype.is_bytes:
        if not all(isinstance(v, str) for v in flat):
            bad = next(v for v in flat if not isinstance(v, str))
            raise InvalidInput(f"{where}.data: BYTES values must be strings, got {_kind(bad)}")
        array = np.empty(count, dtype=object)
        array[:] = flat
        return serialize_bytes(array)
    try:
        values = np.asarray(flat) if flat else np.zeros(0, dtype=datatype.numpy)
    except (OverflowError, ValueError):  # integers beyond 64 bits
        values = np.asarray(flat, dtype=object)
    kind = values.dtype.kind
    wanted = datatype.numpy.kind
    python_ints = wanted in "iu" and kind in "fO" and all(type(v) is int for v in flat)
    if python_ints:  # ints numpy would not hold in one dtype (e.g. UINT64 above 2**63)
        kind = "i"
    elif wanted == "f" and kind == "O" and all(type(v) in (int, float) for v in flat):
        try:
            values, kind = np.array([float(v) for v in flat]), "f"  # ints beyond 64 bits
        except OverflowError:
            raise InvalidInput(
                f"{where}.data: an integer too large for any floating-point type"
            ) from None
    allowed = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}[wanted]
    if count and kind not in allowed:
        expected = {"b": "true/false", "i": "integers", "u": "integers", "f": "numbers"}[wanted]
        raise InvalidInput(
            f"{where}.data: {datatype.name} takes {expected}, got {_numpy_kind(kind)}"
        )
    if count and wanted in "iu":
        info = np.iinfo(datatype.numpy)
        low, high = (min(flat), max(flat)) if python_ints else (values.min(), values.max())
        if int(low) < info.min or int(high) > info.max:
            raise InvalidInput(
                f"{where}.data: values outside the {datatype.name} range [{info.min}, {info.max}]"
            )
        if python_ints:
            values = np.array(flat, dtype=datatype.numpy)
    return np.ascontiguousarray(values, dtype=datatype.numpy).tobytes()


def encode_infer(
    response: service_pb2.ModelInferResponse, decoded: RestInferRequest
) -> tuple[bytes, int | None]:
    """The REST answer: (body, JSON header length when binary outputs follow it, else None)."""
    document: dict[str, Any] = {
        "model_name": response.model_name,
        "model_version": response.model_version,
    }
    if response.id:
        document["id"] = response.id
    if response.parameters:
        document["parameters"] = parameters_json(response.parameters)
    outputs: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for index, out in enumerate(response.outputs):
        datatype = DATATYPES[out.datatype]
        raw = response.raw_output_contents[index]
        entry: dict[str, Any] = {"name": out.name, "datatype": out.datatype}
        entry["shape"] = list(out.shape)
        if decoded.binary_outputs.get(out.name, decoded.binary_default):
            entry["parameters"] = {BINARY_SIZE_PARAMETER: len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = raw_to_json(raw, datatype, math.prod(out.shape), out.name)
        outputs.append(entry)
    document["outputs"] = outputs
    header = json.dumps(document, separators=(",", ":")).encode()
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)


def raw_to_json(raw: bytes, datatype: Datatype, count: int, name: str) -> list[Any]:
    """Raw output contents as a flat JSON list (BYTES as UTF-8 strings)."""
    if datatype.is_bytes:
        items = deserialize_bytes(raw, count)
        try:
            return [bytes(item).decode("utf-8") for item in items]
        except UnicodeDecodeError:
            raise InvalidInput(
                f"output {name!r} holds BYTES that are not UTF-8, which JSON cannot carry; "
                f'ask for it with "parameters": {{"{BINARY_PARAMETER}": true}}'
            ) from None
    values: list[Any] = np.frombuffer(raw, dtype=datatype.numpy).tolist()
    return values


def parameters_json(parameters: Any) -> dict[str, Any]:
    """An InferParameter map as plain JSON values."""
    out: dict[str, Any] = {}
    for key, parameter in parameters.items():
        kind = parameter.WhichOneof("parameter_choice")
        if kind is not None:
            out[key] = getattr(parameter, kind)
    return out


def message_json(msg: message.Message) -> dict[str, Any]:
    """A protobuf message as Triton's REST JSON: field names as in the .proto, every scalar
    printed, and 64-bit integers as JSON numbers (protobuf's own JSON writes them as strings)."""
    document = json_format.MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    _int64_as_numbers(msg.DESCRIPTOR, document)
    return document


def _int64_as_numbers(desc: Any, document: dict[str, Any]) -> None:
    wide = (descriptor.FieldDescriptor.CPPTYPE_INT64, descriptor.FieldDescriptor.CPPTYPE_UINT64)
    for key, value in document.items():
        fd = desc.fields_by_name.get(key)
        if fd is None:
            continue
        if fd.message_type is not None:
            if fd.message_type.GetOptions().map_entry:
                value_fd = fd.message_type.fields_by_name["value"]
                if value_fd.message_type is not None:
                    for item in value.values():
                        _int64_as_numbers(value_fd.message_type, item)
                elif value_fd.cpp_type in wide:
                    for k in value:
                        value[k] = int(value[k])
            else:
                for item in value if isinstance(value, list) else [value]:
                    _int64_as_numbers(fd.message_type, item)
        elif fd.cpp_type in wide:
            document[key] = [int(v) for v in value] if isinstance(value, list) else int(value)


def _set_parameters(target: Any, parameters: dict[str, Any], where: str) -> None:
    for key, value in parameters.items():
        parameter = target[key]
        if isinstance(value, bool):
            parameter.bool_param = value
        elif isinstance(value, int):
            if not -(_INT64_MAX + 1) <= value <= _UINT64_MAX:
                raise InvalidInput(
                    f"{where}.{key}: an integer must fit 64 bits (int64, or uint64 when "
                    f"positive), got {str(value)[:40]}"
                )
            if value > _INT64_MAX:
                parameter.uint64_param = value
            else:
                parameter.int64_param = value
        elif isinstance(value, float):
            parameter.double_param = value
        elif isinstance(value, str):
            parameter.string_param = value
        else:
            raise InvalidInput(
                f"{where}.{key}: expected a string, number or boolean, got {_kind(value)}"
            )


def _flatten(data: Any, where: str) -> list[Any]:
    if not isinstance(data, list):
        raise InvalidInput(f"{where}: expected a list of values, got {_kind(data)}")
    if set(map(type, data)) <= _SCALARS:  # already flat: the common case, checked in C
        return data
    flat: list[Any] = []
    stack: list[Any] = [iter(data)]
    while stack:  # iterative: a hostile nesting depth cannot exhaust the Python stack
        for value in stack[-1]:
            if isinstance(value, list):
                stack.append(iter(value))
                break
            if isinstance(value, dict) or value is None:
                raise InvalidInput(
                    f"{where}: expected numbers, strings or lists, got {_kind(value)}"
                )
            flat.append(value)
        else:
            stack.pop()
    return flat


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidInput(f"{where}: expected a JSON object, got {_kind(value)}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise InvalidInput(f"{where}: expected a JSON list, got {_kind(value)}")
    return value


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise InvalidInput(f"{where}: expected a string, got {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"the number {value!r}"
    return names.get(type(value), type(value).__name__)


def _numpy_kind(kind: str) -> str:
    return {"b": "booleans", "i": "integers", "u": "integers", "f": "non-integer numbers"}.get(
        kind, "strings or mixed values"
    )
