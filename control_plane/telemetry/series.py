"""An endpoint's series and what is computed over their windows (pure, no I/O): percentiles
from histogram deltas (linear inside a bucket; the +Inf bucket gives the last bound), rates
and error rates from counters, the last gauges, per-version statistics merged over endpoints,
and which series feed which signal (``Layout``)."""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from array import array
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

from control_plane.telemetry.values import Signal, VersionTelemetry
from infermesh import wire

DURATION, REQUESTS = wire.REQUEST_DURATION, wire.REQUESTS
OK_CODES = frozenset({"ok", "0", "200", "success"})
CANCELLED_CODES = frozenset({"cancelled", "1", "499"})  # gRPC CANCELLED; HTTP 499
# The caller's mistakes, answered correctly: a hostile or buggy client must not make a server
# look broken (with session affinity its requests all land on one server, which would be
# ejected, then the next). gRPC names and numbers; HTTP 4xx but 408 and 429, which say the
# server was slow or full.
CALLERS_CODES = frozenset({
    "invalid_argument", "3", "not_found", "5", "already_exists", "6", "permission_denied",
    "7", "failed_precondition", "9", "out_of_range", "11", "unimplemented", "12",
    "unauthenticated", "16",
})  # fmt: skip
SERVERS_HTTP_4XX = frozenset({"408", "429"})
MAX_SAMPLES = 256  # per series; a faster exporter shortens the window rather than the memory

_new_pair = tuple.__new__
Vec = Sequence[float]  # a tuple, or an array of doubles for histogram buckets
Sample = tuple[float, Vec, float]  # (arrival time, values, the exporter's time or 0: unknown)


class Series:
    """One metric with one attribute set at one endpoint: its samples over the window and one
    older baseline (a gauge: its last value)."""

    __slots__ = ("_delta", "bounds", "kind", "labels", "last_start", "samples")

    def __init__(self, kind: str, bounds: Vec, labels: dict[str, str] | None = None) -> None:
        self.kind = kind  # "gauge", "counter", "histogram"
        self.bounds = bounds
        self.labels = labels or {}  # the attributes as a dict, made once (reads need it often)
        self.last_start = 0
        # A gauge keeps only its last value: a list, as a deque allocates a block of 64 slots.
        self.samples: deque[Sample] = (
            deque(maxlen=MAX_SAMPLES) if kind != "gauge" else cast("deque[Sample]", [])
        )
        self._delta: tuple[object, object, float, tuple[Vec, float, float]] | None = None

    def delta(self, window_s: float) -> tuple[Vec, float, float]:
        """``window_delta`` of the samples, kept until a sample arrives or leaves: a series
        reporting every second is read by every routing tick and by every p50/p99/rate."""
        first, last, cached = self.samples[0], self.samples[-1], self._delta
        if cached and cached[0] is first and cached[1] is last and cached[2] == window_s:
            return cached[3]
        result = window_delta(self.samples, window_s)
        self._delta = (first, last, window_s, result)
        return result


Labeled = list[tuple[dict[str, str], Series]]


# endpoint -> (its last report, version -> (duration series, request series))
VersionSeries = dict[str, tuple[float, dict[str, tuple[Labeled, Labeled]]]]


class Layout:
    """Which of an endpoint's series feed which signal. A server's series are the same from one
    report to the next, so this is made when one appears or goes quiet, not at every report
    (at fleet scale a telemetry shard windows 10,000 reports a second)."""

    __slots__ = ("by_model", "draining", "durations", "gauges", "labels", "live", "memory_source",
                 "models", "oldest", "prefix", "quiet", "requests", "shape", "single")  # fmt: skip

    def __init__(self, series: Mapping[tuple[str, Any], Series], shape: int, cutoff: float) -> None:
        """The layout of an endpoint's ``series`` (``shape``: how many it has made so far) for
        the series that reported at ``cutoff`` or later."""
        self.shape = shape
        live: dict[str, Labeled] = {}  # metric name -> its series still reporting
        self.live: list[Series] = []
        self.quiet: list[Series] = []  # reported, but not within the window
        for (name, _), s in series.items():
            if s.samples and s.samples[-1][0] >= cutoff:
                live.setdefault(name, []).append((s.labels, s))
                self.live.append(s)
            else:
                self.quiet.append(s)
        self.durations = durations = live.get(DURATION, [])
        self.requests = requests = live.get(REQUESTS, [])
        self.models = tuple(sorted({a.get("model", "") for a, _ in durations + requests}))
        self.single = len(self.models) == 1
        self.by_model = tuple(
            (model, _only(durations, model), _only(requests, model)) for model in self.models
        )
        self.memory_source = source = _memory_source(live.get("accelerator_memory_used_bytes", []))
        self.gauges = tuple(
            (field, [(a, s) for a, s in live.get(name, []) if a.get("source", "") == source])
            if field.startswith("memory_")
            else (field, live.get(name, []))
            for field, name in _GAUGES
        )
        self.draining = live.get("server_draining", [])
        self.prefix = (
            live.get(wire.PREFIX_HIT_TOKENS, []),
            live.get(wire.PREFIX_LOOKUP_TOKENS, []),
        )
        self.labels = live.get("server_label", [])
        self.oldest = self._oldest()

    def _oldest(self) -> float:
        """The oldest of the live series' newest arrivals."""
        return min([s.samples[-1][0] for s in self.live], default=math.inf)

    def holds(self, shape: int, cutoff: float) -> bool:
        """Whether this is still the endpoint's layout: no series new since, none gone quiet
        and none of the quiet ones back. A series' newest arrival only moves on (the store
        never dates a sample before the one it replaces), so the live ones are read again
        only once the oldest of them, as last read, is out of the window."""
        if self.shape != shape:
            return False
        if self.quiet and any(s.samples and s.samples[-1][0] >= cutoff for s in self.quiet):
            return False
        if self.oldest < cutoff:
            self.oldest = self._oldest()
        return self.oldest >= cutoff


# (EndpointTelemetry field, the gauge it sums)
_GAUGES = (
    ("queue_depth", "inference_queue_depth"),
    ("in_flight", "inference_in_flight_requests"),
    ("memory_used_bytes", "accelerator_memory_used_bytes"),
    ("memory_total_bytes", "accelerator_memory_total_bytes"),
    ("kv_blocks_used", "kv_cache_blocks_used"),
    ("kv_blocks_total", "kv_cache_blocks_total"),
)


def went_back(values: Vec, before: Vec, start_ns: int) -> bool:
    """Whether a cumulative point went below the one before it (a restart: its window starts
    again). Value by value when the exporter sends no start time. With one, a restart comes
    with a new start time, checked before this; a histogram's total going down is the safety
    net (its 70 buckets compared one by one were a fifth of storing a server's report)."""
    if len(values) == 1:
        return values[0] < before[0]
    if start_ns:
        return sum(values) < sum(before)
    return any(map(float.__lt__, values, before))


def like(values: Vec, items: Iterable[float]) -> Vec:
    """``items`` stored like ``values``: an array of doubles stays one."""
    return array("d", items) if isinstance(values, array) else tuple(items)


def window_delta(samples: deque[Sample], window_s: float) -> tuple[Vec, float, float]:
    """(newest - baseline, the span in seconds, the newest arrival); see ``window_ends``."""
    new, base, span, t_new = window_ends(samples, window_s)
    return like(new, map(operator.sub, new, base)), span, t_new


def window_ends(samples: deque[Sample], window_s: float) -> tuple[Vec, Vec, float, float]:
    """(the newest values, the baseline's, the span in seconds, the newest arrival); the
    baseline is the oldest sample that arrived at most ``window_s`` before the newest one
    (span 0: no rate yet). The span is the exporter's time between them when both carry it
    (arrival jitter at a busy receiver moved rates by several percent), else their arrival
    times'."""
    t_new, new, exported_new = samples[-1]
    t_base, base, exported_base = next(s for s in samples if s[0] >= t_new - window_s)
    span = t_new - t_base
    exported_span = exported_new - exported_base
    if exported_new > 0 and exported_base > 0 and 0.5 * span <= exported_span <= 2 * span:
        span = exported_span  # (a span far from the arrivals' is a clock step: not used)
    return new, base, span, t_new


def gauge_sum(series: Labeled, now: float) -> Signal | None:
    if not series:
        return None
    if len(series) == 1:  # the usual case, read without the generators below
        at, values, _ = series[0][1].samples[-1]
        return _new_pair(Signal, (values[0], now - at))  # (without __new__'s Python frame)
    newest = [s.samples[-1] for _, s in series]
    return Signal(sum(v[1][0] for v in newest), now - min(v[0] for v in newest))


def rate(series: Labeled, now: float, window_s: float) -> Signal | None:
    total, newest, found = 0.0, -math.inf, False
    for _, s in series:
        delta, span, t = s.delta(window_s)
        if span > 0:
            total, newest, found = total + delta[0] / span, max(newest, t), True
    return Signal(total, now - newest) if found else None


def callers_mistake(code: str) -> bool:
    """Whether a request's status code (lower case) is the caller's mistake, not the server's."""
    if code in CALLERS_CODES:
        return True
    return len(code) == 3 and code.startswith("4") and code not in SERVERS_HTTP_4XX


def _outcomes(series: Labeled, window_s: float) -> tuple[float, float, float, float, float]:
    """(errors, cancelled, the callers' mistakes, all requests, the newest sample's time) over
    the window."""
    errors = cancelled = mistakes = total = 0.0
    newest = -math.inf
    for attrs, s in series:
        delta, span, t = s.delta(window_s)
        if span > 0:
            code = attrs.get("code", "").lower()
            total += delta[0]
            if code in OK_CODES:
                pass
            elif code in CANCELLED_CODES:
                cancelled += delta[0]
            elif callers_mistake(code):
                mistakes += delta[0]
            else:
                errors += delta[0]
            newest = max(newest, t)
    return errors, cancelled, mistakes, total, newest


def error_rate(series: Labeled, now: float, window_s: float) -> Signal | None:
    """The server's failures over the requests it is judged on: one its caller cancelled (a
    hedge that lost its race, a client that gave up) or refused for the caller's own mistake
    (a bad argument, a missing credential) is neither a success nor the server's failure."""
    errors, cancelled, mistakes, total, newest = _outcomes(series, window_s)
    if newest == -math.inf:
        return None
    judged = total - cancelled - mistakes
    return Signal(errors / judged if judged > 0 else 0.0, now - newest)


def abandoned_rate(series: Labeled, now: float, window_s: float) -> Signal | None:
    """Requests their callers cancelled over all requests: with hedging, the tries that were
    slower than the per-try timeout and lost their race to another server."""
    _, cancelled, _, total, newest = _outcomes(series, window_s)
    if newest == -math.inf:
        return None
    return Signal(cancelled / total if total > 0 else 0.0, now - newest)


def share(part: Labeled, whole: Labeled, now: float, window_s: float) -> Signal | None:
    """How much ``part`` grew over the window as a share of how much ``whole`` did (prefix-cache
    hit tokens over looked-up tokens); None when ``whole`` did not grow."""
    grown, newest = 0.0, -math.inf
    for _, s in whole:
        delta, span, t = s.delta(window_s)
        if span > 0:
            grown, newest = grown + delta[0], max(newest, t)
    if grown <= 0:
        return None
    hits = 0.0
    for _, s in part:
        delta, span, _ = s.delta(window_s)
        hits += delta[0] if span > 0 else 0.0
    return Signal(min(1.0, hits / grown), now - newest)


def _count(series: Labeled, window_s: float) -> float:
    return sum(s.delta(window_s)[0][0] for _, s in series)


def percentiles_ms(
    series: Labeled, qs: tuple[float, ...], now: float, window_s: float
) -> list[Signal | None]:
    """The qs-quantiles in milliseconds of the histogram deltas, merged once and re-binned onto
    the bounds of the series with the most observations."""
    if len(series) == 1:  # the usual endpoint: one series, its running counts made once
        s = series[0][1]
        new, base, span, t = window_ends(s.samples, window_s)
        running = list(itertools.accumulate(map(operator.sub, new, base)))
        if span <= 0 or running[-1] <= 0:
            return [None for _ in qs]
        return [Signal(v * 1000.0, now - t) for v in running_quantiles(s.bounds, running, qs)]
    deltas = [(s.bounds, *s.delta(window_s)) for _, s in series]
    deltas = [d for d in deltas if d[2] > 0 and sum(d[1]) > 0]
    if not deltas:
        return [None for _ in qs]
    age = now - max(t for *_, t in deltas)
    bounds = max(deltas, key=lambda d: sum(d[1]))[0]
    merged = [0.0] * (len(bounds) + 1)
    for own, delta, _, _ in deltas:
        if own == bounds and len(delta) == len(merged):  # the usual case: nothing to re-bin
            merged = list(map(operator.add, merged, delta))
            continue
        for i, n in enumerate(delta):
            upper = own[i] if i < len(own) else math.inf
            merged[bisect.bisect_left(bounds, upper)] += n
    return [Signal(v * 1000.0, age) for v in bucket_quantiles(bounds, merged, qs)]


def bucket_quantile(bounds: Vec, counts: list[float] | Vec, q: float) -> float:
    """The q-quantile of an explicit-bounds histogram (``len(counts) == len(bounds) + 1``):
    linear inside a bucket, the first bucket starts at min(0, its bound), +Inf gives the last
    bound. NaN for an empty histogram."""
    return bucket_quantiles(bounds, counts, (q,))[0]


def bucket_quantiles(bounds: Vec, counts: list[float] | Vec, qs: Sequence[float]) -> list[float]:
    """``bucket_quantile`` of each of ``qs``: the running counts are summed once and each
    quantile's bucket is a bisection (the routing tick reads p50 and p99 of every endpoint)."""
    return running_quantiles(bounds, list(itertools.accumulate(counts)), qs)


def running_quantiles(bounds: Vec, running: list[float], qs: Sequence[float]) -> list[float]:
    """``bucket_quantiles`` from the running sums of the counts."""
    total = running[-1] if running else 0.0
    if total <= 0 or not bounds:
        return [math.nan if total <= 0 else 0.0 for _ in qs]
    out = []
    n = len(running)
    for q in qs:
        rank = q * total
        i = bisect.bisect_left(running, rank)
        while i < n and running[i] <= (running[i - 1] if i else 0.0):  # rank 0: the first
            i += 1  # bucket with a count
        if i >= len(bounds):
            out.append(float(bounds[-1]))
            continue
        below = running[i - 1] if i > 0 else 0.0
        lower = bounds[i - 1] if i > 0 else min(0.0, bounds[0])
        out.append(lower + (bounds[i] - lower) * max(0.0, rank - below) / (running[i] - below))
    return out


def version_telemetry(
    parts: Iterable[Mapping[str, tuple[Labeled, Labeled]]], now: float, window_s: float
) -> dict[str, VersionTelemetry]:
    """Per version: requests, p99 (histograms merged first) and error rate over the window,
    from the series of each endpoint (``version_series``)."""
    durations: dict[str, Labeled] = {}
    requests: dict[str, Labeled] = {}
    for versions in parts:
        for version, (d, r) in versions.items():
            durations.setdefault(version, []).extend(d)
            requests.setdefault(version, []).extend(r)
    return {
        version: VersionTelemetry(
            _count(requests.get(version, []), window_s),
            percentiles_ms(durations.get(version, []), (0.99,), now, window_s)[0],
            error_rate(requests.get(version, []), now, window_s),
        )
        for version in sorted(durations.keys() | requests.keys())
    }


def copy_since(series: Series, since: float) -> Series:
    """A copy holding the samples that arrived at or after ``since`` (empty when none did):
    the first of them is the baseline, so what was reported before ``since`` never counts.
    Except a zero just before ``since``, which a series first seen after it starts from (a
    version's first errors): without it they would count only from its second report, and a
    canary could pass a step on its successes alone."""
    copy = Series(series.kind, series.bounds, series.labels)
    samples = list(series.samples)
    first = next((i for i, sample in enumerate(samples) if sample[0] >= since), len(samples))
    if first < len(samples):
        zero_before = first > 0 and not any(samples[first - 1][1])
        copy.samples.extend(samples[first - 1 if zero_before else first :])
    return copy


def _only(series: Labeled, model: str) -> Labeled:
    return [(a, s) for a, s in series if a.get("model", "") == model]


def _memory_source(used: Labeled) -> str | None:
    sources = {a.get("source", "") for a, _ in used}
    return "nvml" if "nvml" in sources else min(sources) if sources else None


def server_labels(series: Labeled) -> tuple[tuple[str, str], ...]:
    """The (name, value) pairs whose gauge is set; one value per name (the greatest)."""
    found = {
        a.get("name", ""): a.get("value", "")
        for a, s in sorted(series, key=lambda item: item[0].get("value", ""))
        if s.samples[-1][1][0] > 0
    }
    return tuple(sorted((k, v) for k, v in found.items() if k and v))
