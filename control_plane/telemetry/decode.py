"""What an OTLP export means to the control plane: ``decode_request`` (pure) turns an
``ExportMetricsServiceRequest`` into validated ``Point``s and counts what it ignores, by reason:
``no_instance_id`` (a resource without service.instance.id), ``unknown_metric`` (a name the
store does not use; not reported back as rejected), ``unsupported_type`` (exponential
histograms, summaries, no data), ``wrong_type``, ``bad_temporality``, ``no_value``, ``nan``,
``negative``, ``bad_buckets`` (bounds not finite and increasing, or too many),
``bucket_mismatch`` (counts do not match the bounds or the total), ``too_many_points`` (over the
per-request cap); the store adds ``series_limit`` and ``endpoint_limit``, the receiver
``undecodable`` (bytes that are not a request: INVALID_ARGUMENT).

``otlp_wire.decode_fast`` gives the same answers from the bytes, faster, for the exports it
reads; the receiver (``otlp_receiver``) tries it first.
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2

from infermesh.wire import TELEMETRY_KINDS

MAX_BUCKETS = 512
MAX_ATTRIBUTES = 16
MAX_ATTRIBUTE_CHARS = 128
MAX_INSTANCE_ID_CHARS = 256  # a longer service.instance.id counts as none
# What the store reads, and nothing else (the wire contract's table).
KINDS = TELEMETRY_KINDS
DELTA = metrics_pb2.AGGREGATION_TEMPORALITY_DELTA
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
        endpoint = instance_id(resource_metrics.resource.attributes)
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
                if not endpoint or len(endpoint) > MAX_INSTANCE_ID_CHARS:
                    ignore("no_instance_id", count, "resource has no service.instance.id")
                elif kind is None:
                    ignored["unknown_metric"] += count
                elif data not in ("gauge", "sum", "histogram"):
                    ignore("unsupported_type", count, f"{name}: {data or 'no data'}")
                elif problem := _metric_problem(kind, data, container):
                    if count:
                        ignore(problem[0], count, f"{name}: {problem[1]}")
                else:
                    delta = data != "gauge" and container.aggregation_temporality == DELTA
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
    if kind != "gauge" and temporality not in (DELTA, _CUMULATIVE):
        return "bad_temporality", f"aggregation temporality {temporality}"
    if kind == "gauge" and temporality == DELTA:
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
    attrs = sorted_attributes(p.attributes)
    if kind == "histogram":
        bounds = tuple(p.explicit_bounds)
        problem = checked_bounds.get(bounds)
        if problem is None:
            problem = checked_bounds[bounds] = bounds_problem(bounds)
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


def bounds_problem(bounds: tuple[float, ...]) -> str:
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


def instance_id(attributes: Iterable[KeyValue]) -> str:
    for kv in attributes:
        if kv.key == "service.instance.id":
            return _attribute_value(kv) or ""
    return ""


def sorted_attributes(attributes: Iterable[KeyValue]) -> tuple[tuple[str, str], ...]:
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
