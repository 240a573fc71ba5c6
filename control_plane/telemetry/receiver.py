"""The OTLP/gRPC metrics receiver: model servers export here, ``TelemetryStore`` keeps it.

The receiver takes raw bytes and decodes (``otlp_wire.decode_fast``, else
``otlp_decode.decode_request``) and ingests them in a worker thread, so a large request does
not stall the event loop; bytes that are not a request get INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from typing import TYPE_CHECKING, Protocol, cast

import grpc
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsPartialSuccess,
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.metrics.v1 import metrics_pb2

from control_plane.model.mesh import NO_PODS, ServerPods, UpstreamTls
from control_plane.telemetry import identity as otlp_identity
from control_plane.telemetry.decode import Point, PointTuple, decode_request
from control_plane.telemetry.envoy import is_envoy
from control_plane.telemetry.otlp_wire import decode_fast
from control_plane.xds import upstream_tls
from infermesh import pki

if TYPE_CHECKING:
    from control_plane.metrics import ControlPlaneMetrics
    from control_plane.telemetry.store import TelemetryStore
from control_plane.telemetry.values import IngestResult

log = logging.getLogger(__name__)

EXPORT_METHOD = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

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


def decode_raw(
    raw: bytes, max_points: int, split_envoy: bool
) -> tuple[list[PointTuple], dict[str, int], list[str], list[metrics_pb2.ResourceMetrics]]:
    """``split_and_decode`` of the bytes of an Export request, the points as plain tuples:
    ``decode_fast`` when it reads them (an exporter's usual export, ~1.3 us a point), else
    through protobuf's objects (~6 us). Raises DecodeError."""
    fast = decode_fast(raw, max_points)
    if fast is not None:
        return (*fast, [])
    request = ExportMetricsServiceRequest.FromString(raw)
    points, ignored, errors, envoy = split_and_decode(request, max_points, split_envoy)
    return cast("list[PointTuple]", [tuple(p) for p in points]), ignored, errors, envoy


def decode_export(raw: bytes, max_points: int, split_envoy: bool) -> Decoded:
    """``decode_raw``, Envoy's resources re-serialized (b"" when none). Pure, so it can run in
    a decoder process (``telemetry.decoder_processes``), off the control plane's GIL. The
    points go back as plain tuples: unpickling a named tuple calls its class, and at 20,000
    points a second that was 13% of the control plane's time. Raises DecodeError."""
    points, ignored, errors, envoy = decode_raw(raw, max_points, split_envoy)
    blob = ExportMetricsServiceRequest(resource_metrics=envoy).SerializeToString() if envoy else b""
    return points, ignored, errors, blob


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
        trust_domain: str | None = None,
        on_refused: Callable[[str], None] | None = None,
        pods: Callable[[], ServerPods] = lambda: NO_PODS,
    ) -> None:
        self.store = store
        # Mutual TLS on: each report is checked against its sender's identity first (on
        # Kubernetes a server's identity is its pod's, as discovery names it: ``pods``).
        self.trust_domain = trust_domain
        self.pods = pods
        self.refusals = otlp_identity.RefusalLog()
        self.on_refused = on_refused  # a shard's count of refusals (it has no ``metrics``)
        self.tally = tally  # instead of ``metrics``: a shard counts for the control plane
        self.envoy = envoy
        self.decoders = decoders  # decode in these processes; None: in a worker thread
        self.metrics = metrics
        self.clock = clock

    async def Export(
        self, request: ExportMetricsServiceRequest | bytes, context: grpc.aio.ServicerContext
    ) -> ExportMetricsServiceResponse:
        started = time.perf_counter()
        if self.trust_domain is not None:
            await self._check_sender(request, context)
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

    async def _check_sender(
        self, request: ExportMetricsServiceRequest | bytes, context: grpc.aio.ServicerContext
    ) -> None:
        """PERMISSION_DENIED unless every resource is the sender's own (otlp_identity)."""
        assert self.trust_domain is not None
        try:
            parsed = (
                ExportMetricsServiceRequest.FromString(request)
                if isinstance(request, bytes)
                else request
            )
        except DecodeError:
            return  # Export answers INVALID_ARGUMENT
        peer = pki.peer_spiffe_id(context.auth_context())
        refused = otlp_identity.refusal(peer, self.trust_domain, parsed, self.pods())
        if refused is None:
            return
        reason, message = refused
        if self.metrics is not None:
            self.metrics.telemetry_reports_rejected.labels(reason).inc()
        if self.on_refused is not None:
            self.on_refused(reason)
        self.refusals(peer or "unknown", reason, message)
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)

    def _ingest(self, request: ExportMetricsServiceRequest | bytes, now: float) -> IngestResult:
        max_points, split = self.store.max_points_per_request, self.envoy is not None
        if isinstance(request, bytes):
            return self._store(*decode_raw(request, max_points, split), now)
        return self._store(*split_and_decode(request, max_points, split), now)

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
    tls: Callable[[], UpstreamTls | None] | None = None,
    on_refused: Callable[[str], None] | None = None,
    pods: Callable[[], ServerPods] = lambda: NO_PODS,
) -> tuple[grpc.aio.Server, int]:
    """A started grpc.aio server with the receiver on HOST:PORT (0: a free port), and the
    bound port. Stop it with ``await server.stop(grace)``. ``tls``: the mesh's certificates as
    they are now (asked on each handshake): mutual TLS, each report bound to its sender
    (``pods``: the Kubernetes pod of each server address, when discovery names them).
    ``decoders`` (``start_decoders``) decode the requests in other processes; the caller
    shuts them down. ``reuse_port``: the port is shared with the other telemetry shards
    (SO_REUSEPORT); off, a second control plane on the same port fails to start instead of
    silently taking half the exports."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", int(reuse_port)),
        ]
    )
    current = tls() if tls is not None else None
    domain = current.trust_domain if current is not None else None
    receiver = MetricsReceiver(
        store, metrics, clock, envoy, decoders, tally, domain, on_refused, pods
    )
    add_receiver(receiver, server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = (
        server.add_secure_port(address, upstream_tls.server_credentials(tls))
        if tls is not None and current is not None
        else server.add_insecure_port(address)
    )
    await server.start()
    return server, bound
