"""otlp_wire.decode_fast answers what decode_request does, or leaves the export to it.

Every test compares the two on the same bytes: real model-server exports, exports that
change between rounds (a kept template), and seeded random corruptions of them (each also
read after its uncorrupted template is kept, which is where a wrong shortcut would hide).
"""

from __future__ import annotations

import math
import random
import struct
from typing import Any

import pytest
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2

from control_plane.telemetry import otlp_wire
from control_plane.telemetry.decode import decode_request
from control_plane.telemetry.otlp_wire import decode_fast
from control_plane.telemetry.receiver import decode_export
from model_server.observability.metrics import ServerMetrics
from model_server.observability.telemetry import build_request

MAX_POINTS = 10_000


def registry(seed: int) -> ServerMetrics:
    """A model server's registry after some traffic (two versions, an error code, memory)."""
    m, rng = ServerMetrics(), random.Random(seed)
    for version in ("1", "2"):
        m.publish_model_version("resnet", version, "READY", "CPUExecutionProvider", None)
        for _ in range(50):
            m.request_duration.labels("resnet", version).observe(rng.lognormvariate(-5, 0.8))
        m.requests.labels("resnet", version, "OK").inc(rng.randint(1, 100))
        m.requests.labels("resnet", version, "UNAVAILABLE").inc(rng.randint(0, 3))
    m.model_load_time.labels("resnet").observe(1.5)
    m.batch_size.labels("resnet").observe(rng.randint(1, 8))
    m.queue_depth.labels("resnet").set(rng.randint(0, 9))
    m.in_flight.set(rng.randint(0, 9))
    m.memory_used.labels("cpu", "process").set(rng.randint(1, 10**9))
    m.memory_total.labels("cpu", "process").set(8e9)
    m.draining.set(0)
    return m


def slow(raw: bytes, max_points: int = MAX_POINTS) -> Any:
    try:
        request = ExportMetricsServiceRequest.FromString(raw)
    except DecodeError:
        return "undecodable"
    points, ignored, errors = decode_request(request, max_points)
    return [tuple(p) for p in points], ignored, errors


def agree(raw: bytes, max_points: int = MAX_POINTS) -> bool:
    """Asserts decode_fast answers as decode_request or not at all; True when it answered."""
    fast = decode_fast(raw, max_points)
    if fast is not None:
        assert fast == slow(raw, max_points)
    return fast is not None


def clear_memos() -> None:
    for table in (otlp_wire._templates, otlp_wire._resources, otlp_wire._attributes,
                  otlp_wire._bounds, otlp_wire._names, otlp_wire._checked):  # fmt: skip
        table.clear()


@pytest.fixture(autouse=True)
def fresh_memos() -> None:
    clear_memos()


def export(seed: int, instance: str = "10.0.0.1:8001") -> bytes:
    return build_request(registry(seed).registry, instance).SerializeToString()


def test_a_model_servers_exports_are_read_fast_and_the_same_every_round() -> None:
    rounds = [export(seed) for seed in range(5)]
    for raw in rounds:  # the first builds the template, the rest read through it
        assert agree(raw)
    assert len(otlp_wire._templates) == 1
    points, ignored, _ = decode_fast(rounds[-1], MAX_POINTS) or ([], {}, [])
    assert {p[1] for p in points} >= {"inference_request_duration_seconds", "inference_requests"}
    assert ignored.get("unknown_metric", 0) > 0  # the load-time histogram, counted


def test_many_endpoints_in_one_request_each_keep_their_template() -> None:
    def request(seed: int) -> bytes:
        out = ExportMetricsServiceRequest()
        for i in range(20):
            one = ExportMetricsServiceRequest.FromString(export(seed + i, f"10.0.0.{i}:8001"))
            out.resource_metrics.extend(one.resource_metrics)
        return out.SerializeToString()

    for seed in range(3):
        assert agree(request(seed))
    assert len(otlp_wire._templates) == 20


def test_exports_it_does_not_read_are_left_to_protobuf() -> None:
    base = build_request(registry(1).registry, "10.0.0.1:8001")
    nan = ExportMetricsServiceRequest()
    nan.CopyFrom(base)
    gauge = next(m for m in nan.resource_metrics[0].scope_metrics[0].metrics if m.gauge.data_points)
    gauge.gauge.data_points[0].as_double = math.nan
    no_id = ExportMetricsServiceRequest()
    no_id.CopyFrom(base)
    del no_id.resource_metrics[0].resource.attributes[:]
    exemplar = ExportMetricsServiceRequest()
    exemplar.CopyFrom(base)
    point = exemplar.resource_metrics[0].scope_metrics[0].metrics[0]
    data = getattr(point, str(point.WhichOneof("data"))).data_points[0]
    data.exemplars.add(as_double=1.0)
    envoy = ExportMetricsServiceRequest()
    envoy.CopyFrom(base)
    envoy.resource_metrics[0].resource.attributes.append(
        KeyValue(key="telemetry.sdk.name", value=AnyValue(string_value="envoy"))
    )
    for request in (nan, no_id, exemplar, envoy):
        assert decode_fast(request.SerializeToString(), MAX_POINTS) is None
    assert decode_fast(base.SerializeToString(), 3) is None  # over the points budget
    assert decode_fast(b"\x0a\x05abc", MAX_POINTS) is None  # truncated: protobuf's DecodeError


def test_a_kept_template_does_not_read_changed_numbers_it_would_reject() -> None:
    """The numbers are read through a template without the structure being parsed again:
    the checks on them (NaN, a negative counter, buckets that do not add up) still hold."""
    base = build_request(registry(1).registry, "10.0.0.1:8001")
    assert agree(base.SerializeToString())
    for mutate in (_nan_gauge, _negative_counter, _bucket_mismatch, _nan_sum):
        request = ExportMetricsServiceRequest()
        request.CopyFrom(base)
        mutate(request.resource_metrics[0].scope_metrics[0].metrics)
        raw = request.SerializeToString()
        assert len(raw) == len(base.SerializeToString())  # same shape: the template matches
        assert decode_fast(raw, MAX_POINTS) is None, mutate.__name__
        assert slow(raw)[1], mutate.__name__  # decode_request ignores the point, with a reason


def _nan_gauge(metrics: Any) -> None:
    next(m for m in metrics if m.name == "inference_queue_depth").gauge.data_points[
        0
    ].as_double = math.nan


def _negative_counter(metrics: Any) -> None:
    next(m for m in metrics if m.name == "inference_requests").sum.data_points[0].as_double = -1.0


def _bucket_mismatch(metrics: Any) -> None:
    duration = next(m for m in metrics if m.name == "inference_request_duration_seconds")
    duration.histogram.data_points[0].count += 1


def _nan_sum(metrics: Any) -> None:
    duration = next(m for m in metrics if m.name == "inference_request_duration_seconds")
    duration.histogram.data_points[0].sum = math.inf


@pytest.mark.parametrize("kept", [False, True], ids=["cold", "template kept"])
def test_random_corruptions_get_the_same_answer(kept: bool) -> None:
    rng = random.Random(1234)
    base = export(3)
    answered = 0
    for _ in range(1500):
        raw = bytearray(base)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(raw))
            choice = rng.random()
            if choice < 0.6:
                raw[at] = rng.randrange(256)
            elif choice < 0.8:
                del raw[at : at + rng.randint(1, 8)]
            else:
                raw[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        clear_memos()
        if kept:
            assert agree(base)
        answered += agree(bytes(raw))
    assert answered > 100  # corruptions of the numbers alone are still read fast


def test_changed_numbers_of_every_width_read_the_same() -> None:
    """Random fixed64 values (times, doubles, counts) written over the template's numbers."""
    rng = random.Random(99)
    base = build_request(registry(2).registry, "10.0.0.1:8001")
    assert agree(base.SerializeToString())
    answered = 0
    for _ in range(200):
        request = ExportMetricsServiceRequest()
        request.CopyFrom(base)
        for metric in request.resource_metrics[0].scope_metrics[0].metrics:
            data = getattr(metric, str(metric.WhichOneof("data"))).data_points
            for p in data:
                p.time_unix_nano = rng.randrange(2**64)
                p.start_time_unix_nano = rng.choice([0, rng.randrange(2**64)])
                if isinstance(p, metrics_pb2.HistogramDataPoint):
                    counts = [rng.randrange(1000) for _ in p.bucket_counts]
                    p.bucket_counts[:] = counts
                    p.count = sum(counts) + (rng.random() < 0.01)
                else:  # any finite, non-negative double, of any exponent
                    p.as_double = abs(struct.unpack("<d", rng.randbytes(8))[0])
                    if not math.isfinite(p.as_double):
                        p.as_double = 0.0
        answered += agree(request.SerializeToString())
    assert answered > 100  # the rest have buckets that do not add up: protobuf's


def test_a_metric_it_does_not_use_renamed_to_one_it_does_is_read() -> None:
    """A template counts the metrics the store does not use without reading them: one renamed
    to a used name of the same length keeps the template's shape, and must still be read."""
    base = build_request(registry(1).registry, "10.0.0.1:8001")
    unused = base.resource_metrics[0].scope_metrics[0].metrics.add(name="inference_queue_xxxxx")
    unused.gauge.data_points.add(as_double=7.0).attributes.add(
        key="model", value=AnyValue(string_value="m")
    )
    assert agree(base.SerializeToString())
    unused.name = "inference_queue_depth"
    raw = base.SerializeToString()
    agree(raw)  # (the protobuf way, here: fast or not, the answers must be the same)
    assert any(p[1] == "inference_queue_depth" and p[4] == (7.0,) for p in slow(raw)[0])


def test_memos_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(otlp_wire, "MAX_MEMO", 5)
    monkeypatch.setattr(otlp_wire, "MAX_TEMPLATES", 5)
    for i in range(20):
        assert agree(export(i, f"10.0.1.{i}:8001"))
        assert len(otlp_wire._templates) <= 5 and len(otlp_wire._resources) <= 5


def test_decoder_processes_get_the_fast_answer_too() -> None:
    raw = export(4)
    points, ignored, errors, blob = decode_export(raw, MAX_POINTS, True)
    assert (points, ignored, errors) == slow(raw) and blob == b""
