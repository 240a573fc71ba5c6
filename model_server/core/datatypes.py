"""KServe v2 datatypes: names, numpy dtypes, Triton config enums, ONNX types, BYTES framing."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from tritonclient.grpc import model_config_pb2


@dataclass(frozen=True)
class Datatype:
    name: str  # KServe v2 name, e.g. "FP32"
    numpy: np.dtype  # numpy dtype; object for BYTES
    config_type: int  # model_config_pb2.DataType value
    onnx_type: str  # onnxruntime's type string, e.g. "tensor(float)"
    contents_field: str | None  # InferTensorContents field, None when only raw is allowed

    @property
    def is_bytes(self) -> bool:
        return self.name == "BYTES"

    @property
    def itemsize(self) -> int:
        """Bytes per element in raw contents (0 for variable-length BYTES)."""
        return 0 if self.is_bytes else self.numpy.itemsize


def _dt(name: str, numpy: str, config: str, onnx: str, field: str | None) -> Datatype:
    return Datatype(name, np.dtype(numpy), model_config_pb2.DataType.Value(config), onnx, field)


DATATYPES: dict[str, Datatype] = {
    d.name: d
    for d in (
        _dt("BOOL", "bool", "TYPE_BOOL", "tensor(bool)", "bool_contents"),
        _dt("UINT8", "uint8", "TYPE_UINT8", "tensor(uint8)", "uint_contents"),
        _dt("UINT16", "uint16", "TYPE_UINT16", "tensor(uint16)", "uint_contents"),
        _dt("UINT32", "uint32", "TYPE_UINT32", "tensor(uint32)", "uint_contents"),
        _dt("UINT64", "uint64", "TYPE_UINT64", "tensor(uint64)", "uint64_contents"),
        _dt("INT8", "int8", "TYPE_INT8", "tensor(int8)", "int_contents"),
        _dt("INT16", "int16", "TYPE_INT16", "tensor(int16)", "int_contents"),
        _dt("INT32", "int32", "TYPE_INT32", "tensor(int32)", "int_contents"),
        _dt("INT64", "int64", "TYPE_INT64", "tensor(int64)", "int64_contents"),
        _dt("FP16", "float16", "TYPE_FP16", "tensor(float16)", None),
        _dt("FP32", "float32", "TYPE_FP32", "tensor(float)", "fp32_contents"),
        _dt("FP64", "float64", "TYPE_FP64", "tensor(double)", "fp64_contents"),
        _dt("BYTES", "object", "TYPE_STRING", "tensor(string)", "bytes_contents"),
    )
}
BY_CONFIG_TYPE: dict[int, Datatype] = {d.config_type: d for d in DATATYPES.values()}
BY_ONNX_TYPE: dict[str, Datatype] = {d.onnx_type: d for d in DATATYPES.values()}
CONTENTS_FIELDS: tuple[str, ...] = (
    "bool_contents",
    "int_contents",
    "int64_contents",
    "uint_contents",
    "uint64_contents",
    "fp32_contents",
    "fp64_contents",
    "bytes_contents",
)

_LENGTH = struct.Struct("<I")


def deserialize_bytes(buffer: bytes, count: int) -> np.ndarray:
    """Decodes KServe raw BYTES contents: ``count`` elements, each a uint32 LE length + data.

    Raises ValueError naming the element that does not decode; trailing bytes are an error.
    """
    items: list[bytes] = []
    offset = 0
    size = len(buffer)
    for index in range(count):
        if offset + 4 > size:
            raise ValueError(
                f"element {index} of {count}: length prefix runs past the end of "
                f"the {size} raw bytes"
            )
        (length,) = _LENGTH.unpack_from(buffer, offset)
        offset += 4
        if offset + length > size:
            raise ValueError(
                f"element {index} of {count}: declares {length} bytes but only "
                f"{size - offset} remain"
            )
        items.append(buffer[offset : offset + length])
        offset += length
    if offset != size:
        raise ValueError(f"{size - offset} bytes left over after {count} elements")
    array = np.empty(count, dtype=object)
    array[:] = items
    return array


def serialize_bytes(array: np.ndarray) -> bytes:
    """Encodes an array of str/bytes as KServe raw BYTES contents."""
    parts: list[bytes] = []
    for item in array.reshape(-1):
        data = item.encode("utf-8") if isinstance(item, str) else bytes(item)
        parts.append(_LENGTH.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def to_onnx_strings(array: np.ndarray) -> np.ndarray:
    """ONNX Runtime takes string tensors as str objects: decode UTF-8, naming a bad element."""
    flat = array.reshape(-1)
    out = np.empty(flat.shape, dtype=object)
    for index, item in enumerate(flat):
        if isinstance(item, str):
            out[index] = item
            continue
        try:
            out[index] = bytes(item).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"element {index} is not valid UTF-8 ({exc.reason})") from exc
    return out.reshape(array.shape)
