"""The OpenAI-compatible API of a model server's generative models, on its REST port.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true``: server-sent
events in OpenAI's chunk format, then ``data: [DONE]``), ``GET /v1/models`` and
``GET /v1/models/{id}``. The official ``openai`` client works unchanged.

Nothing here generates: a body is checked (``protocol.openai_schema``), becomes a
``ModelInferRequest`` (``text_input`` and the generation parameters) and goes through
``InferenceService.stream``, the one request path (edge identity and the model header, drain
gate, version resolution and fallback, faults, tracing, deadlines, metrics). Each response of
that path is one generated token; usage counts them (the vocabulary is byte level: a prompt's
tokens are its UTF-8 bytes plus BOS). A client that goes away mid-stream closes the path's
iterator, which takes its sequence out of the engine (its KV blocks go back at the next step).

Errors are OpenAI's JSON ``{"error": {"message", "type", "param", "code"}}`` with the HTTP
status of the gRPC code; an error once a stream has begun is one SSE event
``data: {"error": ...}`` and the stream ends (no ``[DONE]``).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web
from tritonclient.grpc import service_pb2

from infermesh.wire import (
    FALLBACK_HEADER,
    OPENAI_CHAT_PATH,
    OPENAI_COMPLETIONS_PATH,
    OPENAI_MODELS_PATH,
    OPENAI_ROOT,
    TOKENS_USED_HEADER,
    VERSION_HEADER,
    VISIBLE_MODELS_HEADER,
)
from model_server.core.errors import InferenceError, ModelNotFound
from model_server.generative.chat import chat_template
from model_server.generative.streaming_text import TextAssembler
from model_server.generative.text import FINAL_PARAMETER, TEXT_INPUT, engine_settings
from model_server.lifecycle.version import ModelVersion
from model_server.protocol.openai_errors import (
    OpenAIError,
    error_document,
    exception_document,
    model_not_found,
)
from model_server.protocol.openai_schema import (
    Generation,
    check_context,
    parse_chat,
    parse_completion,
)
from model_server.protocol.service import InferenceService
from model_server.security.tenancy import check_model_header, header_value

JSON = "application/json"
OWNER = "infermesh"
Metadata = Sequence[tuple[str, Any]]
# OpenAI's finish_reason for the engine's: an end-of-text token or a stop sequence is "stop".
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def is_openai_path(path: str) -> bool:
    return path == OPENAI_ROOT or path.startswith(OPENAI_ROOT + "/")


def openai_error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """An error in OpenAI's shape, for failures outside a handler (404 path, 405, 413, 403)."""
    return _json(error_document(status, message), status, headers)


def openai_exception(exc: InferenceError) -> web.Response:
    status, document = exception_document(exc)
    return _json(document, status)


def _json(document: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    response = web.Response(
        body=json.dumps(document, separators=(",", ":")).encode(), status=status,
        content_type=JSON,
    )  # fmt: skip
    response.headers.update(headers or {})
    return response


def sse(document: Any) -> bytes:
    """One server-sent event carrying ``document`` as JSON."""
    return b"data: " + json.dumps(document, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def _text(response: service_pb2.ModelInferResponse) -> bytes:
    return bytes(response.raw_output_contents[0][4:]) if response.raw_output_contents else b""


def _finish(response: service_pb2.ModelInferResponse) -> str | None:
    if not response.parameters[FINAL_PARAMETER].bool_param:
        return None
    reason = response.parameters["finish_reason"].string_param
    return FINISH_REASONS.get(reason, "stop")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class OpenAIApi:
    """The /v1 routes over one InferenceService. ``read_json`` is the REST server's body
    reader (its size limit), ``admitted`` its in-progress limit (--max-concurrent-rpcs)."""

    def __init__(
        self,
        service: InferenceService,
        read_json: Callable[[web.Request], Awaitable[dict[str, Any]]],
        admitted: Callable[[], contextlib.AbstractAsyncContextManager[None]],
    ) -> None:
        self.service = service
        self.read_json = read_json
        self.admitted = admitted
        self.started = int(time.time())  # a model's "created": when this server started

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post(OPENAI_COMPLETIONS_PATH, self.completions),
            web.post(OPENAI_CHAT_PATH, self.chat_completions),
            web.get(OPENAI_MODELS_PATH, self.list_models, allow_head=False),
            web.get(OPENAI_MODELS_PATH + "/{name}", self.get_model, allow_head=False),
        ]

    # -- models -------------------------------------------------------------------------------
    def _model(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.started, "owned_by": OWNER}

    def generative_models(self) -> list[str]:
        """The models this server generates text with (a READY version with a generation
        scheduler), by name."""
        names = []
        for name in sorted(self.service.repository.models):
            with contextlib.suppress(InferenceError):
                if _generates(self.service.repository.resolve(name, "")):
                    names.append(name)
        return names

    async def list_models(self, request: web.Request) -> web.Response:
        names = self.generative_models()
        visible = request.headers.get(VISIBLE_MODELS_HEADER)
        if visible is not None:  # the edge's word on what the tenant may use: only narrows
            allowed = set(visible.split(","))
            names = [name for name in names if name in allowed]
        data = [self._model(name) for name in names]
        return _json({"object": "list", "data": data})

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in self.generative_models():
            raise model_not_found(name)
        return _json(self._model(name))

    # -- generation ---------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        metadata = [(key.lower(), value) for key, value in request.headers.items()]
        async with self.admitted():
            body = await self.read_json(request)
            try:
                generation, prompt_tokens, max_tokens = self._parse(body, chat, metadata)
            except InferenceError as exc:  # counted as the path counts its own refusals
                named = body.get("model")
                model = named if isinstance(named, str) else ""
                routed = header_value(metadata, VERSION_HEADER)
                self.service.record_rejected(model, routed, exc.code, metadata)
                raise
            kind = "chatcmpl" if chat else "cmpl"
            completion_id = f"{kind}-{uuid.uuid4().hex}"
            infer = infer_request(generation, max_tokens, completion_id)
            responses = self.service.stream(infer, metadata)
            async with contextlib.aclosing(responses):  # a client gone: its sequence ends
                first = await anext(responses)  # an error before any token: a plain answer
                reply = Reply(generation, completion_id, prompt_tokens, first.model_name)
                if generation.stream:
                    return await reply.stream(request, first, responses)
                return await reply.whole(first, responses)

    def _parse(
        self, body: dict[str, Any], chat: bool, metadata: Metadata
    ) -> tuple[Generation, int, int]:
        named = body.get("model")
        if isinstance(named, str):  # before anything is looked up: no probing other models
            check_model_header(metadata, named)
        if chat:  # the template is the model's: its version first
            found = self._version(named, metadata) if isinstance(named, str) and named else None
            config = found.spec.config if found is not None and found.spec else None
            generation = parse_chat(body, chat_template(config) if config else None)
        else:
            generation = parse_completion(body)
        version = self._version(generation.model, metadata)
        assert version.spec is not None
        max_positions = engine_settings(version.spec.config)[0]["max_positions"]
        prompt_tokens, max_tokens = check_context(generation, max_positions)
        return generation, prompt_tokens, max_tokens

    def _version(self, model: str, metadata: Metadata) -> ModelVersion:
        """The version this server would serve ``model`` with (its routed version, else the
        route's fallback model, as the request path resolves it); 404 in OpenAI's shape."""
        repository = self.service.repository
        try:
            version = repository.resolve(model, header_value(metadata, VERSION_HEADER))
        except ModelNotFound:
            fallback = header_value(metadata, FALLBACK_HEADER)
            if not fallback or fallback == model:
                raise model_not_found(model) from None
            version = repository.resolve(fallback, "")
        if not _generates(version):
            raise OpenAIError(
                f"model {model!r} does not generate text (a tensor model: use "
                f"/v2/models/{model}/infer)", "model", "model_not_supported",
            )  # fmt: skip
        return version


def _generates(version: ModelVersion) -> bool:
    return version.scheduler is not None and version.scheduler.streams


def infer_request(
    generation: Generation, max_tokens: int, request_id: str
) -> service_pb2.ModelInferRequest:
    """The ModelInferRequest the request path serves for ``generation``."""
    request = service_pb2.ModelInferRequest(model_name=generation.model, id=request_id)
    tensor = request.inputs.add(name=TEXT_INPUT, datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.append(generation.prompt.encode())
    request.parameters["max_tokens"].int64_param = max_tokens
    for name, value in generation.parameters.items():
        if isinstance(value, int):
            request.parameters[name].int64_param = value
        elif isinstance(value, float):
            request.parameters[name].double_param = value
    if generation.stops:
        request.parameters["stop_sequences"].string_param = json.dumps(list(generation.stops))
    return request


class Reply:
    """One completion's answer: whole, or as server-sent events."""

    def __init__(
        self, generation: Generation, completion_id: str, prompt_tokens: int, model: str
    ) -> None:
        self.generation = generation
        self.chat = generation.chat
        self.id = completion_id
        self.created = int(time.time())
        self.model = model or generation.model  # a fallback names the model that answered
        self.prompt_tokens = prompt_tokens
        self.tokens = 0
        self.text = TextAssembler(generation.stops)

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _push(self, response: service_pb2.ModelInferResponse) -> tuple[str, str | None]:
        """(the text this token adds, finish_reason when it is the last)."""
        self.tokens += 1
        text = self.text.push(_text(response))
        reason = _finish(response)
        if reason is not None:
            text += self.text.finish(response.parameters["finish_reason"].string_param == "stop")
        return text, reason

    async def whole(
        self,
        first: service_pb2.ModelInferResponse,
        rest: AsyncIterator[service_pb2.ModelInferResponse],
    ) -> web.Response:
        text, reason = self._push(first)
        pieces = [text]
        try:
            async for response in rest:
                text, reason = self._push(response)
                pieces.append(text)
        except InferenceError as exc:  # cut off (an unload, a deadline) after work was done:
            answer = openai_exception(exc)  # the edge charges what was made, never refunds it
            answer.headers[TOKENS_USED_HEADER] = str(self.prompt_tokens + self.tokens)
            return answer
        content = "".join(pieces)
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0, "message": {"role": "assistant", "content": content},
                "logprobs": None, "finish_reason": reason or "stop",
            }  # fmt: skip
            document = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": content, "logprobs": None,
                      "finish_reason": reason or "stop"}  # fmt: skip
            document = self._head("text_completion")
        document.update(choices=[choice], usage=usage(self.prompt_tokens, self.tokens))
        # What the edge settles a token reservation with (control_plane.xds.token_admission);
        # a streamed answer reports it in an SSE comment (``used_comment``).
        used = {TOKENS_USED_HEADER: str(self.prompt_tokens + self.tokens)}
        return _json(document, headers=used)

    def chunk(self, text: str | None, reason: str | None) -> dict[str, Any]:
        """One streamed chunk: ``text`` (chat: None opens the message with its role)."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if text is None else (
                {"content": text} if text else {}
            )  # fmt: skip
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": reason}  # fmt: skip
            document = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            document = self._head("text_completion")
        document["choices"] = [choice]
        if self.generation.include_usage:
            document["usage"] = None
        return document

    def usage_chunk(self) -> dict[str, Any]:
        document = self._head("chat.completion.chunk" if self.chat else "text_completion")
        document.update(choices=[], usage=usage(self.prompt_tokens, self.tokens))
        return document

    def used_comment(self) -> bytes:
        """The tokens this answer used, as an SSE comment (clients skip comment lines): what the
        edge settles a streamed answer's token reservation with, since its headers left before
        the tokens were known and aiohttp writes no trailers (control_plane.xds.token_admission)."""
        return f": {TOKENS_USED_HEADER} {self.prompt_tokens + self.tokens}\n\n".encode()

    async def stream(
        self,
        request: web.Request,
        first: service_pb2.ModelInferResponse,
        rest: AsyncIterator[service_pb2.ModelInferResponse],
    ) -> web.StreamResponse:
        answer = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await answer.prepare(request)
        if self.chat:
            await answer.write(sse(self.chunk(None, None)))
        try:
            response: service_pb2.ModelInferResponse | None = first
            while response is not None:  # to the path's end: it counts the request OK there
                text, reason = self._push(response)
                if text:
                    await answer.write(sse(self.chunk(text, None)))
                if reason is not None:
                    await answer.write(sse(self.chunk("", reason)))
                response = await anext(rest, None)
            if self.generation.include_usage:
                await answer.write(sse(self.usage_chunk()))
            await answer.write(self.used_comment())
            await answer.write(DONE)
        except InferenceError as exc:  # mid-stream: one error event, then the end
            await answer.write(sse(exception_document(exc)[1]))
            await answer.write(self.used_comment())
        except ConnectionError:  # the client went away: the caller closes the path's iterator
            return answer
        await answer.write_eof()
        return answer


def no_endpoint(request: web.Request) -> str:
    return (
        f"no endpoint {request.method} {request.path}; the OpenAI API here serves POST "
        f"{OPENAI_COMPLETIONS_PATH}, POST {OPENAI_CHAT_PATH} and GET {OPENAI_MODELS_PATH}"
    )
