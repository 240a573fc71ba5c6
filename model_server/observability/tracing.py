"""OpenTelemetry server spans for inference calls, continuing the caller's W3C trace context.

Off unless --trace-endpoint is given; then each ModelInfer (and each request on a stream) is a
SERVER span with the model, version, batch size and gRPC status, exported over OTLP/gRPC in
batches. The ``traceparent`` / ``tracestate`` request headers (passed through Envoy unchanged)
make the span a child of the client's, so one trace shows client -> Envoy -> server.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

TRACE_HEADERS = ("traceparent", "tracestate")
SPAN_NAME = "inference.GRPCInferenceService/ModelInfer"
_NO_SPAN: contextlib.nullcontext[None] = contextlib.nullcontext()  # reusable, holds no state


class Tracing:
    def __init__(self, endpoint: str | None, instance_id: str) -> None:
        self._tracer: Any = None
        self._provider: Any = None
        if not endpoint:
            return
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create(
            {"service.name": "infermesh-model-server", "service.instance.id": instance_id}
        )
        self._provider = TracerProvider(resource=resource)
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True, timeout=2)
        self._provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
        self._tracer = self._provider.get_tracer("model_server")
        self._propagator = TraceContextTextMapPropagator()

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def span(self, metadata: Sequence[tuple[str, Any]]) -> contextlib.AbstractContextManager[Any]:
        """A SERVER span under the caller's context; yields None when tracing is off (a
        shared no-op context: no generator and no context manager built per request)."""
        if self._tracer is None:
            return _NO_SPAN
        return self._span(metadata)

    @contextlib.contextmanager
    def _span(self, metadata: Sequence[tuple[str, Any]]) -> Iterator[Any]:
        from opentelemetry.trace import SpanKind

        carrier = {k: str(v) for k, v in metadata if k in TRACE_HEADERS}
        parent = self._propagator.extract(carrier)
        with self._tracer.start_as_current_span(
            SPAN_NAME,
            context=parent,
            kind=SpanKind.SERVER,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            span.set_attribute("rpc.system", "grpc")
            yield span

    @staticmethod
    def finish(span: Any, code: grpc.StatusCode, message: str = "") -> None:
        if span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code is not grpc.StatusCode.OK:
            span.set_status(Status(StatusCode.ERROR, message))

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()  # flushes what is queued
