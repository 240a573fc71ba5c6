"""The KServe v2 HTTP/REST protocol (what Triton serves; tritonclient.http works unchanged).

Runs on the server's asyncio loop next to gRPC, on --http-port. Nothing here decides anything
about inference: an infer body becomes a ``ModelInferRequest`` (``protocol.rest_codec``)
and goes through ``InferenceService.infer`` with the HTTP headers as its metadata, so version
routing (x-model-version), fallback, priority, timeouts, validation, batching, faults,
metrics, tracing and the drain are the gRPC path's own. Errors answer ``{"error": message}``
with the HTTP status of their gRPC code (``model_server.core.errors.HTTP_STATUS``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc
from aiohttp import web

from infermesh.wire import TOKENS_USED_HEADER
from model_server import __version__
from model_server.core.errors import InferenceError, InvalidInput, http_status
from model_server.core.memory import format_bytes
from model_server.core.validation import OFFLOAD_DECODE_BYTES
from model_server.generative.text import prompt_tokens
from model_server.protocol.json_checks import load_json_object
from model_server.protocol.openai import (
    OpenAIApi,
    is_openai_path,
    no_endpoint,
    openai_error,
    openai_exception,
)
from model_server.protocol.rest_codec import (
    BINARY_CONTENT_TYPE,
    HEADER_LENGTH,
    JSON_CONTENT_TYPE,
    decode_infer,
    encode_infer,
    header_length,
    message_json,
)
from model_server.protocol.service import (
    EXTENSIONS,
    ROUTED_VERSION_HEADER,
    SERVER_NAME,
    InferenceService,
)
from model_server.protocol.shared_memory_tensors import names_shared_memory
from model_server.protocol.token_usage import REFUSED_BEFORE_WORK, usage_trailer
from model_server.security.access import Restriction, check_metadata, rest_group
from model_server.security.peers import ServerTls, decide, rest_peer_id

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MODEL = "/v2/models/{name}"
VERSION = "/v2/models/{name}/versions/{version}"


def json_response(document: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=json.dumps(document, separators=(",", ":")).encode(),
        status=status,
        content_type=JSON_CONTENT_TYPE,
    )


def error_response(
    status: int, message: str, headers: dict[str, str] | None = None
) -> web.Response:
    response = json_response({"error": message}, status)
    response.headers.update(headers or {})
    return response


def refusal(
    request: web.Request, status: int, message: str, headers: dict[str, str] | None = None
) -> web.Response:
    """An error in the shape of the request's API: OpenAI's under /v1, else KServe's."""
    if is_openai_path(request.path):
        return openai_error(status, message, headers)
    return error_response(status, message, headers)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure as ``{"error": ...}`` JSON (OpenAI's error object under /v1); the server
    keeps serving."""
    try:
        return await handler(request)
    except InferenceError as exc:
        # Refused before any work: the edge refunds a token reservation in full.
        unused = {TOKENS_USED_HEADER: "0"} if exc.code in REFUSED_BEFORE_WORK else None
        if is_openai_path(request.path):
            answer = openai_exception(exc)
            answer.headers.update(unused or {})
            return answer
        return error_response(http_status(exc.code), exc.message, unused)
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        return refusal(
            request,
            405,
            f"method {request.method} is not allowed on {request.path} (allowed: {allowed})",
            {"Allow": allowed},
        )
    except web.HTTPNotFound:
        if is_openai_path(request.path):
            return openai_error(404, no_endpoint(request))
        return error_response(
            404,
            f"no endpoint {request.method} {request.path}; this server speaks the KServe v2 "
            "REST protocol under /v2",
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return refusal(request, exc.status, exc.text or exc.reason)
    except Exception as exc:  # a bug: answered, logged, and the server goes on
        log.exception("REST %s %s failed", request.method, request.path)
        return refusal(request, 500, f"internal error: {type(exc).__name__}: {exc}")


def restricted_middleware(table: Mapping[str, Restriction]) -> Any:
    """403 for a restricted API group called without its credential header (as gRPC's
    PERMISSION_DENIED), before the route's handler reads the body."""

    @web.middleware
    async def restricted(request: web.Request, handler: Handler) -> web.StreamResponse:
        group = rest_group(request.path)
        if group in table:
            headers = [(k.lower(), v) for k, v in request.headers.items()]
            refused = check_metadata(table, group, headers)
            if refused is not None:
                return refusal(request, 403, refused)
        return await handler(request)

    return restricted


def peer_middleware(trust_domain: str, table: Mapping[str, Restriction]) -> Any:
    """With mutual TLS: 403 unless the client certificate's identity may call the group (and,
    for restricted groups, is an operator or sends the credential header), as gRPC does."""

    @web.middleware
    async def peer(request: web.Request, handler: Handler) -> web.StreamResponse:
        transport = request.transport
        spiffe_id = rest_peer_id(transport.get_extra_info("peercert") if transport else None)
        headers = [(k.lower(), v) for k, v in request.headers.items()]
        refused = decide(rest_group(request.path), spiffe_id, trust_domain, table, headers)
        if refused is not None:
            return refusal(request, 403, refused)
        return await handler(request)

    return peer


class RestServer:
    """The REST routes over one InferenceService."""

    def __init__(
        self,
        service: InferenceService,
        max_request_bytes: int,
        max_concurrent: int = 0,
        restricted: Mapping[str, Restriction] | None = None,
        tls: ServerTls | None = None,
    ) -> None:
        self.service = service
        self.max_request_bytes = max_request_bytes
        self.max_concurrent = max_concurrent  # --max-concurrent-rpcs, as gRPC applies it
        self.active = 0
        self.port = 0
        self._runner: web.AppRunner | None = None
        self.tls = tls
        middlewares = [_errors]
        if tls is not None:  # every call checked: the peer, then the restricted groups
            middlewares.append(peer_middleware(tls.trust_domain, restricted or {}))
        elif restricted:
            middlewares.append(restricted_middleware(restricted))
        self.app = web.Application(middlewares=middlewares, client_max_size=max_request_bytes)
        get, post = web.get, web.post
        self.app.add_routes(
            [
                get("/v2/health/live", self.live, allow_head=False),
                get("/v2/health/ready", self.ready, allow_head=False),
                get("/v2", self.server_metadata, allow_head=False),
                get("/v2/models/stats", self.statistics, allow_head=False),
                post("/v2/repository/index", self.repository_index),
                post("/v2/repository/models/{name}/load", self.load),
                post("/v2/repository/models/{name}/unload", self.unload),
            ]
        )
        for base in (MODEL, VERSION):
            self.app.add_routes(
                [
                    get(base, self.model_metadata, allow_head=False),
                    get(f"{base}/ready", self.model_ready, allow_head=False),
                    get(f"{base}/config", self.model_config, allow_head=False),
                    get(f"{base}/stats", self.statistics, allow_head=False),
                    post(f"{base}/infer", self.infer),
                ]
            )
        # The OpenAI API of the generative models (protocol.openai), through the same path.
        self.openai = OpenAIApi(service, self._json_body, self._admitted)
        self.app.add_routes(self.openai.routes())

    async def start(self, host: str, port: int) -> int:
        # access_log off: one log line per inference would drown the server's own log.
        # handler_cancellation: a client that goes away cancels its request (counted
        # CANCELLED, its batch slot freed) instead of the server finishing it for nobody.
        self._runner = web.AppRunner(
            self.app, access_log=None, shutdown_timeout=1.0, handler_cancellation=True
        )
        await self._runner.setup()
        context = self.tls.ssl_context() if self.tls is not None else None
        site = web.TCPSite(self._runner, host, port, reuse_address=True, ssl_context=context)
        await site.start()
        server: Any = site._server  # an asyncio.Server: the bound port, when port was 0
        self.port = int(server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- health and metadata ------------------------------------------------------------------
    async def live(self, request: web.Request) -> web.Response:
        return json_response({"live": True})

    async def ready(self, request: web.Request) -> web.Response:
        ready = self.service.gate.ready()  # False while draining, as gRPC ServerReady
        return json_response({"ready": ready}, 200 if ready else 503)

    async def server_metadata(self, request: web.Request) -> web.Response:
        return json_response(
            {"name": SERVER_NAME, "version": __version__, "extensions": list(EXTENSIONS)}
        )

    async def model_metadata(self, request: web.Request) -> web.Response:
        name, version = _model(request)
        return json_response(message_json(self.service.model_metadata(name, version)))

    async def model_ready(self, request: web.Request) -> web.Response:
        name, version = _model(request)
        document: dict[str, Any] = {"name": name, "version": version, "ready": True}
        try:
            self.service.repository.resolve(name, version)
        except InferenceError as exc:
            document.update(ready=False, error=exc.message)
            return json_response(document, http_status(exc.code))
        return json_response(document)

    async def model_config(self, request: web.Request) -> web.Response:
        name, version = _model(request)
        return json_response(message_json(self.service.model_config(name, version).config))

    async def statistics(self, request: web.Request) -> web.Response:
        name, version = _model(request)
        return json_response(message_json(self.service.model_statistics(name, version)))

    # -- repository (Triton's model repository extension) ------------------------------------
    async def repository_index(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        ready = body.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidInput(f"field 'ready': expected true or false, got {ready!r}")
        rows = self.service.repository_index(ready)
        return json_response(
            [
                {"name": r.name, "version": r.version, "state": r.state, "reason": r.reason}
                for r in rows
            ]
        )

    async def load(self, request: web.Request) -> web.Response:
        parameters = _parameters(await self._json_body(request))
        await self.service.load_model(request.match_info["name"], parameters)
        return json_response({})

    async def unload(self, request: web.Request) -> web.Response:
        _parameters(await self._json_body(request))  # unload_dependents: nothing depends here
        await self.service.unload_model(request.match_info["name"])
        return json_response({})

    async def _json_body(self, request: web.Request) -> dict[str, Any]:
        """The request's JSON object; an empty body is ``{}``."""
        body = await self._read_body(request)
        return load_json_object(body) if body.strip() else {}

    # -- inference ----------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _admitted(self) -> AsyncIterator[None]:
        """One request in progress, within --max-concurrent-rpcs (as gRPC applies it)."""
        if self.max_concurrent and self.active >= self.max_concurrent:
            raise InferenceError(
                f"the server has {self.active} requests in progress, its limit "
                f"(--max-concurrent-rpcs {self.max_concurrent})",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1

    async def infer(self, request: web.Request) -> web.Response:
        name, version = _model(request)
        async with self._admitted():
            body = await self._read_body(request)
            # gRPC metadata keys are lower case; HTTP header names are case-insensitive.
            metadata = [(key.lower(), value) for key, value in request.headers.items()]
            try:
                length = header_length(request.headers.get(HEADER_LENGTH), len(body))
                decoded = (
                    await asyncio.to_thread(decode_infer, body, length, name, version)
                    if len(body) > OFFLOAD_DECODE_BYTES  # JSON is Python work per value
                    else decode_infer(body, length, name, version)
                )
                if names_shared_memory(decoded.request):
                    raise InvalidInput(
                        "parameters 'shared_memory_region', 'shared_memory_byte_size' and "
                        "'shared_memory_offset': system shared memory is served over gRPC only"
                    )
            except InferenceError as exc:  # counted as the gRPC path counts its refusals
                routed = request.headers.get(ROUTED_VERSION_HEADER, "")
                self.service.record_rejected(name, version or routed, exc.code, metadata)
                raise
            response = await self.service.infer(decoded.request, metadata)
            payload, json_length = encode_infer(response, decoded)
        answer = web.Response(body=payload, content_type=JSON_CONTENT_TYPE)
        # For the edge's token limit (control_plane.xds.token_admission), as gRPC reports it.
        answer.headers.update(usage_trailer(prompt_tokens(decoded.request), response))
        if json_length is not None:
            answer.content_type = BINARY_CONTENT_TYPE
            answer.headers[HEADER_LENGTH] = str(json_length)
        if any(e in request.headers.get("Accept-Encoding", "") for e in ("gzip", "deflate")):
            answer.enable_compression()
        return answer

    async def _read_body(self, request: web.Request) -> bytes:
        declared = request.content_length
        if declared is not None and declared > self.max_request_bytes:
            raise _too_large(declared, self.max_request_bytes)
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _too_large(None, self.max_request_bytes) from None


def _too_large(size: int | None, limit: int) -> web.HTTPException:
    got = f"of {format_bytes(size)} " if size is not None else ""
    return web.HTTPRequestEntityTooLarge(
        max_size=limit,
        actual_size=size or limit + 1,
        text=f"request body {got}exceeds the size limit of {format_bytes(limit)} "
        "(--max-request-bytes)",
    )


def _parameters(body: Mapping[str, Any]) -> dict[str, str]:
    """A load/unload body's ``parameters``: names to strings (``config`` is a JSON string)."""
    parameters = body.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidInput(f"field 'parameters': expected an object, got {parameters!r:.60}")
    result = {}
    for key, value in parameters.items():
        if key == "config" and not isinstance(value, str):
            raise InvalidInput("field 'parameters.config': expected the config as a JSON string")
        if not isinstance(value, str | bool | int | float):
            raise InvalidInput(f"field 'parameters.{key}': expected a string, number or boolean")
        result[key] = value if isinstance(value, str) else json.dumps(value)
    return result


def _model(request: web.Request) -> tuple[str, str]:
    return request.match_info.get("name", ""), request.match_info.get("version", "")
