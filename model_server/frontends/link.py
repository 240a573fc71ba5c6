"""A front end's end of the private channel: ModelInfer requests to the engine, many in flight
on one Unix-socket connection, with their tensors in the front end's pool.

The client's request is decoded here; its inputs are copied into a slot of the pool and the
request forwarded without them; the answer's outputs are copied out of the slot into the
client's response, which is encoded here. A request that names a client's own shared-memory
region, or does not fit the pool, is forwarded whole.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import grpc
from tritonclient.grpc import service_pb2

from model_server.core.errors import InferenceError
from model_server.frontends import wire
from model_server.frontends.pool import FrontendPool, round_up, slot_bytes

log = logging.getLogger("model_server.frontend")

REGION_PARAMETER = "shared_memory_region"
ENGINE_GONE = "the model server's engine is not reachable from this front end; retry"


Answer = tuple[wire.Result, list[bytes]]  # the engine's result, the outputs from the slot


@dataclass(frozen=True, slots=True)
class Answered:
    """The engine's answer for the client: ``body`` encoded, and ``response`` when the link had
    to decode it anyway (its outputs came back through the pool), so no caller decodes it again."""

    body: bytes
    response: service_pb2.ModelInferResponse | None = None

    def decoded(self) -> service_pb2.ModelInferResponse:
        return self.response or service_pb2.ModelInferResponse.FromString(self.body)


class EngineGone(InferenceError):
    code = grpc.StatusCode.UNAVAILABLE


def names_region(request: service_pb2.ModelInferRequest) -> bool:
    return any(REGION_PARAMETER in t.parameters for t in (*request.inputs, *request.outputs))


class EngineLink(asyncio.Protocol):
    """The connection to the engine; ``on_lost`` is called once when it ends."""

    def __init__(self, pool: FrontendPool, on_lost: Callable[[], None]) -> None:
        self.pool = pool
        self.on_lost = on_lost
        self.reader = wire.FrameReader()
        self.transport: asyncio.Transport | None = None
        self._ids = itertools.count(1)  # masked to the wire's u32 (see _next_id)
        # request id -> (the answer's future, its slot's start or -1, where outputs go in it)
        self._pending: dict[int, tuple[asyncio.Future[Answer], int, int]] = {}

    @classmethod
    async def connect(cls, path: Path, pool: FrontendPool, on_lost: Callable[[], None],
                      hello: wire.Hello) -> EngineLink:  # fmt: skip
        loop = asyncio.get_running_loop()
        _, link = await loop.create_unix_connection(lambda: cls(pool, on_lost), str(path))
        link.send(wire.hello(hello))
        return link

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport; uvloop's are duck-typed (not asyncio.Transport subclasses).
        self.transport = cast(asyncio.Transport, transport)

    def send(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            raise EngineGone(ENGINE_GONE)
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        try:
            bodies = self.reader.feed(data)
            for body in bodies:
                self._answer(wire.parse_result(body))
        except (wire.WireError, KeyError) as exc:
            log.error("private channel: bad frame from the engine (%s); closing", exc)
            if self.transport is not None:
                self.transport.abort()

    def _answer(self, result: wire.Result) -> None:
        future, start, output_at = self._pending.pop(result.request_id)
        outputs: list[bytes] = []
        if start >= 0:
            if result.lengths:  # after the inputs, in the slot the request had
                outputs = self.pool.take(start + output_at, result.lengths)
            self.pool.slots.free(start)
        if not future.done():  # a cancelled request's slot is freed all the same
            future.set_result((result, outputs))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        for future, _, _ in self._pending.values():
            if not future.done():
                future.set_exception(EngineGone(ENGINE_GONE))
        self._pending.clear()
        self.on_lost()

    async def infer(
        self,
        request: service_pb2.ModelInferRequest,
        metadata: Sequence[tuple[str, Any]],
        timeout_s: float | None,
    ) -> Answered:
        """The engine's answer to ``request``, encoded for the client; InferenceError with
        the engine's status otherwise."""
        request_id = self._next_id()
        start, length, output_at = -1, 0, 0
        lengths: tuple[int, ...] = ()
        raw = request.raw_input_contents
        # More inputs than the frame counts (u16) cross in the message: the engine's checks
        # then name the request's mistake.
        if raw and len(raw) <= wire.MAX_TENSORS and not names_region(request):
            input_bytes = sum(len(part) for part in raw)
            length = slot_bytes(input_bytes)
            slot = self.pool.slots.allocate(length)
            if slot is not None:
                start, output_at = slot, round_up(input_bytes)
        try:
            if start >= 0:
                lengths = self.pool.put(start, list(raw))
                del raw[:]
            message = wire.Infer(request_id, timeout_s, start, length, lengths,
                                 tuple(metadata), request.SerializeToString())  # fmt: skip
            self.send(wire.infer(message))
        except BaseException:  # nothing was sent: the slot is this request's alone to free
            if start >= 0:
                self.pool.slots.free(start)
            raise
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (future, start, output_at)
        try:
            result, outputs = await future
        except asyncio.CancelledError:
            if request_id in self._pending and self.transport is not None:
                self.transport.write(wire.cancel(request_id))  # the engine still answers
            raise
        if result.code is not grpc.StatusCode.OK:
            raise InferenceError(result.message, result.code)
        if not outputs:
            return Answered(result.body)  # as the engine encoded it
        response = service_pb2.ModelInferResponse.FromString(result.body)
        response.raw_output_contents.extend(outputs)
        return Answered(bytes(response.SerializeToString()), response)

    def _next_id(self) -> int:
        """A request id the wire can carry (u32, never 0) that no request in flight holds:
        a front end outlives 2**32 requests at a few thousand a second in a couple of weeks."""
        while True:
            request_id = next(self._ids) & wire.MAX_REQUEST_ID
            if request_id and request_id not in self._pending:
                return request_id

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
