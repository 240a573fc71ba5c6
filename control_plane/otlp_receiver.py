"""The OTLP/gRPC metrics receiver: model servers export here, ``TelemetryStore`` keeps it.

``decode_request`` (pure) turns an ``ExportMetricsServiceRequest`` into validated ``Point``s
and counts what it ignores, by reason: ``no_instance_id`` (a resource without
service.instance.id), ``unknown_metric`` (a name the store does not use; not reported back
as rejected), ``unsupported_type`` (exponential histograms, summaries, no data),
``wrong_type``, ``bad_temporality``, ``no_value``, ``nan``, ``negative``, ``bad_buckets``
(bounds not finite and increasing, or too many), ``bucket_mismatch`` (counts do not match the
bounds or the total), ``too_many_points`` (over the per-request cap); the store adds
``series_limit`` and ``endpoint_limit``, the receiver ``undecodable`` (bytes that are not a
request: INVALID_ARGUMENT). The receiver takes raw bytes and decodes and ingests them in a
worker thread, so a large request does not stall the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import multiprocessing
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, cast

import grpc
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsPartialSuccess,
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2

from control_plane.envoy_stats import is_envoy

if TYPE_CHECKING:
    from control_plane.metrics import ControlPlaneMetrics
    from control_plane.telemetry import IngestResult, TelemetryStore

log = logging.getLogger(__name__)

EXPORT_METHOD = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_BUCKETS = 512
MAX_ATTRIBUTES = 16
MAX_ATTRIBUTE_CHARS = 128
KINDS = {
    "inference_request_duration_seconds": "histogram",
    "inference_batch_size": "histogram",
    "inference_requests": "counter",
    "inference_queue_depth": "gauge",
    "inference_in_flight_requests": "gauge",
    "accelerator_memory_used_bytes": "gauge",
    "accelerator_memory_total_bytes": "gauge",
    "kv_cache_blocks_used": "gauge",
    "kv_cache_blocks_total": "gauge",
    "model_state": "gauge",
    "server_draining": "gauge",
    "server_label": "gauge",  # routing labels a server reports (name, value)
}
_DELTA = metrics_pb2.AGGREGATION_TEMPORALITY_DELTA
_CUMULATIVE = metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE
_NO_VALUE = metrics_pb2.DATA_POINT_FLAGS_NO_RECORDED_VALUE_MASK


class Point(NamedTuple):
    """One validated data point. A named tuple, not a dataclass: at fleet scale the receiver
    makes ~100,000 of them a second, and a frozen dataclass costs several times more to build."""

    endpoint: str  # service.instance.id
    name: str
    kind: str  # "gauge", "counter", "histogram"
    attrs: tuple[tuple[str, str], ...]  # sorted
    values: Sequence[float]  # (value,) or the bucket counts (an array of doubles)
    bounds: tuple[float, ...] = ()
    delta: bool = False
    start_ns: int = 0
    duration_s: float = 0.0  # time_unix_nano - start_time_unix_nano (0 when unknown)


# A Point as a plain tuple, in the same order: what decoder processes send back (see
# decode_export); the store takes either.
PointTuple = tuple[
    str, str, str, tuple[tuple[str, str], ...], Sequence[float], tuple[float, ...], bool, int, float
]


class _Rejected(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def decode_request(
    request: ExportMetricsServiceRequest, max_points: int
) -> tuple[list[Point], dict[str, int], list[str]]:
    """(the valid points, ignored counts by reason, the first error messages).

    Checks that hold for a whole metric (its type, its temporality) are made once per metric,
    and histogram bounds once per distinct bounds, so the per-point work is reading it."""
    points: list[Point] = []
    ignored: Counter[str] = Counter()
    errors: list[str] = []
    checked_bounds: dict[tuple[float, ...], str] = {}  # bounds -> "" (valid) or the error

    def ignore(reason: str, n: int, detail: str) -> None:
        ignored[reason] += n
        if len(errors) < 5:
            errors.append(f"{reason}: {detail}")

    budget = max_points
    for resource_metrics in request.resource_metrics:
        endpoint = _instance_id(resource_metrics.resource.attributes)
        for scope in resource_metrics.scope_metrics:
            for metric in scope.metrics:
                data = metric.WhichOneof("data")
                container: Any = getattr(metric, data) if data else None
                data_points = container.data_points if container is not None else ()
                count = len(data_points) if data else 1
                if budget < count:
                    ignore("too_many_points", count, f"more than {max_points} points")
                    continue
                budget -= count
                name = metric.name
                kind = KINDS.get(name)
                if not endpoint or len(endpoint) > 256:
                    ignore("no_instance_id", count, "resource has no service.instance.id")
                elif kind is None:
                    ignored["unknown_metric"] += count
                elif data not in ("gauge", "sum", "histogram"):
                    ignore("unsupported_type", count, f"{name}: {data or 'no data'}")
                elif problem := _metric_problem(kind, data, container):
                    if count:
                        ignore(problem[0], count, f"{name}: {problem[1]}")
                else:
                    delta = data != "gauge" and container.aggregation_temporality == _DELTA
                    for point in data_points:
                        try:
                            points.append(
                                _point(endpoint, name, kind, delta, point, checked_bounds)
                            )
                        except _Rejected as exc:
                            ignore(exc.reason, 1, f"{name}: {exc}")
    return points, dict(ignored), errors


def _metric_problem(kind: str, data: str, container: Any) -> tuple[str, str] | None:
    """(reason, detail) when no point of this metric can be used, else None."""
    temporality = container.aggregation_temporality if data in ("histogram", "sum") else 0
    if (kind == "histogram") != (data == "histogram") or (kind == "counter" and data != "sum"):
        return "wrong_type", f"{data} for a {kind}"
    if kind != "gauge" and temporality not in (_DELTA, _CUMULATIVE):
        return "bad_temporality", f"aggregation temporality {temporality}"
    if kind == "gauge" and temporality == _DELTA:
        return "bad_temporality", "a delta sum for a gauge"
    return None


def _point(
    endpoint: str,
    name: str,
    kind: str,
    delta: bool,
    p: Any,
    checked_bounds: dict[tuple[float, ...], str],
) -> Point:
    if p.flags & _NO_VALUE:
        raise _Rejected("no_value", "no recorded value")
    start = p.start_time_unix_nano
    duration = max(0.0, (p.time_unix_nano - start) / 1e9) if start else 0.0
    attrs = _sorted_attributes(p.attributes)
    if kind == "histogram":
        bounds = tuple(p.explicit_bounds)
        problem = checked_bounds.get(bounds)
        if problem is None:
            problem = checked_bounds[bounds] = _bounds_problem(bounds)
        if problem:
            raise _Rejected("bad_buckets", problem)
        counts = _buckets(p, bounds)
        return Point(endpoint, name, kind, attrs, counts, bounds, delta, start, duration)
    which = p.WhichOneof("value")
    if which is None:
        raise _Rejected("no_value", "a number point without a value")
    value = float(p.as_double if which == "as_double" else p.as_int)
    if not math.isfinite(value):
        raise _Rejected("nan", f"value {value}")
    if kind == "counter" and value < 0:
        raise _Rejected("negative", f"counter value {value}")
    return Point(endpoint, name, kind, attrs, (value,), (), delta, start, duration)


def _bounds_problem(bounds: tuple[float, ...]) -> str:
    if not bounds or len(bounds) > MAX_BUCKETS or not all(map(math.isfinite, bounds)):
        return f"{len(bounds)} bounds, or not finite"
    if any(a >= b for a, b in itertools.pairwise(bounds)):
        return "bounds not strictly increasing"
    return ""


def _buckets(p: metrics_pb2.HistogramDataPoint, bounds: tuple[float, ...]) -> array[float]:
    # An array of doubles: 8 bytes a bucket where a tuple of floats takes 32 (at 10,000
    # endpoints the store's windows of histograms were most of the control plane's memory).
    counts = array("d", p.bucket_counts)
    if len(counts) != len(bounds) + 1:
        raise _Rejected("bucket_mismatch", f"{len(counts)} counts, {len(bounds)} bounds")
    if sum(counts) != p.count:
        raise _Rejected("bucket_mismatch", f"bucket counts sum to {sum(counts)}, count {p.count}")
    if p.HasField("sum") and not math.isfinite(p.sum):
        raise _Rejected("nan", f"sum {p.sum}")
    return counts


def _instance_id(attributes: Iterable[KeyValue]) -> str:
    for kv in attributes:
        if kv.key == "service.instance.id":
            return _attribute_value(kv) or ""
    return ""


def _sorted_attributes(attributes: Iterable[KeyValue]) -> tuple[tuple[str, str], ...]:
    pairs = {}
    for kv in attributes:
        value = _attribute_value(kv)
        if value is not None:
            pairs[kv.key[:MAX_ATTRIBUTE_CHARS]] = value
    return tuple(sorted(pairs.items()))[:MAX_ATTRIBUTES]


def _attribute_value(kv: KeyValue) -> str | None:
    """A string, int, bool or double attribute as text (cut to MAX_ATTRIBUTE_CHARS); None for
    other kinds (arrays, maps, bytes)."""
    value = kv.value
    text = value.string_value  # the usual kind, read without WhichOneof (which costs more)
    if text:
        return text[:MAX_ATTRIBUTE_CHARS]
    which = value.WhichOneof("value")
    if which == "string_value":
        return ""
    if which in ("int_value", "bool_value", "double_value"):
        return str(getattr(value, which))[:MAX_ATTRIBUTE_CHARS]
    return None


Decoded = tuple[list[PointTuple], dict[str, int], list[str], bytes]


def split_and_decode(
    request: ExportMetricsServiceRequest, max_points: int, split_envoy: bool
) -> tuple[list[Point], dict[str, int], list[str], list[metrics_pb2.ResourceMetrics]]:
    """``decode_request`` of the model servers' resources, and Envoy's resources apart (its
    stat sink's per-endpoint stats go to their own view) when ``split_envoy``."""
    envoy: list[metrics_pb2.ResourceMetrics] = []
    if split_envoy and any(is_envoy(r) for r in request.resource_metrics):
        resources = request.resource_metrics
        envoy = [r for r in resources if is_envoy(r)]
        request = ExportMetricsServiceRequest(
            resource_metrics=[r for r in resources if not is_envoy(r)]
        )
    return (*decode_request(request, max_points), envoy)


def decode_export(raw: bytes, max_points: int, split_envoy: bool) -> Decoded:
    """Bytes of an Export request -> ``split_and_decode``, Envoy's resources re-serialized (b""
    when none). Pure, so it can run in a decoder process (``telemetry.decoder_processes``):
    decoding costs ~15-25 us a point in Python, most of the receiver's time, and a process
    takes it off the control plane's GIL. The points go back as plain tuples: unpickling a
    named tuple calls its class, and at 20,000 points a second that was 13% of the control
    plane's time. Raises DecodeError."""
    request = ExportMetricsServiceRequest.FromString(raw)
    points, ignored, errors, envoy = split_and_decode(request, max_points, split_envoy)
    blob = ExportMetricsServiceRequest(resource_metrics=envoy).SerializeToString() if envoy else b""
    return cast("list[PointTuple]", [tuple(p) for p in points]), ignored, errors, blob


def start_decoders(processes: int) -> ProcessPoolExecutor:
    """A pool of OTLP decoder processes (spawned: the control plane has threads and gRPC)."""
    return ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"))


# -- the gRPC service ------------------------------------------------------------------------
class EnvoySink(Protocol):
    """Where Envoy's own resources go (``EnvoyStats``; a telemetry shard forwards them)."""

    def ingest(self, resources: Iterable[metrics_pb2.ResourceMetrics], now: float) -> int: ...


# (the result, or None for an undecodable request; ignored points by reason; seconds taken)
Tally = Callable[["IngestResult | None", dict[str, int], float], None]


class MetricsReceiver(metrics_service_pb2_grpc.MetricsServiceServicer):
    """OTLP MetricsService.Export on grpc.aio; times are ``clock()`` (monotonic by default):
    read the store with the same clock (``store.as_json(time.monotonic())``)."""

    def __init__(
        self,
        store: TelemetryStore,
        metrics: ControlPlaneMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        envoy: EnvoySink | None = None,
        decoders: Executor | None = None,
        tally: Tally | None = None,
    ) -> None:
        self.store = store
        self.tally = tally  # instead of ``metrics``: a shard counts for the control plane
        self.envoy = envoy
        self.decoders = decoders  # decode in these processes; None: in a worker thread
        self.metrics = metrics
        self.clock = clock

    async def Export(
        self, request: ExportMetricsServiceRequest | bytes, context: grpc.aio.ServicerContext
    ) -> ExportMetricsServiceResponse:
        started = time.perf_counter()
        try:
            if self.decoders is not None and isinstance(request, bytes):
                loop = asyncio.get_running_loop()
                max_points, split = self.store.max_points_per_request, self.envoy is not None
                decoded = await loop.run_in_executor(
                    self.decoders, decode_export, request, max_points, split
                )
                result = await asyncio.to_thread(self._ingest_decoded, decoded, self.clock())
            else:
                result = await asyncio.to_thread(self._ingest, request, self.clock())
        except DecodeError as exc:
            self._count(None, {"undecodable": 1}, started)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not an export request: {exc}")
        self._count(result, dict(result.ignored), started)
        if not result.rejected and not result.errors:
            return ExportMetricsServiceResponse()
        reasons = ", ".join(f"{reason}={n}" for reason, n in result.ignored)
        message = "; ".join([f"ignored points: {reasons}", *result.errors])[:1000]
        partial = ExportMetricsPartialSuccess(
            rejected_data_points=result.rejected, error_message=message
        )
        return ExportMetricsServiceResponse(partial_success=partial)

    def _ingest(self, request: ExportMetricsServiceRequest | bytes, now: float) -> IngestResult:
        if isinstance(request, bytes):
            request = ExportMetricsServiceRequest.FromString(request)
        split = self.envoy is not None
        points, ignored, errors, envoy = split_and_decode(
            request, self.store.max_points_per_request, split
        )
        return self._store(points, ignored, errors, envoy, now)

    def _ingest_decoded(self, decoded: Decoded, now: float) -> IngestResult:
        points, ignored, errors, blob = decoded
        envoy = list(ExportMetricsServiceRequest.FromString(blob).resource_metrics) if blob else []
        return self._store(points, ignored, errors, envoy, now)

    def _store(
        self,
        points: Sequence[PointTuple],
        ignored: dict[str, int],
        errors: list[str],
        envoy: list[metrics_pb2.ResourceMetrics],
        now: float,
    ) -> IngestResult:
        result = self.store.ingest_points(points, ignored, errors, now)
        if envoy and self.envoy is not None:
            used = self.envoy.ingest(envoy, now)
            result = dataclasses.replace(result, points=result.points + used)
        return result

    def _count(self, result: IngestResult | None, ignored: dict[str, int], started: float) -> None:
        if self.tally is not None:
            self.tally(result, ignored, time.perf_counter() - started)
        m = self.metrics
        if m is None:
            return
        m.telemetry_ingest.observe(time.perf_counter() - started)
        m.telemetry_points.inc(result.points if result else 0)
        for reason, n in ignored.items():
            m.telemetry_points_ignored.labels(reason).inc(n)
        m.telemetry_endpoints.set(len(self.store))


def add_receiver(receiver: MetricsReceiver, server: grpc.aio.Server) -> None:
    """Registers Export taking raw bytes, so undecodable ones get INVALID_ARGUMENT (the
    generated helper would answer them with INTERNAL)."""
    handler = grpc.unary_unary_rpc_method_handler(
        receiver.Export, response_serializer=ExportMetricsServiceResponse.SerializeToString
    )
    service = EXPORT_METHOD.split("/")[1]
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service, {"Export": handler}),)
    )


async def start_receiver(
    store: TelemetryStore,
    metrics: ControlPlaneMetrics | None,
    host: str,
    port: int,
    clock: Callable[[], float] = time.monotonic,
    envoy: EnvoySink | None = None,
    decoders: Executor | None = None,
    tally: Tally | None = None,
    reuse_port: bool = False,
) -> tuple[grpc.aio.Server, int]:
    """A started grpc.aio server with the receiver on HOST:PORT (0: a free port), and the
    bound port. Stop it with ``await server.stop(grace)``. ``decoders`` (``start_decoders``)
    decode the requests in other processes; the caller shuts them down. ``reuse_port``: the
    port is shared with the other telemetry shards (SO_REUSEPORT); off, a second control
    plane on the same port fails to start instead of silently taking half the exports."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", int(reuse_port)),
        ]
    )
    add_receiver(MetricsReceiver(store, metrics, clock, envoy, decoders, tally), server)
    bound = server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    await server.start()
    return server, bound
