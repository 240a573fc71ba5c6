"""The KServe v2 / Triton GRPCInferenceService, on the stubs that ship in tritonclient.grpc.

Why it is one module of this length: the GRPCInferenceService servicer is one class (gRPC's
shape), and the one request path lives in it; what the path calls (schedulers, validation,
tenancy) is elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from infermesh.wire import FALLBACK_HEADER, TOKENS_USED_HEADER
from infermesh.wire import VERSION_HEADER as ROUTED_VERSION_HEADER
from model_server import __version__
from model_server.core.errors import (
    InferenceError,
    InvalidInput,
    ModelConfigError,
    ModelNotFound,
    ModelUnavailable,
)
from model_server.core.faults import FaultInjector
from model_server.core.model_config import parse_config_override
from model_server.core.validation import request_scheduling, slow_to_decode
from model_server.generative.text import completion_tokens, join_text, prompt_tokens
from model_server.lifecycle.repository import IndexEntry, ModelRepository
from model_server.lifecycle.version import ModelState, ModelVersion
from model_server.observability.metrics import ServerMetrics
from model_server.observability.tracing import Tracing
from model_server.protocol.shared_memory import SharedMemoryRegistry
from model_server.protocol.shared_memory_rpc import SharedMemoryRpcs
from model_server.protocol.shared_memory_tensors import (
    Attachment,
    SystemSharedMemory,
    names_shared_memory,
)
from model_server.protocol.statistics import add_statistics
from model_server.protocol.token_usage import usage_trailer
from model_server.scheduling.gate import ServingGate
from model_server.scheduling.schedulers import Ticket
from model_server.security.tenancy import (
    EdgeIdentity,
    TenantLabels,
    check_inference,
    check_model_header,
    check_priority,
    edge_identity,
    header_value,
)

log = logging.getLogger(__name__)

SERVER_NAME = "infermesh"
MODEL_CONTROL_MODES = ("none", "explicit", "poll")
EXTENSIONS = ("model_repository", "model_configuration", "statistics", "binary_tensor_data")
# Set by Envoy on the share of a version split that a request without a version was sent to.
# Set by Envoy on the routes of a model with a fallback (control_plane.xds.protection): a server
# without the requested model serves this one instead and says so in the response.
FALLBACK_PARAMETER = "infermesh_fallback_from"
UNKNOWN_MODEL_LABEL = "_unknown"  # never a client-chosen string: label sets stay bounded


class InferenceService(SharedMemoryRpcs, service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(
        self,
        repository: ModelRepository,
        metrics: ServerMetrics,
        gate: ServingGate,
        max_request_bytes: int,
        on_repository_change: Callable[[str, bool], None],
        faults: FaultInjector | None = None,
        tracing: Tracing | None = None,
        model_control: str = "explicit",
        shared_memory: SystemSharedMemory | None = None,
    ) -> None:
        self.repository = repository
        self.model_control = model_control  # Triton's --model-control-mode: none|explicit|poll
        self.metrics = metrics
        self.gate = gate
        self.max_request_bytes = max_request_bytes
        self.on_repository_change = on_repository_change
        self.faults = faults or FaultInjector(enabled=False)
        self.tracing = tracing or Tracing(None, "")
        self.tenant_labels = TenantLabels()
        # Off unless given a restriction (protocol.shared_memory_tensors); RPCs in the mixin.
        self.shared_memory = shared_memory or SystemSharedMemory(None, SharedMemoryRegistry())
        self.device_label = repository.device.label

    # -- health and metadata ------------------------------------------------------------------
    async def ServerLive(self, request: object, context: grpc.aio.ServicerContext) -> object:
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: object, context: grpc.aio.ServicerContext) -> object:
        return service_pb2.ServerReadyResponse(ready=self.gate.ready())

    async def ModelReady(
        self, request: service_pb2.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> object:
        def ready(name: str, version: str) -> object:
            return service_pb2.ModelReadyResponse(ready=self.model_ready(name, version))

        return await _or_abort(context, ready, request.name, request.version)

    async def ServerMetadata(self, request: object, context: grpc.aio.ServicerContext) -> object:
        return service_pb2.ServerMetadataResponse(
            name=SERVER_NAME, version=__version__, extensions=list(self.extensions)
        )

    @property
    def extensions(self) -> tuple[str, ...]:
        return EXTENSIONS + (("system_shared_memory",) if self.shared_memory.enabled else ())

    async def ModelMetadata(
        self, request: service_pb2.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> object:
        return await _or_abort(context, self.model_metadata, request.name, request.version)

    async def ModelConfig(
        self, request: service_pb2.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> object:
        return await _or_abort(context, self.model_config, request.name, request.version)

    async def ModelStatistics(
        self, request: service_pb2.ModelStatisticsRequest, context: grpc.aio.ServicerContext
    ) -> object:
        return await _or_abort(context, self.model_statistics, request.name, request.version)

    # The answers themselves, for every transport (gRPC above, REST in model_server.protocol.rest):
    # each raises InferenceError, which the transport turns into its own status.
    def model_ready(self, name: str, version: str) -> bool:
        try:
            self.repository.resolve(name, version)
        except InferenceError:
            return False
        return True

    def model_metadata(self, name: str, version: str) -> service_pb2.ModelMetadataResponse:
        resolved = self.repository.resolve(name, version)
        assert resolved.spec is not None
        entry = self.repository.models[name]
        ready = sorted(v.version for v in entry.serving.values() if v.state is ModelState.READY)
        response = service_pb2.ModelMetadataResponse(
            name=name, versions=[str(v) for v in ready], platform="onnxruntime_onnx"
        )
        for tensors, target in (
            (resolved.spec.inputs, response.inputs),
            (resolved.spec.outputs, response.outputs),
        ):
            for tensor in tensors:
                target.add(
                    name=tensor.name,
                    datatype=tensor.datatype.name,
                    shape=tensor.shape_with_batch(resolved.spec.max_batch_size),
                )
        return response

    def model_config(self, name: str, version: str) -> service_pb2.ModelConfigResponse:
        resolved = self.repository.resolve(name, version)
        assert resolved.spec is not None and resolved.session is not None
        response = service_pb2.ModelConfigResponse()
        response.config.CopyFrom(resolved.spec.config)
        # Report what really runs the model, not what was asked for.
        response.config.parameters["execution_provider"].string_value = resolved.session.provider
        return response

    def model_statistics(self, name: str, version: str) -> service_pb2.ModelStatisticsResponse:
        versions = [
            v
            for v in self.repository.all_versions()
            if (not name or v.name == name) and (not version or str(v.version) == version)
        ]
        if name and not versions:
            raise ModelNotFound(f"no statistics for model {name!r} version {version or 'any'}")
        response = service_pb2.ModelStatisticsResponse()
        for v in sorted(versions, key=lambda v: (v.name, v.version)):
            add_statistics(response, v)
        return response

    # -- repository ---------------------------------------------------------------------------
    async def RepositoryIndex(
        self, request: service_pb2.RepositoryIndexRequest, context: grpc.aio.ServicerContext
    ) -> object:
        response = service_pb2.RepositoryIndexResponse()
        for row in self.repository_index(request.ready):
            response.models.add(
                name=row.name, version=row.version, state=row.state, reason=row.reason
            )
        return response

    async def RepositoryModelLoad(
        self, request: service_pb2.RepositoryModelLoadRequest, context: grpc.aio.ServicerContext
    ) -> object:
        if request.repository_name:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"repository_name {request.repository_name!r}: one repository only",
            )
        parameters = {k: v.string_param for k, v in request.parameters.items()}
        try:
            await self.load_model(request.model_name, parameters)
        except InferenceError as exc:
            await context.abort(exc.code, exc.message)
        return service_pb2.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: service_pb2.RepositoryModelUnloadRequest, context: grpc.aio.ServicerContext
    ) -> object:
        try:
            await self.unload_model(request.model_name)
        except InferenceError as exc:
            await context.abort(exc.code, exc.message)
        return service_pb2.RepositoryModelUnloadResponse()

    def repository_index(self, ready_only: bool) -> list[IndexEntry]:
        self.metrics.control_requests.labels("index").inc()
        return self.repository.index(ready_only=ready_only)

    def _check_control(self, call: str) -> None:
        """Loads and unloads are for ``explicit`` mode only, as in Triton."""
        if self.model_control != "explicit":
            raise ModelUnavailable(
                f"{call} refused: the server runs with --model-control-mode "
                f"{self.model_control}; only 'explicit' accepts loads and unloads"
            )

    async def load_model(self, name: str, parameters: Mapping[str, str]) -> None:
        """RepositoryModelLoad (gRPC or REST); ``parameters`` may hold Triton's ``config``."""
        self.metrics.control_requests.labels("load").inc()
        self._check_control("model load")
        try:
            if self.gate.refusing:
                raise ModelUnavailable("server is draining; no model loads")
            files = [k for k in parameters if k.startswith("file:")]
            if files:
                raise InvalidInput(f"parameters {files}: file overrides are not supported")
            override = None
            if "config" in parameters:
                try:
                    override = parse_config_override(parameters["config"], name)
                except ModelConfigError as exc:
                    raise InvalidInput(f"model {name!r}: {exc}") from exc
            await self.repository.load(name, override)
        finally:
            self.on_repository_change(name, True)

    async def unload_model(self, name: str) -> None:
        self.metrics.control_requests.labels("unload").inc()
        self._check_control("model unload")
        await self.repository.unload(name)
        self.on_repository_change(name, False)

    # -- inference ----------------------------------------------------------------------------
    async def ModelInfer(
        self, request: service_pb2.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> object:
        metadata = context.invocation_metadata() or ()
        prompt = prompt_tokens(request)
        try:
            response = await self.infer(request, metadata, context.time_remaining())
        except InferenceError as exc:  # the edge's token reservation: refunded if refused
            trailers = usage_trailer(prompt, refused=exc.code)  # before any work
            await context.abort(exc.code, exc.message, trailing_metadata=trailers)
            raise AssertionError("unreachable") from exc
        if prompt is not None:
            context.set_trailing_metadata(usage_trailer(prompt, response))
        return response

    async def infer(
        self,
        request: service_pb2.ModelInferRequest,
        metadata: Sequence[tuple[str, Any]],
        time_remaining_s: float | None = None,
    ) -> service_pb2.ModelInferResponse:
        """One ModelInfer whatever the transport (gRPC, or REST converted by protocol.rest):
        routing headers in ``metadata`` (lower-case names), tracing, gate, validation,
        scheduling, metrics. A generative model's completion comes as one answer. Raises
        InferenceError with the status to answer."""
        responses = [
            r async for r in self._traced(request, metadata, _routed_version(metadata),
                                          time_remaining_s)
        ]  # fmt: skip
        return responses[0] if len(responses) == 1 else join_text(responses)

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[service_pb2.ModelInferRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[service_pb2.ModelStreamInferResponse]:
        """Each request on the stream gets its responses (one, or one per generated token, the
        last final) or an error message, in order."""
        metadata = context.invocation_metadata() or ()
        routed = _routed_version(metadata)
        used: int | None = None  # the text generations' tokens, for the edge's token limit
        async for request in request_iterator:
            prompt = prompt_tokens(request)
            try:
                async for response in self._traced(request, metadata, routed):
                    if prompt is not None:
                        used = (used or 0) + completion_tokens([response])
                    yield service_pb2.ModelStreamInferResponse(infer_response=response)
                if prompt is not None:
                    used = (used or 0) + prompt
            except InferenceError as exc:
                yield service_pb2.ModelStreamInferResponse(error_message=exc.message)
        if used is not None:
            context.set_trailing_metadata(((TOKENS_USED_HEADER, str(used)),))

    def stream(
        self, request: service_pb2.ModelInferRequest, metadata: Sequence[tuple[str, Any]]
    ) -> AsyncGenerator[service_pb2.ModelInferResponse, None]:
        """One request's responses as ModelStreamInfer yields them (one per generated token,
        the last final), for transports that stream on their own (REST's OpenAI API,
        ``protocol.openai``). Raises InferenceError with the status to answer."""
        return self._traced(request, metadata, _routed_version(metadata))

    async def _traced(
        self,
        request: service_pb2.ModelInferRequest,
        metadata: Sequence[tuple[str, Any]],
        routed: str,
        time_remaining_s: float | None = None,
    ) -> AsyncGenerator[service_pb2.ModelInferResponse, None]:
        """``_serve`` in one tracing span (a completion's tokens share it)."""
        identity = edge_identity(metadata, self.tenant_labels)
        with self.tracing.span(metadata) as span:
            if span is not None and identity.tenant:
                span.set_attribute("infermesh.tenant", identity.tenant)
            try:
                async for response in self._serve(
                    request, routed, span, metadata, time_remaining_s, identity
                ):
                    yield response
            except InferenceError as exc:
                self.tracing.finish(span, exc.code, exc.message)
                raise
            self.tracing.finish(span, grpc.StatusCode.OK)

    async def _serve(
        self,
        request: service_pb2.ModelInferRequest,
        routed_version: str,
        span: Any,
        metadata: Sequence[tuple[str, Any]],
        time_remaining_s: float | None,
        identity: EdgeIdentity,
    ) -> AsyncIterator[service_pb2.ModelInferResponse]:
        """The one request path, for every kind of model: authorise, admit through the gate,
        resolve the version once (or the fallback), prepare, inject faults, then the version's
        scheduler runs it (scheduling.py); counted once however it ends."""
        started = time.monotonic_ns()
        version: ModelVersion | None = None
        code = grpc.StatusCode.OK
        try:
            check_inference(metadata, identity, request, routed_version)
            self.gate.enter()
        except InferenceError as exc:
            self._record(None, exc.code, 0, identity.label)
            raise
        try:
            version, fallback_from = self._resolve(request, routed_version, metadata)
            version.begin_request()
            attached: Attachment | None = None
            try:
                scheduler = version.scheduler
                if scheduler is None:
                    raise ModelUnavailable(f"{version.label} is {version.state.value}")
                if names_shared_memory(request):  # tensors in registered regions
                    attached = self._attach(request, metadata, scheduler.streams)
                target = request if attached is None else attached.request
                prepared = (
                    await asyncio.to_thread(scheduler.prepare, target, self.max_request_bytes)
                    if slow_to_decode(request)
                    else scheduler.prepare(target, self.max_request_bytes)
                )
                priority, timeout_s = request_scheduling(request, metadata, time_remaining_s)
                check_priority(identity, priority)
                if span is not None:
                    span.set_attribute("infermesh.model", version.name)
                    span.set_attribute("infermesh.model.version", str(version.version))
                    span.set_attribute("infermesh.batch_size", prepared.rows)
                self.metrics.child(self.metrics.batch_size, version.name).observe(prepared.rows)
                if self.faults.enabled:  # drills cover every kind of model alike
                    await self.faults.before_execute(version.version)
                ticket = Ticket(priority, timeout_s, started / 1e9)
                async for response in scheduler.responses(prepared, ticket):
                    if attached is not None:
                        attached.write_outputs(response)
                    if fallback_from:
                        response.parameters[FALLBACK_PARAMETER].string_param = fallback_from
                    yield response
            finally:
                version.end_request()
                if attached is not None:
                    attached.release()
        except InferenceError as exc:
            code = exc.code
            raise
        except (asyncio.CancelledError, GeneratorExit):
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:
            code = grpc.StatusCode.INTERNAL
            log.exception("model %r: inference failed", request.model_name)
            raise InferenceError(
                f"model {request.model_name!r}: inference failed: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            elapsed = time.monotonic_ns() - started
            self.gate.leave()
            self._record(version, code, elapsed, identity.label)

    def _attach(
        self,
        request: service_pb2.ModelInferRequest,
        metadata: Sequence[tuple[str, Any]],
        streams: bool,
    ) -> Attachment:
        if streams:
            raise InvalidInput(
                f"model {request.model_name!r} generates text: shared memory regions are for "
                "tensor models"
            )
        return self.shared_memory.attach(request, metadata)

    def _resolve(
        self,
        request: service_pb2.ModelInferRequest,
        routed_version: str,
        metadata: Sequence[tuple[str, Any]],
    ) -> tuple[ModelVersion, str]:
        """(the version that serves ``request``, the model it stands in for or ""): the one
        asked for, else the route's fallback model (Envoy's header) at its newest READY
        version."""
        wanted = request.model_version or routed_version
        try:
            return self.repository.resolve(request.model_name, wanted), ""
        except (ModelNotFound, ModelUnavailable):
            fallback = header_value(metadata, FALLBACK_HEADER)
            if not fallback or fallback == request.model_name:
                raise
            return self.repository.resolve(fallback, ""), request.model_name

    def _record(
        self, version: ModelVersion | None, code: grpc.StatusCode, elapsed_ns: int, tenant: str
    ) -> None:
        model = version.name if version is not None else UNKNOWN_MODEL_LABEL
        metrics = self.metrics
        metrics.child(metrics.tenant_requests, model, tenant, code.name).inc()
        if version is None:
            metrics.child(metrics.requests, UNKNOWN_MODEL_LABEL, "", code.name).inc()
            return
        version.request_counter(code.name).inc()
        version.duration_metric.observe(elapsed_ns / 1e9)
        outcome = version.stats.success if code is grpc.StatusCode.OK else version.stats.fail
        outcome.add(elapsed_ns)

    def record_rejected(
        self, name: str, version: str, code: grpc.StatusCode, metadata: Sequence[tuple[str, Any]]
    ) -> None:
        """Counts a request its transport refused before ``infer`` (a REST body that does not
        convert), under the labels the same refusal gets over gRPC from the validation."""
        try:
            resolved: ModelVersion | None = self.repository.resolve(name, version)
        except InferenceError:
            resolved = None
        self._record(resolved, code, 0, edge_identity(metadata, self.tenant_labels).label)


async def _or_abort(
    context: grpc.aio.ServicerContext, answer: Callable[[str, str], Any], name: str, version: str
) -> Any:
    """``answer`` for one model, once the routing header (Envoy routed and authorised the call
    by it) is seen to name that model; its error as the call's status."""
    try:
        check_model_header(context.invocation_metadata() or (), name)
        return answer(name, version)
    except InferenceError as exc:
        await context.abort(exc.code, exc.message)
    raise AssertionError("unreachable")


def _routed_version(metadata: Sequence[tuple[str, Any]]) -> str:
    """The version Envoy routed a request to (a version split), for requests that name none."""
    return header_value(metadata, ROUTED_VERSION_HEADER)
