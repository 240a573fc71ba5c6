"""Triton's Prometheus metrics, mapped to the ``Point``s our own servers push over OTLP (pure).

A Triton server (or any KServe v2 server exposing Triton's metrics) does not push OTLP, so the
control plane scrapes its ``/metrics`` (``control_plane.telemetry.scraper``) and a ``TritonMapper``
per endpoint turns each scrape into what ``TelemetryStore.ingest_points`` takes; scoring cannot
tell the two kinds of endpoint apart. The mapping:

=====================================================  =========================================
Triton                                                 ours
=====================================================  =========================================
nv_inference_request_success {model,version}           inference_requests {code="OK"}
nv_inference_request_failure {model,version[,reason]}  inference_requests {code="error"} (summed)
nv_inference_request_duration_us + _success (deltas)   inference_request_duration_seconds (below)
nv_inference_request_summary_us {quantile} (optional)  where that histogram's counts go (below)
nv_inference_pending_request_count {model,version}     inference_queue_depth {model} (summed) ...
nv_trt_llm_request_metrics {request_type="waiting"}    ... plus TensorRT-LLM's waiting requests
nv_trt_llm_request_metrics {request_type="active"}     inference_in_flight_requests (summed)
nv_gpu_memory_{used,total}_bytes {gpu_uuid}            accelerator_memory_*_bytes {device=uuid,
                                                       source="nvml"}
nv_cpu_memory_{used,total}_bytes                       dropped: the whole host's RAM, which
                                                       other processes fill (not a budget)
nv_trt_llm_kv_cache_block_metrics {kv_cache_block_     kv_cache_blocks_used / _total {model}
type="used" / "max", model (absent: "")}               (summed over versions)
=====================================================  =========================================

Everything else (nv_inference_count, the queue/compute durations, utilisation, power, ...) is
counted as ``unknown_metric`` and dropped. Triton has no model-state or draining metric.

Counters are re-based: each one the mapper emits counts from the scrape at which the mapper
first saw it (``start_ns``, wall clock), and a Triton restart (any counter of a model version
going down) adds the post-restart values rather than going down. So the store never sees a
reset, and ``duration_s`` is exact.

Latency. Triton has no latency histogram, only cumulative totals, so the mapper synthesises
a cumulative one on our servers' bounds (``LATENCY_BUCKETS_S``). At each scrape, with
``n = delta(nv_inference_request_success)`` and ``us = delta(nv_inference_request_duration_us)``
(Triton adds a request's duration to that counter only when it succeeds, so failures must not
be in ``n``; ``nv_inference_count`` counts batch items and skips cache hits, so it is not the
right divisor either), the interval's ``n`` observations go into the bucket of the mean,
``us / n / 1e6`` seconds. The store's P50/P99 over its window are then quantiles of
per-scrape-interval MEANS: the P99 is about the slowest interval mean holding 1% of the
window's requests, and a tail inside one interval is invisible. When Triton also serves
``nv_inference_request_summary_us`` quantiles (``--metrics-config summary_latencies=true``),
the ``n`` observations are spread over them instead: quantile q_i gets the share
q_i - q_(i-1) (the highest also the rest), so the store's P50/P99 come out at Triton's (within
a bucket, at most 15% wide between 1 ms and 100 ms). Those quantiles cover Triton's own sliding
window (prometheus-cpp: 60 s by default), longer than the store's, so they react more slowly.

A malformed exposition never raises: the families before the first bad line are used and the
parser's message is returned in ``errors``.
"""

from __future__ import annotations

import bisect
import math
from array import array
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from control_plane.telemetry.decode import Point
from control_plane.telemetry.series import DURATION, REQUESTS
from infermesh.wire import LATENCY_BUCKETS_S

MAX_VERSIONS = 1000  # model versions tracked per endpoint (the store keeps 500 series anyway)
MAX_ERRORS = 5
ModelVersion = tuple[str, str]


@dataclass(frozen=True)
class TritonScrape:
    """What one scrape made: hand it to ``TelemetryStore.ingest_points(points, ignored, errors,
    received_at)``."""

    points: tuple[Point, ...]
    ignored: dict[str, int]  # reason -> samples dropped
    errors: tuple[str, ...]  # the first few messages; non-empty means the scrape was faulty


@dataclass
class _Reading:
    """One exposition, reduced to the numbers the mapping reads."""

    success: dict[ModelVersion, float] = field(default_factory=dict)
    failure: defaultdict[ModelVersion, float] = field(default_factory=lambda: defaultdict(float))
    duration_us: dict[ModelVersion, float] = field(default_factory=dict)
    quantiles_us: defaultdict[ModelVersion, dict[float, float]] = field(
        default_factory=lambda: defaultdict(dict)
    )
    queue: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    in_flight: float | None = None
    gpu_used: dict[str, float] = field(default_factory=dict)
    gpu_total: dict[str, float] = field(default_factory=dict)
    kv_used: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    kv_total: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _trt_requests(family: str, labels: dict[str, str], request_type: str) -> bool:
    """A sample of TensorRT-LLM's request gauges, of ``request_type``."""
    return family == "nv_trt_llm_request_metrics" and labels.get("request_type") == request_type


def _add_sample(r: _Reading, family: str, labels: dict[str, str], value: float) -> bool:
    """Files one sample of ``family``; False when the mapping does not use it."""
    mv = (labels.get("model", ""), labels.get("version", ""))
    if family == "nv_inference_request_success":
        r.success[mv] = value
    elif family == "nv_inference_request_failure":
        r.failure[mv] += value  # one series per reason in recent releases
    elif family == "nv_inference_request_duration_us":
        r.duration_us[mv] = value
    elif family == "nv_inference_request_summary_us" and "quantile" in labels:
        q = _number(labels["quantile"])
        if q is not None and not math.isnan(value):  # NaN: none in Triton's summary window
            r.quantiles_us[mv][q] = value
    elif family == "nv_inference_pending_request_count" or _trt_requests(family, labels, "waiting"):
        r.queue[mv[0]] += value
    elif _trt_requests(family, labels, "active"):
        r.in_flight = (r.in_flight or 0.0) + value
    elif family in ("nv_gpu_memory_used_bytes", "nv_gpu_memory_total_bytes"):
        into = r.gpu_used if family.endswith("used_bytes") else r.gpu_total
        into[labels.get("gpu_uuid", labels.get("gpu", ""))] = value
    elif family == "nv_trt_llm_kv_cache_block_metrics" and labels.get("kv_cache_block_type") in (
        "used",
        "max",
    ):
        into = r.kv_used if labels["kv_cache_block_type"] == "used" else r.kv_total
        into[mv[0]] += value
    else:
        return False
    return True


def parse_exposition(text: str) -> tuple[_Reading, Counter[str], list[str]]:
    """(the numbers read, ignored samples by reason, error messages); never raises."""
    reading, ignored, errors = _Reading(), Counter[str](), list[str]()
    families = 0
    try:
        for family in text_string_to_metric_families(text):
            families += 1
            for sample in family.samples:
                value = float(sample.value)
                if sample.name.endswith("_created"):
                    continue
                if family.type != "summary" and not math.isfinite(value):
                    ignored["nan"] += 1
                    if len(errors) < MAX_ERRORS:
                        errors.append(f"{sample.name}: value {value}")
                elif value < 0:
                    ignored["negative"] += 1
                elif not _add_sample(reading, family.name, sample.labels, value):
                    ignored["unknown_metric"] += 1
    except Exception as exc:  # the parser raises ValueError, and others on odd input
        ignored["malformed"] += 1
        errors.insert(0, f"malformed exposition after {families} metric families: {exc}"[:300])
    return reading, ignored, errors


@dataclass
class _VersionState:
    """One model version's counters: Triton's last raw values and our re-based totals."""

    start_ns: int
    raw: tuple[float | None, float | None, float | None]  # success, failure, duration_us
    ok: float = 0.0
    error: float = 0.0
    buckets: list[float] = field(default_factory=list)


def _increase(now: float | None, before: float | None, reset: bool) -> float | None:
    """Prometheus ``increase`` between two raw readings; None when it cannot be known."""
    if now is None or (before is None and not reset):
        return None
    return now if reset or before is None else now - before


def bucket_shares(
    n: float, mean_s: float | None, quantiles_us: dict[float, float]
) -> list[tuple[float, float]]:
    """(seconds, observations) for ``n`` requests of one scrape interval: spread over the
    summary quantiles when there are any, else all at the mean."""
    valid = sorted((q, v) for q, v in quantiles_us.items() if 0.0 < q <= 1.0 and v >= 0.0)
    if not valid:
        return [] if mean_s is None else [(mean_s, n)]
    shares, below = [], 0.0
    for q, value_us in valid:
        shares.append((value_us / 1e6, n * (q - below)))
        below = q
    last_s, last_n = shares[-1]
    shares[-1] = (last_s, last_n + n * (1.0 - below))
    return shares


class TritonMapper:
    """Maps the scrapes of ONE endpoint ("HOST:PORT", the EDS address), keeping the previous
    scrape's counters: latency comes from deltas. Not thread-safe; one scrape at a time."""

    def __init__(self, endpoint: str, bounds: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.endpoint = endpoint
        self.bounds = bounds
        self._versions: dict[ModelVersion, _VersionState] = {}

    def scrape(self, text: str, now_ns: int) -> TritonScrape:
        """Maps one exposition read at ``now_ns`` (wall clock, ``time.time_ns()``; it dates the
        counters' start only); never raises."""
        reading, ignored, errors = parse_exposition(text)
        points: list[Point] = []
        for mv in sorted(reading.success.keys() | reading.failure.keys()):
            state = self._version(mv, reading, now_ns)
            if state is None:
                ignored["series_limit"] += 1
            else:
                points.extend(self._request_points(mv, state, now_ns))
        if not errors:  # a partial scrape says nothing of what was unloaded
            for gone in self._versions.keys() - reading.success.keys() - reading.failure.keys():
                del self._versions[gone]
        points.extend(self._gauge_points(reading))
        return TritonScrape(tuple(points), dict(ignored), tuple(errors[:MAX_ERRORS]))

    def _version(self, mv: ModelVersion, r: _Reading, now_ns: int) -> _VersionState | None:
        raw = (r.success.get(mv), r.failure.get(mv), r.duration_us.get(mv))
        state = self._versions.get(mv)
        if state is None:
            if len(self._versions) >= MAX_VERSIONS:
                return None
            # The first sight is the baseline: what Triton counted before is not ours to date.
            state = self._versions[mv] = _VersionState(now_ns, raw, buckets=self._zeros())
            return state
        pairs = list(zip(raw, state.raw, strict=True))
        reset = any(a is not None and b is not None and a < b for a, b in pairs)
        n, failed, us = (_increase(a, b, reset) for a, b in pairs)
        state.raw = raw
        state.ok += n or 0.0
        state.error += failed or 0.0
        if n:  # the interval's requests go where their latency says
            mean_s = None if us is None else us / n / 1e6
            for seconds, count in bucket_shares(n, mean_s, r.quantiles_us.get(mv, {})):
                state.buckets[bisect.bisect_left(self.bounds, seconds)] += count
        return state

    def _zeros(self) -> list[float]:
        return [0.0] * (len(self.bounds) + 1)

    def _request_points(self, mv: ModelVersion, s: _VersionState, now_ns: int) -> list[Point]:
        model, version = mv
        attrs = (("model", model), ("version", version))
        age_s = max(0.0, (now_ns - s.start_ns) / 1e9)

        def counter(code: str, value: float) -> Point:
            labels = (("code", code), *attrs)
            return Point(self.endpoint, REQUESTS, "counter", labels, (value,), (), False,
                         s.start_ns, age_s)  # fmt: skip

        histogram = Point(self.endpoint, DURATION, "histogram", attrs, array("d", s.buckets),
                          self.bounds, False, s.start_ns, age_s)  # fmt: skip
        return [counter("OK", s.ok), counter("error", s.error), histogram]

    def _gauge_points(self, r: _Reading) -> list[Point]:
        out: list[tuple[str, tuple[tuple[str, str], ...], float]] = []
        out += [("inference_queue_depth", (("model", m),), v) for m, v in sorted(r.queue.items())]
        if r.in_flight is not None:
            out.append(("inference_in_flight_requests", (), r.in_flight))
        if r.gpu_used:
            for name, values in (("used", r.gpu_used), ("total", r.gpu_total)):
                out += [
                    (f"accelerator_memory_{name}_bytes", (("device", d), ("source", "nvml")), v)
                    for d, v in sorted(values.items())
                ]
        for name, per_model in (("used", r.kv_used), ("total", r.kv_total)):
            out += [
                (f"kv_cache_blocks_{name}", (("model", m),), v)
                for m, v in sorted(per_model.items())
            ]
        return [Point(self.endpoint, name, "gauge", attrs, (v,)) for name, attrs, v in out]
