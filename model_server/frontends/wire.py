"""The frames of the private channel between a front end and the engine (a Unix socket).

Every frame is ``u32 length | u8 kind | u32 request id | payload``, little-endian. A front end
sends HELLO once (its index, its pid and its shared-memory pool's file), READY once its public
port listens, then INFER and CANCEL; the engine answers every INFER with exactly one RESULT,
cancelled or not, so a pool slot is never reused while the engine may still read it.

An INFER carries the client's headers and the ModelInferRequest, serialized; when its inputs
were put in the pool (``slot_start >= 0``) the request's ``raw_input_contents`` is empty and
``lengths`` gives each input's bytes, laid end to end from ``slot_start``. A RESULT carries a
gRPC status code, and either the serialized ModelInferResponse (its outputs, when ``lengths``
is not empty, laid end to end in the pool after the inputs) or the error message.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import grpc

_LENGTH = struct.Struct("<I")
_HEAD = struct.Struct("<BI")  # kind, request id
_INFER = struct.Struct("<dqIH")  # timeout (NaN: none), slot start, slot length, input count
_RESULT = struct.Struct("<BH")  # status code, output count
_HELLO = struct.Struct("<IiQ")  # front-end index, pid, pool bytes
_U32 = struct.Struct("<I")
_PAIR = struct.Struct("<HBI")  # key length, value is bytes, value length
MAX_FRAME = 1 << 31  # a corrupt length is refused, never allocated
MAX_REQUEST_ID = (1 << 32) - 1  # _HEAD's u32
MAX_TENSORS = (1 << 16) - 1  # _INFER's and _RESULT's u16 counts
CODES = {code.value[0]: code for code in grpc.StatusCode}


class Kind(IntEnum):
    HELLO = 1
    READY = 2
    INFER = 3
    CANCEL = 4
    RESULT = 5


class WireError(ValueError):
    """A frame that does not parse: the connection is closed, never guessed at."""


@dataclass(frozen=True, slots=True)
class Hello:
    index: int
    pid: int
    pool_bytes: int
    pool_file: str  # a name in the private directory


@dataclass(frozen=True, slots=True)
class Infer:
    request_id: int
    timeout_s: float | None
    slot_start: int  # -1: no slot, the tensors are in the request
    slot_length: int
    lengths: tuple[int, ...]  # each input's bytes in the slot
    metadata: tuple[tuple[str, str | bytes], ...]
    request: bytes  # a serialized ModelInferRequest


@dataclass(frozen=True, slots=True)
class Result:
    request_id: int
    code: grpc.StatusCode
    lengths: tuple[int, ...]  # each output's bytes in the slot; empty: in the response
    body: bytes  # the serialized ModelInferResponse (OK) or the error message (UTF-8)

    @property
    def message(self) -> str:
        return self.body.decode("utf-8", "replace")


def frame(kind: Kind, request_id: int, *parts: bytes) -> bytes:
    body = b"".join(parts)
    return _LENGTH.pack(_HEAD.size + len(body)) + _HEAD.pack(kind, request_id) + body


def hello(message: Hello) -> bytes:
    head = _HELLO.pack(message.index, message.pid, message.pool_bytes)
    return frame(Kind.HELLO, 0, head, message.pool_file.encode())


def infer(message: Infer) -> bytes:
    timeout = math.nan if message.timeout_s is None else message.timeout_s
    head = _INFER.pack(timeout, message.slot_start, message.slot_length, len(message.lengths))
    lengths = struct.pack(f"<{len(message.lengths)}I", *message.lengths)
    metadata = encode_metadata(message.metadata)
    return frame(
        Kind.INFER, message.request_id, head, lengths, _U32.pack(len(metadata)), metadata,
        message.request,
    )  # fmt: skip


def result(message: Result) -> bytes:
    head = _RESULT.pack(message.code.value[0], len(message.lengths))
    lengths = struct.pack(f"<{len(message.lengths)}I", *message.lengths)
    return frame(Kind.RESULT, message.request_id, head, lengths, message.body)


def cancel(request_id: int) -> bytes:
    return frame(Kind.CANCEL, request_id)


def encode_metadata(pairs: Sequence[tuple[str, Any]]) -> bytes:
    out = [struct.pack("<H", len(pairs))]
    for key, value in pairs:
        is_bytes = isinstance(value, bytes)
        raw = value if is_bytes else str(value).encode()
        name = key.encode()
        out.append(_PAIR.pack(len(name), is_bytes, len(raw)))
        out.append(name)
        out.append(raw)
    return b"".join(out)


def decode_metadata(data: bytes) -> tuple[tuple[str, str | bytes], ...]:
    try:
        (count,) = struct.unpack_from("<H", data)
        at, pairs = 2, []
        for _ in range(count):
            key_len, is_bytes, value_len = _PAIR.unpack_from(data, at)
            at += _PAIR.size
            key = data[at : at + key_len].decode()
            at += key_len
            raw = data[at : at + value_len]
            if len(raw) != value_len:
                raise WireError("metadata value cut short")
            at += value_len
            pairs.append((key, raw if is_bytes else raw.decode()))
    except (struct.error, UnicodeDecodeError) as exc:
        raise WireError(f"metadata: {exc}") from None
    if at != len(data):
        raise WireError(f"metadata: {len(data) - at} bytes left over")
    return tuple(pairs)


class FrameReader:
    """Cuts a byte stream into frame bodies (``kind | id | payload``)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._buffer
        buffer += data
        bodies: list[bytes] = []
        at = 0
        while len(buffer) - at >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(buffer, at)
            if size < _HEAD.size or size > MAX_FRAME:
                raise WireError(f"frame of {size} bytes")
            if len(buffer) - at - _LENGTH.size < size:
                break
            start = at + _LENGTH.size
            bodies.append(bytes(buffer[start : start + size]))
            at = start + size
        if at:
            del buffer[:at]
        return bodies


def kind_of(body: bytes) -> tuple[Kind, int]:
    kind, request_id = _HEAD.unpack_from(body)
    try:
        return Kind(kind), request_id
    except ValueError:
        raise WireError(f"unknown frame kind {kind}") from None


def _lengths(body: bytes, at: int, count: int) -> tuple[tuple[int, ...], int]:
    end = at + 4 * count
    if end > len(body):
        raise WireError("lengths cut short")
    return struct.unpack_from(f"<{count}I", body, at), end


def parse_hello(body: bytes) -> Hello:
    try:
        index, pid, size = _HELLO.unpack_from(body, _HEAD.size)
        return Hello(index, pid, size, body[_HEAD.size + _HELLO.size :].decode())
    except (struct.error, UnicodeDecodeError) as exc:
        raise WireError(f"HELLO: {exc}") from None


def parse_infer(body: bytes) -> Infer:
    try:
        _, request_id = _HEAD.unpack_from(body)
        timeout, start, length, count = _INFER.unpack_from(body, _HEAD.size)
        lengths, at = _lengths(body, _HEAD.size + _INFER.size, count)
        (metadata_len,) = _U32.unpack_from(body, at)
    except struct.error as exc:
        raise WireError(f"INFER: {exc}") from None
    at += _U32.size
    metadata = decode_metadata(body[at : at + metadata_len])
    timeout_s = None if math.isnan(timeout) else timeout
    return Infer(request_id, timeout_s, start, length, lengths, metadata,
                 body[at + metadata_len :])  # fmt: skip


def parse_result(body: bytes) -> Result:
    try:
        _, request_id = _HEAD.unpack_from(body)
        code, count = _RESULT.unpack_from(body, _HEAD.size)
        lengths, at = _lengths(body, _HEAD.size + _RESULT.size, count)
    except struct.error as exc:
        raise WireError(f"RESULT: {exc}") from None
    status = CODES.get(code)
    if status is None:
        raise WireError(f"RESULT: unknown status code {code}")
    return Result(request_id, status, lengths, body[at:])
