"""The OTLP/gRPC receiver on a real loopback port: the OpenTelemetry SDK exporter, and garbage."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Executor

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.metrics.v1 import metrics_pb2 as m
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from control_plane.metrics import ControlPlaneMetrics
from control_plane.model.mesh import model_cluster
from control_plane.telemetry.envoy import EnvoyStats
from control_plane.telemetry.receiver import EXPORT_METHOD, start_decoders, start_receiver
from control_plane.telemetry.store import TelemetryStore
from tests.otlp_support import BOUNDS, attrs, gauge, request

ENDPOINT = "127.0.0.1:9999"


class Receiver:
    def __init__(self, store: TelemetryStore, metrics: ControlPlaneMetrics, port: int) -> None:
        self.store, self.metrics, self.port = store, metrics, port
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.raw = self.channel.unary_unary(
            EXPORT_METHOD, response_deserializer=ExportMetricsServiceResponse.FromString
        )

    async def export(self, req: ExportMetricsServiceRequest) -> ExportMetricsServiceResponse:
        response: ExportMetricsServiceResponse = await self.raw(req.SerializeToString(), timeout=30)
        return response

    def ignored(self, reason: str) -> float:
        value = self.metrics.registry.get_sample_value(
            "telemetry_points_ignored_total", {"reason": reason}
        )
        return value or 0.0

    def accepted(self) -> float:
        return self.metrics.registry.get_sample_value("telemetry_points_total") or 0.0


@pytest.fixture(scope="module")
def decoders() -> Iterator[Executor]:
    pool = start_decoders(1)
    yield pool
    pool.shutdown(cancel_futures=True)


@pytest.fixture(params=["thread", "decoder process"])
async def receiver(request: pytest.FixtureRequest) -> AsyncIterator[Receiver]:
    """Every receiver test runs with decoding in a worker thread and in a decoder process."""
    pool = request.getfixturevalue("decoders") if request.param != "thread" else None
    store, metrics = TelemetryStore(), ControlPlaneMetrics()
    server, port = await start_receiver(store, metrics, "127.0.0.1", 0, decoders=pool)
    r = Receiver(store, metrics, port)
    try:
        yield r
    finally:
        await r.channel.close()
        await server.stop(None)


def sdk_export(port: int) -> None:
    """Records like a model server and flushes once (blocking: run it in a thread)."""
    exporter = OTLPMetricExporter(endpoint=f"127.0.0.1:{port}", insecure=True, timeout=10)
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
    resource = Resource.create(
        {"service.name": "infermesh-model-server", "service.instance.id": ENDPOINT}
    )
    provider = MeterProvider(resource=resource, metric_readers=[reader])
    try:
        meter = provider.get_meter("test")
        duration = meter.create_histogram(
            "inference_request_duration_seconds",
            unit="s",
            explicit_bucket_boundaries_advisory=list(BOUNDS),
        )
        requests = meter.create_counter("inference_requests")
        for i in range(100):
            labels = {"model": "classifier", "version": "1"}
            duration.record(0.002 if i < 98 else 0.2, labels)
            code = "OK" if i < 80 else "CANCELLED" if i < 90 else "UNAVAILABLE"
            requests.add(1, {**labels, "code": code})
        time.sleep(0.2)  # a measurable span since the provider started
        assert provider.force_flush(timeout_millis=10_000)
    finally:
        provider.shutdown()


async def test_sdk_exporter_reaches_the_store(receiver: Receiver) -> None:
    await asyncio.to_thread(sdk_export, receiver.port)
    snapshot = receiver.store.snapshot(time.monotonic())
    e = snapshot[ENDPOINT]
    assert not e.stale and e.age_s < 5
    assert e.qps is not None and e.qps.value > 0
    # a request its caller cancelled (a hedge's loser) is not the server's failure
    assert e.error_rate is not None and e.error_rate.value == pytest.approx(10 / 90)
    assert e.abandoned_rate is not None and e.abandoned_rate.value == pytest.approx(0.1)
    assert e.p50_ms is not None and 1.0 <= e.p50_ms.value <= 2.5
    assert e.p99_ms is not None and 100.0 <= e.p99_ms.value <= 250.0
    assert [x.model for x in e.models] == ["classifier"]
    assert receiver.accepted() >= 3
    assert receiver.metrics.registry.get_sample_value("telemetry_endpoints") == 1


async def good_request_is_accepted(receiver: Receiver) -> None:
    before = receiver.accepted()
    response = await receiver.export(request([gauge("inference_in_flight_requests", 2)]))
    assert response.partial_success.rejected_data_points == 0
    assert receiver.accepted() == before + 1
    e = receiver.store.snapshot(time.monotonic())["127.0.0.1:8001"]
    assert e.in_flight is not None and e.in_flight.value == 2


async def test_random_bytes(receiver: Receiver) -> None:
    rng = random.Random(1)
    for size in (1, 7, 100, 5000):
        for _ in range(5):
            payload = rng.randbytes(size)
            try:
                await receiver.raw(payload, timeout=10)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert receiver.ignored("undecodable") > 0
    await good_request_is_accepted(receiver)


async def test_no_resource_attributes(receiver: Receiver) -> None:
    bare = request([gauge("server_draining", 1)])
    del bare.resource_metrics[0].resource.attributes[:]
    response = await receiver.export(bare)
    assert response.partial_success.rejected_data_points == 1
    assert "no_instance_id" in response.partial_success.error_message
    assert receiver.ignored("no_instance_id") == 1
    await good_request_is_accepted(receiver)


async def test_nan_negative_and_mismatched(receiver: Receiver) -> None:
    histogram = m.Metric(
        name="inference_request_duration_seconds",
        histogram=m.Histogram(
            aggregation_temporality=m.AGGREGATION_TEMPORALITY_CUMULATIVE,
            data_points=[
                m.HistogramDataPoint(
                    attributes=attrs(model="m"), count=1, bucket_counts=[1], explicit_bounds=[1, 2]
                )
            ],
        ),
    )
    req = request(
        [
            gauge("inference_queue_depth", math.nan),
            gauge("kv_cache_blocks_used", math.inf),
            histogram,
        ]
    )
    response = await receiver.export(req)
    assert response.partial_success.rejected_data_points == 3
    assert receiver.ignored("nan") == 2 and receiver.ignored("bucket_mismatch") == 1
    await good_request_is_accepted(receiver)


async def test_100k_points(receiver: Receiver) -> None:
    points = [
        m.NumberDataPoint(attributes=attrs(model=f"m{i}"), as_double=float(i))
        for i in range(100_000)
    ]
    big = request([m.Metric(name="inference_queue_depth", gauge=m.Gauge(data_points=points))])
    try:
        response = await receiver.export(big)
        assert response.partial_success.rejected_data_points == 100_000
        assert receiver.ignored("too_many_points") == 100_000
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    await good_request_is_accepted(receiver)


@pytest.mark.parametrize("mode", ["thread", "decoder process"])
async def test_envoy_resources_go_to_envoy_stats(mode: str, decoders: Executor) -> None:
    from tests.unit.control_plane.xds.test_protection import overflow_report

    store, envoy = TelemetryStore(), EnvoyStats()
    clock = iter(float(t) for t in range(1, 100))
    server, port = await start_receiver(
        store, None, "127.0.0.1", 0, lambda: next(clock), envoy,
        decoders if mode != "thread" else None,
    )  # fmt: skip
    r = Receiver(store, ControlPlaneMetrics(), port)
    try:
        for value in (0, 4):
            mixed = request([gauge("inference_queue_depth", 2.0, model="m")], ENDPOINT)
            mixed.resource_metrics.append(overflow_report(value))
            response = await r.export(mixed)
            assert not response.HasField("partial_success")
        assert envoy.recent_overflows({model_cluster("classifier")}, now=2.5) == 4
        assert set(store.snapshot(2.5)) == {ENDPOINT}  # the Envoy resource is not an endpoint
    finally:
        await r.channel.close()
        await server.stop(None)
