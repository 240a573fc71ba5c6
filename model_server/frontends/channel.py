"""The engine's end of the private channel: ModelInfer from the front ends, over a Unix socket
in the private directory, into the server's one request path (``InferenceService.infer``, as
REST does), so gate, drain, validation, batching, metrics and statistics are the engine's.

Each front end keeps one connection, with many requests in flight on it. A request whose
inputs are in the front end's pool is prepared from read-only views of them (the request path
reads them in place, as it reads a client's shared-memory region); its outputs are written
after its inputs in the same slot when they fit. A connection that closes (its front end
died) cancels its requests: their clients already saw their connection fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
from collections.abc import Callable
from pathlib import Path
from typing import cast

import grpc
from prometheus_client import Counter
from tritonclient.grpc import service_pb2

from model_server.core.errors import InferenceError
from model_server.frontends import wire
from model_server.frontends.pool import EnginePool, round_up
from model_server.protocol.service import InferenceService
from model_server.protocol.shared_memory_tensors import RegionRequest

log = logging.getLogger("model_server.frontends")


class EngineChannel:
    """Serves ModelInfer to the front ends on ``path``; ``on_ready(index, pid)`` is called
    when a front end says its public port listens, ``on_gone(index)`` when it hangs up."""

    def __init__(
        self,
        service: InferenceService,
        directory: Path,
        on_ready: Callable[[int, int], None],
        requests: Counter,
    ) -> None:
        self.service = service
        self.directory = directory
        self.on_ready = on_ready
        self.requests = requests  # by front end: is the kernel spreading the connections?
        self.connections: set[_Connection] = set()
        self._server: asyncio.AbstractServer | None = None

    async def start(self, path: Path) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Connection(self), str(path))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.abort()
        if self._server is not None:
            await self._server.wait_closed()


class _Connection(asyncio.Protocol):
    def __init__(self, channel: EngineChannel) -> None:
        self.channel = channel
        self.reader = wire.FrameReader()
        self.transport: asyncio.Transport | None = None
        self.pool: EnginePool | None = None
        self.index = -1
        self.counted: Callable[[], None] = lambda: None
        self.tasks: dict[int, asyncio.Task[None]] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport; uvloop's are duck-typed (not asyncio.Transport subclasses).
        self.transport = cast(asyncio.Transport, transport)
        self.channel.connections.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            for body in self.reader.feed(data):
                self._dispatch(body)
        except (wire.WireError, ValueError, OSError) as exc:
            log.error("front end %d: private channel closed: %s", self.index, exc)
            self.abort()

    def _dispatch(self, body: bytes) -> None:
        kind, request_id = wire.kind_of(body)
        if kind is wire.Kind.INFER:
            if self.pool is None:
                raise wire.WireError("INFER before HELLO")
            message = wire.parse_infer(body)
            self.counted()
            task = asyncio.get_running_loop().create_task(self._infer(message, self.pool))
            task.add_done_callback(functools.partial(self._never_ran, message))
            self.tasks[request_id] = task
        elif kind is wire.Kind.CANCEL:
            running = self.tasks.get(request_id)
            if running is not None:
                running.cancel()
        elif kind is wire.Kind.HELLO:
            hello = wire.parse_hello(body)
            self.pool = EnginePool(self.channel.directory, hello.pool_file, hello.pool_bytes)
            self.index = hello.index
            self.counted = self.channel.requests.labels(str(hello.index)).inc
        elif kind is wire.Kind.READY:
            self.channel.on_ready(self.index, request_id)  # a READY's id is the front end's pid
        else:
            raise wire.WireError(f"unexpected {kind.name} from a front end")

    async def _infer(self, message: wire.Infer, pool: EnginePool) -> None:
        views: list[memoryview] = []
        try:
            request = service_pb2.ModelInferRequest.FromString(message.request)
            prepared = request
            if message.slot_start >= 0:
                views = pool.views(message.slot_start, message.slot_length, message.lengths)
                prepared = RegionRequest(request, list(views))
            response = await self.channel.service.infer(
                prepared, message.metadata, message.timeout_s
            )
            lengths = _outputs_to_slot(response, message, pool)
            reply = wire.Result(message.request_id, grpc.StatusCode.OK, lengths,
                                response.SerializeToString())  # fmt: skip
        except InferenceError as exc:
            reply = _error(message, exc.code, exc.message)
        except asyncio.CancelledError:  # the front end's client went away, or it died
            reply = _error(message, grpc.StatusCode.CANCELLED, "cancelled by the client")
        except Exception as exc:  # a bad message from a front end: its request fails alone
            log.exception("front end %d: request %d failed", self.index, message.request_id)
            reply = _error(message, grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        finally:
            for view in views:
                with contextlib.suppress(BufferError):  # an array still reads it: GC frees it
                    view.release()
            self.tasks.pop(message.request_id, None)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(wire.result(reply))

    def _never_ran(self, message: wire.Infer, task: asyncio.Task[None]) -> None:
        """A task cancelled before its first step (its CANCEL came in the same read as its
        INFER) never entered ``_infer``, whose handlers answer and forget it; so here. Every
        other task ends normally: ``_infer`` keeps its cancellation to itself."""
        if not task.cancelled():
            return
        self.tasks.pop(message.request_id, None)
        if self.transport is not None and not self.transport.is_closing():
            reply = _error(message, grpc.StatusCode.CANCELLED, "cancelled by the client")
            self.transport.write(wire.result(reply))

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.channel.connections.discard(self)
        self.transport = None
        pending = list(self.tasks.values())
        for task in pending:
            task.cancel()
        if self.index >= 0:
            log.info("front end %d hung up; %d requests cancelled", self.index, len(pending))
        if self.pool is not None:
            asyncio.get_running_loop().create_task(_close_pool(self.pool, pending, self.index))


def _outputs_to_slot(
    response: service_pb2.ModelInferResponse, message: wire.Infer, pool: EnginePool
) -> tuple[int, ...]:
    """Moves the outputs into the slot after the inputs when they fit; their lengths."""
    if not 0 < len(response.raw_output_contents) <= wire.MAX_TENSORS or message.slot_start < 0:
        return ()
    room_at = round_up(sum(message.lengths))
    outputs = list(response.raw_output_contents)
    if sum(len(part) for part in outputs) > message.slot_length - room_at:
        return ()
    lengths = pool.write(message.slot_start + room_at, outputs)
    del response.raw_output_contents[:]
    return lengths


def _error(message: wire.Infer, code: grpc.StatusCode, text: str) -> wire.Result:
    return wire.Result(message.request_id, code, (), text.encode())


async def _close_pool(pool: EnginePool, pending: list[asyncio.Task[None]], index: int) -> None:
    """Unmaps a gone front end's pool once its requests have ended."""
    if pending:
        await asyncio.wait(pending)
    for _ in range(3):
        if pool.close():
            return
        gc.collect()  # an array made from a view, in a reference cycle
        await asyncio.sleep(1.0)
    log.warning("front end %d: its pool is still read by an array; left mapped", index)
