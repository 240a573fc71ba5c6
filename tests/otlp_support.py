"""OTLP metric exports built by hand, as a model server would send them: gauges, counters and
latency histograms (KServe/OTel names) for one endpoint's ``service.instance.id``."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2 as m

from control_plane.telemetry.receiver import EXPORT_METHOD
from infermesh import pki
from tests.mesh_support import ControlPlaneThread
from tests.support import ServerProcess, metric_value

EP = "127.0.0.1:8001"
BOUNDS = (*(b * 10.0**e for e in range(-4, 1) for b in (1.0, 2.5, 5.0)), 10.0)
CUM = m.AGGREGATION_TEMPORALITY_CUMULATIVE
DELTA = m.AGGREGATION_TEMPORALITY_DELTA
S = 1_000_000_000


def attrs(**kw: str) -> list[KeyValue]:
    return [KeyValue(key=k, value=AnyValue(string_value=v)) for k, v in kw.items()]


def request(metrics: Sequence[m.Metric], endpoint: str | None = EP) -> ExportMetricsServiceRequest:
    resource = attrs(**{"service.name": "infermesh-model-server"})
    if endpoint is not None:
        resource += attrs(**{"service.instance.id": endpoint})
    rm = m.ResourceMetrics(scope_metrics=[m.ScopeMetrics(metrics=list(metrics))])
    rm.resource.attributes.extend(resource)
    return ExportMetricsServiceRequest(resource_metrics=[rm])


def histogram(
    latencies: Sequence[float],
    t_s: float,
    temporality: m.AggregationTemporality.ValueType = CUM,
    model: str = "m",
    start_s: float = 0.0,
    version: str = "1",
) -> m.Metric:
    counts = [0] * (len(BOUNDS) + 1)
    for x in latencies:
        counts[bisect.bisect_left(BOUNDS, x)] += 1
    point = m.HistogramDataPoint(
        attributes=attrs(model=model, version=version),
        start_time_unix_nano=int(start_s * S) + 1,
        time_unix_nano=int(t_s * S) + 1,
        count=len(latencies),
        sum=sum(latencies),
        bucket_counts=counts,
        explicit_bounds=BOUNDS,
    )
    return m.Metric(
        name="inference_request_duration_seconds",
        histogram=m.Histogram(data_points=[point], aggregation_temporality=temporality),
    )


def counter(
    value: float,
    t_s: float,
    code: str = "OK",
    temporality: m.AggregationTemporality.ValueType = CUM,
    start_s: float = 0.0,
    version: str = "1",
    model: str = "m",
) -> m.Metric:
    point = m.NumberDataPoint(
        attributes=attrs(model=model, version=version, code=code),
        start_time_unix_nano=int(start_s * S) + 1,
        time_unix_nano=int(t_s * S) + 1,
        as_double=value,
    )
    return m.Metric(
        name="inference_requests",
        sum=m.Sum(data_points=[point], aggregation_temporality=temporality, is_monotonic=True),
    )


def gauge(name: str, value: float, **labels: str) -> m.Metric:
    point = m.NumberDataPoint(attributes=attrs(**labels), as_double=value)
    return m.Metric(name=name, gauge=m.Gauge(data_points=[point]))


@dataclass
class Telemetry:
    pki_dir: Path
    plane: ControlPlaneThread
    server: ServerProcess
    other: str  # a second server's address: it has a certificate, and no process runs

    def export(self, who: pki.Workload | None, claimed: str) -> grpc.StatusCode:
        """One report of server_draining=1 for ``claimed``, sent as ``who`` (None: plaintext)."""
        target = f"127.0.0.1:{self.plane.plane.otlp_port}"
        body = request([gauge("server_draining", 1.0)], claimed).SerializeToString()
        if who is None:
            channel = grpc.insecure_channel(target)
        else:
            files = [self.pki_dir / f"{who.file_stem}.{ext}" for ext in ("key", "crt")]
            credentials = grpc.ssl_channel_credentials(
                (self.pki_dir / "ca.crt").read_bytes(), *(f.read_bytes() for f in files)
            )
            channel = grpc.secure_channel(target, credentials)
        with channel:
            export = channel.unary_unary(
                EXPORT_METHOD, response_deserializer=ExportMetricsServiceResponse.FromString
            )
            try:
                export(body, timeout=5)
            except grpc.RpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    def rejected(self, reason: str) -> float:
        text = self.plane.admin_get("/metrics")
        return metric_value(text, "telemetry_reports_rejected_total", reason=reason)

    def draining(self, address: str) -> object:
        seen = self.plane.admin_get("/telemetry")["endpoints"].get(address) or {}
        return (seen.get("draining") or {}).get("value")
