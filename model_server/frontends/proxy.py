"""The front end's gRPC service: ModelInfer through the engine link (decoded, tensors moved
into the pool, the answer encoded here); every other RPC (health, metadata, statistics,
repository, model control, shared-memory registration, streams) forwarded as bytes to the
engine's gRPC server on the private Unix socket, with the caller's headers, deadline and the
engine's status and message.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2

from model_server.core.errors import InferenceError, InvalidInput
from model_server.frontends.link import EngineLink
from model_server.generative.text import prompt_tokens
from model_server.protocol.token_usage import usage_trailer

log = logging.getLogger("model_server.frontend")

SERVICE = "/inference.GRPCInferenceService/"
INFER = SERVICE + "ModelInfer"
STREAM_STREAM = frozenset({SERVICE + "ModelStreamInfer"})
UNARY_STREAM = frozenset({"/grpc.health.v1.Health/Watch"})
# Headers that belong to the hop, not the call: gRPC sets its own on the private channel.
HOP_HEADERS = frozenset({"user-agent", "te", "content-type", "grpc-accept-encoding"})


def forwarded(context: grpc.aio.ServicerContext) -> tuple[tuple[str, Any], ...]:
    """The caller's headers, as the engine should see them."""
    return tuple(
        (key, value)
        for key, value in context.invocation_metadata() or ()
        if key not in HOP_HEADERS and not key.startswith((":", "grpc-"))
    )


class FrontendService(grpc.GenericRpcHandler):
    def __init__(self, link: EngineLink, engine: grpc.aio.Channel, max_request_bytes: int) -> None:
        self.link = link
        self.engine = engine
        self.max_request_bytes = max_request_bytes
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        handler = self._handlers.get(method)
        if handler is None:
            handler = self._handlers[method] = self._handler(method)
        return handler

    def _handler(self, method: str) -> grpc.RpcMethodHandler:
        if method == INFER:
            return grpc.unary_unary_rpc_method_handler(self.model_infer)
        if method in STREAM_STREAM:
            return grpc.stream_stream_rpc_method_handler(self._stream_stream(method))
        if method in UNARY_STREAM:
            return grpc.unary_stream_rpc_method_handler(self._unary_stream(method))
        return grpc.unary_unary_rpc_method_handler(self._unary(method))

    async def model_infer(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        prompt: int | None = None  # a text generation's prompt tokens, for the edge's limits
        try:
            message = service_pb2.ModelInferRequest.FromString(request)
        except DecodeError as exc:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"ModelInfer: the message is not a ModelInferRequest ({exc})",
            )
        try:
            prompt = prompt_tokens(message)  # before the link moves the inputs to the pool
            size = sum(len(part) for part in message.raw_input_contents)
            if size > self.max_request_bytes:  # the engine checks it too, with the regions
                raise InvalidInput(
                    f"model {message.model_name!r}: {size} bytes of tensors exceed the "
                    f"server's limit of {self.max_request_bytes} (--max-request-bytes)"
                )
            answer = await self.link.infer(message, forwarded(context), context.time_remaining())
            if prompt is not None:  # as the single process reports it (protocol.service)
                context.set_trailing_metadata(usage_trailer(prompt, answer.decoded()))
            return answer.body
        except InferenceError as exc:
            trailers = usage_trailer(prompt, refused=exc.code)
            await context.abort(exc.code, exc.message, trailing_metadata=trailers)
        except Exception as exc:  # ours, not the caller's: logged, and never a retry hint
            log.exception("model %r: ModelInfer failed in the front end", message.model_name)
            await context.abort(grpc.StatusCode.INTERNAL, f"ModelInfer: {type(exc).__name__}")
        raise AssertionError("unreachable")

    def _unary(self, method: str) -> Any:
        call = self.engine.unary_unary(method)

        async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            try:
                answer = call(request, metadata=forwarded(context),
                              timeout=context.time_remaining())  # fmt: skip
                reply = bytes(await answer)
                context.set_trailing_metadata(_trailers(await answer.trailing_metadata()))
                return reply
            except grpc.aio.AioRpcError as exc:
                trailers = _trailers(exc.trailing_metadata())
                await context.abort(exc.code(), exc.details() or "", trailing_metadata=trailers)
            raise AssertionError("unreachable")

        return forward

    def _unary_stream(self, method: str) -> Any:
        open_call = self.engine.unary_stream(method)

        async def forward(
            request: bytes, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[bytes]:
            call = open_call(request, metadata=forwarded(context), timeout=context.time_remaining())
            async for item in _relay(call, context):
                yield item

        return forward

    def _stream_stream(self, method: str) -> Any:
        open_call = self.engine.stream_stream(method)

        async def forward(
            requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
        ) -> AsyncIterator[bytes]:
            call = open_call(
                requests, metadata=forwarded(context), timeout=context.time_remaining()
            )
            async for item in _relay(call, context):
                yield item

        return forward


async def _relay(call: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    """The engine's stream to the client, then its trailers (a stream's tokens used); its
    error as the client's status. Cancelled with the client's call."""
    try:
        async for item in call:
            yield bytes(item)
        context.set_trailing_metadata(_trailers(await call.trailing_metadata()))
    except grpc.aio.AioRpcError as exc:
        trailers = _trailers(exc.trailing_metadata())
        await context.abort(exc.code(), exc.details() or "", trailing_metadata=trailers)
    finally:
        call.cancel()


def _trailers(metadata: Any) -> tuple[tuple[str, Any], ...]:
    """The engine's trailers for the client: its own (x-infermesh-tokens-used), not gRPC's."""
    return tuple((k, v) for k, v in metadata or () if not k.startswith(("grpc-", ":")))
