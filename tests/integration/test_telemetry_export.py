"""OTLP metrics export from a real server process to an in-test OTLP/gRPC receiver."""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.metrics.v1 import metrics_pb2

from model_server.observability.metrics import ServerMetrics
from model_server.observability.telemetry import build_request
from tests.support import infer_classifier, start_server, wait_for

pytestmark = pytest.mark.integration

CUMULATIVE = metrics_pb2.AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
Request = metrics_service_pb2.ExportMetricsServiceRequest


class Receiver(metrics_service_pb2_grpc.MetricsServiceServicer):
    """Collects every export with the time it arrived."""

    def __init__(self) -> None:
        self.received: list[tuple[float, Request]] = []
        self.lock = threading.Lock()

    def Export(self, request: Request, context: grpc.ServicerContext) -> object:
        with self.lock:
            self.received.append((time.monotonic(), request))
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def requests(self) -> list[tuple[float, Request]]:
        with self.lock:
            return list(self.received)


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, int]]:
    servicer = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(grace=None)


def attrs(values: object) -> dict[str, str]:
    return {kv.key: kv.value.string_value for kv in values}  # type: ignore[attr-defined]


def metrics_of(request: Request) -> dict[str, metrics_pb2.Metric]:
    out: dict[str, metrics_pb2.Metric] = {}
    for rm in request.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                out[metric.name] = metric
    return out


def export_time(request: Request) -> int:
    """When the exporter read its metrics (the histogram points' time, in ns)."""
    points = metrics_of(request)["inference_request_duration_seconds"].histogram.data_points
    return max(p.time_unix_nano for p in points)


def classifier_count(request: Request) -> int:
    metric = metrics_of(request).get("inference_request_duration_seconds")
    if metric is None:
        return 0
    points = metric.histogram.data_points
    return sum(p.count for p in points if attrs(p.attributes)["model"] == "classifier")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_export_carries_the_prometheus_instruments(
    demo_repo: Path, tmp_path: Path, receiver: tuple[Receiver, int]
) -> None:
    servicer, port = receiver
    server = start_server(
        demo_repo,
        tmp_path,
        "--otlp-endpoint", f"127.0.0.1:{port}",
        "--telemetry-interval", "0.2",
        "--advertise-address", "model-a.test:8001",
    )  # fmt: skip
    try:
        client = server.client()
        sent = 12
        for i in range(sent):
            infer_classifier(client, np.full((2, 3, 32, 32), i, dtype=np.float32))
        wait_for(
            lambda: any(classifier_count(r) == sent for _, r in servicer.requests()),
            10,
            "an export with every request counted",
        )
        before = len(servicer.requests())
        wait_for(lambda: len(servicer.requests()) - before >= 5, 10, "five more exports")
        # The interval from the exports' own timestamps, not from this test's clock.
        stamps = sorted(export_time(r) for _, r in servicer.requests()[before:])
        gaps = sorted(b - a for a, b in itertools.pairwise(stamps))
        assert 0.1e9 <= gaps[len(gaps) // 2] <= 0.5e9, f"exports do not follow 0.2 s: {gaps}"

        request = servicer.requests()[-1][1]
        resource = attrs(request.resource_metrics[0].resource.attributes)
        assert resource["service.name"] == "infermesh-model-server"
        assert resource["service.instance.id"] == "model-a.test:8001"
        assert resource["host.name"]
        metrics = metrics_of(request)
        assert "inference_requests_total" not in metrics
        assert not any(name.endswith("_created") for name in metrics)

        duration = metrics["inference_request_duration_seconds"].histogram
        assert duration.aggregation_temporality == CUMULATIVE
        points = [p for p in duration.data_points if attrs(p.attributes)["model"] == "classifier"]
        assert sum(p.count for p in points) == sent
        for point in points:
            assert sum(point.bucket_counts) == point.count
            assert len(point.bucket_counts) == len(point.explicit_bounds) + 1
            assert 0.0001 in point.explicit_bounds
            assert point.start_time_unix_nano < point.time_unix_nano

        requests = metrics["inference_requests"].sum
        assert requests.is_monotonic and requests.aggregation_temporality == CUMULATIVE
        ok = [p for p in requests.data_points if attrs(p.attributes)["code"] == "OK"]
        assert sum(p.as_double for p in ok) == sent

        batch = metrics["inference_batch_size"].histogram
        assert sum(p.count for p in batch.data_points) == sent
        assert sum(p.sum for p in batch.data_points) == 2 * sent

        memory = metrics["accelerator_memory_used_bytes"].gauge.data_points
        process = [p for p in memory if attrs(p.attributes)["source"] == "process"]
        assert process and all(p.as_double > 0 for p in process)
        assert "accelerator_memory_total_bytes" in metrics
        kv = metrics["kv_cache_blocks_used"].gauge.data_points
        assert "classifier" in {attrs(p.attributes)["model"] for p in kv}

        # The drain sends one last export, with the final counts.
        infer_classifier(client, np.zeros((1, 3, 32, 32), dtype=np.float32))
        count = len(servicer.requests())
        server.signal()
        assert server.wait_exit(timeout=20) == 0
        after = servicer.requests()[count:]
        assert after and classifier_count(after[-1][1]) == sent + 1
        assert "final OTLP export" in server.log()
    finally:
        server.stop()


def test_dead_endpoint_never_stops_serving(demo_repo: Path, tmp_path: Path) -> None:
    server = start_server(
        demo_repo,
        tmp_path,
        "--otlp-endpoint", f"127.0.0.1:{free_port()}",
        "--telemetry-interval", "0.2",
    )  # fmt: skip
    try:
        client = server.client()
        for _ in range(5):
            infer_classifier(client, np.zeros((1, 3, 32, 32), dtype=np.float32))
        wait_for(lambda: "OTLP export to" in server.log(), 10, "the first failed export logged")
        assert server.is_ready()
        infer_classifier(client, np.zeros((1, 3, 32, 32), dtype=np.float32))
        failures = [line for line in server.log().splitlines() if "OTLP export to" in line]
        assert len(failures) == 1 and "failed" in failures[0], server.log()  # once: throttled
    finally:
        server.stop()


@pytest.mark.parametrize("value", ["0.1", "0", "-1", "nan", "x"])
def test_interval_below_the_minimum_is_refused(value: str) -> None:
    from model_server.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--telemetry-interval", value])


def test_counter_histogram_and_gauge_mapping() -> None:
    metrics = ServerMetrics()
    metrics.requests.labels("m", "1", "OK").inc(3)
    metrics.request_duration.labels("m", "1").observe(0.0002)
    metrics.request_duration.labels("m", "1").observe(0.0002)
    metrics.request_duration.labels("m", "1").observe(7.0)
    metrics.request_duration.labels("m", "1").observe(99.0)  # lands in +Inf only
    metrics.draining.set(1)
    out = metrics_of(build_request(metrics.registry, "h:1"))
    assert out["inference_requests"].sum.data_points[0].as_double == 3
    point = out["inference_request_duration_seconds"].histogram.data_points[0]
    counts = list(point.bucket_counts)
    assert point.count == 4 and sum(counts) == 4
    assert counts[list(point.explicit_bounds).index(0.0002)] == 2
    assert counts[list(point.explicit_bounds).index(8.0)] == 1 and counts[-1] == 1
    assert out["server_draining"].gauge.data_points[0].as_double == 1
    kv = common_pb2.KeyValue
    assert isinstance(point.attributes[0], kv)
