"""OTLP export of the Prometheus instruments in model_server.observability.metrics (one definition).

``registry.collect()`` is converted into an OTLP ``ExportMetricsServiceRequest`` and pushed with
the MetricsService gRPC stub every ``--telemetry-interval`` seconds:

* Counter -> Sum (monotonic, CUMULATIVE), named after the family without ``_total``
* Gauge -> Gauge
* Histogram -> Histogram (CUMULATIVE; explicit bounds without +Inf, non-cumulative bucket counts)

Labels become string attributes; ``*_created`` samples are skipped.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from model_server import __version__
from model_server.security.peers import ServerTls

log = logging.getLogger(__name__)

SERVICE_NAME = "infermesh-model-server"
SCOPE_NAME = "model_server.observability.metrics"
MIN_INTERVAL_S = 0.2
MAX_EXPORT_TIMEOUT_S = 2.0
ERROR_LOG_EVERY_S = 30.0
PROCESS_START_NS = time.time_ns()  # imported at server start-up
CUMULATIVE = metrics_pb2.AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE


def _attributes(labels: dict[str, str]) -> list[common_pb2.KeyValue]:
    return [
        common_pb2.KeyValue(key=k, value=common_pb2.AnyValue(string_value=str(v)))
        for k, v in sorted(labels.items())
    ]


def _sum(family: Metric, start: int, now: int) -> metrics_pb2.Metric:
    out = metrics_pb2.Metric(name=family.name, description=family.documentation)
    out.sum.aggregation_temporality = CUMULATIVE
    out.sum.is_monotonic = True
    for sample in family.samples:
        if sample.name.endswith("_total"):
            out.sum.data_points.add(
                attributes=_attributes(sample.labels),
                start_time_unix_nano=start,
                time_unix_nano=now,
                as_double=float(sample.value),
            )
    return out


def _gauge(family: Metric, start: int, now: int) -> metrics_pb2.Metric:
    out = metrics_pb2.Metric(name=family.name, description=family.documentation)
    for sample in family.samples:
        if sample.name.endswith("_created"):
            continue
        out.gauge.data_points.add(
            attributes=_attributes(sample.labels),
            start_time_unix_nano=start,
            time_unix_nano=now,
            as_double=float(sample.value),
        )
    return out


@dataclass
class _Series:
    buckets: list[tuple[float, float]] = field(default_factory=list)  # (le, cumulative)
    count: float | None = None
    total: float = 0.0


def _histogram(family: Metric, start: int, now: int) -> metrics_pb2.Metric:
    out = metrics_pb2.Metric(name=family.name, description=family.documentation)
    out.histogram.aggregation_temporality = CUMULATIVE
    series: dict[tuple[tuple[str, str], ...], _Series] = {}
    for sample in family.samples:
        labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
        entry = series.setdefault(labels, _Series())
        if sample.name.endswith("_bucket"):
            entry.buckets.append((float(sample.labels["le"]), float(sample.value)))
        elif sample.name.endswith("_count"):
            entry.count = float(sample.value)
        elif sample.name.endswith("_sum"):
            entry.total = float(sample.value)
    for key, entry in series.items():
        buckets = sorted(entry.buckets)
        if not buckets:
            continue
        counts: list[int] = []
        previous = 0.0
        for _, cumulative in buckets:  # OTLP wants per-bucket counts, not cumulative ones
            counts.append(round(cumulative - previous))
            previous = cumulative
        out.histogram.data_points.add(
            attributes=_attributes(dict(key)),
            start_time_unix_nano=start,
            time_unix_nano=now,
            count=round(entry.count if entry.count is not None else buckets[-1][1]),
            sum=entry.total,
            bucket_counts=counts,
            explicit_bounds=[b for b, _ in buckets if b != float("inf")],
        )
    return out


def convert(
    families: Iterable[Metric], start_ns: int = PROCESS_START_NS, now_ns: int | None = None
) -> list[metrics_pb2.Metric]:
    """OTLP metrics for Prometheus metric families (unsupported types are skipped)."""
    now = time.time_ns() if now_ns is None else now_ns
    converters = {"counter": _sum, "gauge": _gauge, "histogram": _histogram}
    out = []
    for family in families:
        converter = converters.get(family.type)
        if converter is None:
            continue
        metric = converter(family, start_ns, now)
        kind = metric.WhichOneof("data")
        if kind is not None and getattr(metric, kind).data_points:  # no series yet: left out
            out.append(metric)
    return out


def resource(instance_id: str) -> resource_pb2.Resource:
    return resource_pb2.Resource(
        attributes=_attributes(
            {
                "service.name": SERVICE_NAME,
                "service.instance.id": instance_id,
                "service.version": __version__,
                "host.name": socket.gethostname(),
            }
        )
    )


def build_request(
    registry: CollectorRegistry, instance_id: str
) -> metrics_service_pb2.ExportMetricsServiceRequest:
    request = metrics_service_pb2.ExportMetricsServiceRequest()
    rm = request.resource_metrics.add()
    rm.resource.CopyFrom(resource(instance_id))
    sm = rm.scope_metrics.add()
    sm.scope.name = SCOPE_NAME
    sm.scope.version = __version__
    sm.metrics.extend(convert(registry.collect()))
    return request


class OtlpExporter:
    """Pushes the registry to an OTLP/gRPC metrics endpoint on the event loop."""

    def __init__(
        self,
        endpoint: str,
        interval: float,
        registry: CollectorRegistry,
        instance_id: str,
        refresh: Callable[[], None] | None = None,
        tls: ServerTls | None = None,
    ) -> None:
        self.endpoint = endpoint
        # Mutual TLS as this server (its own certificate): the control plane takes a report
        # only from the server it is for (control_plane.telemetry.identity).
        self.tls = tls
        self._generation = tls.generation if tls is not None else 0
        self.interval = max(interval, MIN_INTERVAL_S)
        self.timeout = min(self.interval, MAX_EXPORT_TIMEOUT_S)
        self.registry = registry
        self.instance_id = instance_id
        self.refresh = refresh  # updates gauges read at export (accelerator memory)
        self.exports = 0
        self.failures = 0
        self._last_error_log = float("-inf")
        self._channel: grpc.aio.Channel | None = None
        self._stub: metrics_service_pb2_grpc.MetricsServiceStub | None = None

    async def _stub_now(self) -> metrics_service_pb2_grpc.MetricsServiceStub:
        tls = self.tls
        if tls is not None and tls.generation != self._generation:
            self._generation = tls.generation  # renewed: a new channel, a new handshake
            await self.close()
        if self._stub is None:
            if tls is None:
                self._channel = grpc.aio.insecure_channel(self.endpoint)
            else:
                mine = tls.current
                credentials = grpc.ssl_channel_credentials(mine.ca_pem, mine.key_pem, mine.cert_pem)
                self._channel = grpc.aio.secure_channel(self.endpoint, credentials)
            self._stub = metrics_service_pb2_grpc.MetricsServiceStub(self._channel)
        return self._stub

    async def export_once(self) -> bool:
        """One export; failures are logged (at most every 30 s) and never raised."""
        try:
            if self.refresh is not None:
                self.refresh()
            request = build_request(self.registry, self.instance_id)
            stub = await self._stub_now()
            await stub.Export(request, timeout=self.timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.failures += 1
            now = time.monotonic()
            if now - self._last_error_log >= ERROR_LOG_EVERY_S:
                self._last_error_log = now
                detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else exc
                log.warning(
                    "OTLP export to %s failed (%d so far; reported at most every %.0fs): %s",
                    self.endpoint,
                    self.failures,
                    ERROR_LOG_EVERY_S,
                    detail,
                )
            return False
        self.exports += 1
        return True

    async def run(self) -> None:
        log.info("OTLP metrics export to %s every %.2fs", self.endpoint, self.interval)
        next_at = time.monotonic()
        while True:
            await self.export_once()
            next_at += self.interval
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            if time.monotonic() - next_at > self.interval:  # fell behind: do not burst
                next_at = time.monotonic()

    async def flush_and_close(self) -> None:
        """The last export (after the drain, so the final counts arrive), then close."""
        sent = await self.export_once()
        log.info("final OTLP export to %s: %s", self.endpoint, "sent" if sent else "failed")
        await self.close()

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._stub = None
