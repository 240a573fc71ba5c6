"""What the model servers report over OTLP, reduced to per-endpoint signals (pure, no I/O).

``TelemetryStore.ingest(request, received_at)`` takes an ``ExportMetricsServiceRequest``;
each resource is one endpoint, keyed by its ``service.instance.id`` (the EDS address
"HOST:PORT"). Counters and histograms (CUMULATIVE, or DELTA accumulated into cumulative) keep
the samples of the last ``window_s`` plus one older baseline; gauges keep their last value.
Times are the receiver's clock at arrival (exporter clocks may be skewed): ages, staleness
and windows use them. The exporter's own timestamps are used only as differences within one
series (skew cancels out): ``time - start_time`` dates the zero a series starts from, and a
rate's span is the exporter's time between two samples, so a receiver's queueing delays do
not move rates (arrival times when the exporter sends no start time).

Signals (each ``Signal(value, age_s)``, ``None`` without data) are computed per endpoint over
the window ending at each series' newest sample: p50/p99 latency from histogram deltas
(linear inside a bucket; the +Inf bucket gives the last bound), qps and error rate from
``inference_requests`` (codes OK/0/200 are successes), and the last gauges. A counter that
goes down (a restart) restarts its series' window. Series not updated within ``window_s`` of
the endpoint's last report (an unloaded model) drop out. Memory is bounded: endpoints,
series per endpoint, samples per series and points per request are capped (the excess is
counted under a reason and dropped). The store is locked, so the receiver may ingest in a
worker thread while the event loop reads ``snapshot``/``as_json``.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import operator
import threading
from array import array
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar, cast

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)

from control_plane.otlp_decode import PointTuple, decode_request

DURATION = "inference_request_duration_seconds"
REQUESTS = "inference_requests"
OK_CODES = frozenset({"ok", "0", "200", "success"})
PLACEMENT_SIGNALS = frozenset({"model_state", "server_draining"})  # see take_placement_hints
MAX_SAMPLES = 256  # per series; a faster exporter shortens the window rather than the memory

Attrs = tuple[tuple[str, str], ...]
Vec = Sequence[float]  # a tuple, or an array of doubles for histogram buckets
Sample = tuple[float, Vec, float]  # (arrival time, values, the exporter's time or 0: unknown)
MAX_INTERNED = 10_000
_Frozen = TypeVar("_Frozen")


# Signals and flags are named tuples, not frozen dataclasses: every endpoint's telemetry holds
# about fifteen, made at each report and at each aged read, and sent by telemetry shards to
# the control plane; a named tuple is several times cheaper to make and to unpickle.
class Signal(NamedTuple):
    value: float
    age_s: float  # now minus the arrival of the newest data point it came from


class Flag(NamedTuple):
    value: bool
    age_s: float


@dataclass(frozen=True)
class ModelTelemetry:
    model: str
    p99_ms: Signal | None
    qps: Signal | None


@dataclass(frozen=True)
class VersionTelemetry:
    """One model version across every endpoint, over the window."""

    requests: float
    p99_ms: Signal | None
    error_rate: Signal | None


@dataclass(frozen=True)
class EndpointTelemetry:
    endpoint: str
    age_s: float  # since the last report
    interval_s: float  # observed reporting interval
    stale: bool
    p50_ms: Signal | None = None
    p99_ms: Signal | None = None
    qps: Signal | None = None
    error_rate: Signal | None = None
    queue_depth: Signal | None = None
    in_flight: Signal | None = None
    memory_used_bytes: Signal | None = None
    memory_total_bytes: Signal | None = None
    memory_source: str | None = None  # "nvml" when any device reports it, else "process"
    kv_blocks_used: Signal | None = None
    kv_blocks_total: Signal | None = None
    draining: Flag | None = None
    models: tuple[ModelTelemetry, ...] = ()
    series: int = 0
    dropped_series: int = 0
    labels: tuple[tuple[str, str], ...] = ()  # server_label gauges set to 1: (name, value)

    def __reduce__(self) -> tuple[Any, ...]:
        # Telemetry shards send thousands a second: as one tuple of plain values, rebuilt
        # without a frozen dataclass's __setattr__ per field or a named tuple's __new__ per
        # signal (pickled as they are, 40-80 us an endpoint; this way about 5).
        return _rebuild_telemetry, (_flat_telemetry(self),)


@dataclass(frozen=True)
class IngestResult:
    points: int  # accepted
    ignored: tuple[tuple[str, int], ...] = ()  # (reason, count), sorted
    errors: tuple[str, ...] = ()  # the first few messages

    @property
    def rejected(self) -> int:
        return sum(n for reason, n in self.ignored if reason != "unknown_metric")


class _Series:
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


class _Endpoint:
    __slots__ = ("computed", "dropped_series", "first_seen", "interval_s", "last_seen", "layout",
                 "series", "shape")  # fmt: skip

    def __init__(self, now: float, interval_s: float) -> None:
        self.first_seen = self.last_seen = now
        self.interval_s = interval_s
        self.series: dict[tuple[str, Attrs], _Series] = {}
        self.dropped_series = 0
        # (when, its telemetry) until the next point arrives: a later read only ages it
        self.computed: tuple[float, EndpointTelemetry] | None = None
        self.layout: _Layout | None = None  # see _telemetry
        self.shape = 0  # series made so far: a layout made before a new one is out of date


class TelemetryStore:
    def __init__(
        self,
        window_s: float = 10.0,
        stale_after_intervals: float = 3.0,
        forget_after_s: float = 300.0,
        max_series_per_endpoint: int = 500,
        max_endpoints: int = 10_000,
        max_points_per_request: int = 20_000,
        default_interval_s: float = 1.0,
        track_changes: bool = False,
    ) -> None:
        self.window_s = window_s
        self.stale_after_intervals = stale_after_intervals
        self.forget_after_s = forget_after_s
        self.max_series_per_endpoint = max_series_per_endpoint
        self.max_endpoints = max_endpoints
        self.max_points_per_request = max_points_per_request
        self.default_interval_s = default_interval_s
        self._endpoints: dict[str, _Endpoint] = {}
        self._lock = threading.Lock()
        self._last_forget = -math.inf
        self._placement_hints: set[str] = set()
        self._interned: dict[Any, Any] = {}  # see _shared
        # For ``changed`` (a telemetry shard): endpoints with data, and forgotten, since the
        # last call. Off by default: nothing would take them.
        self._track = track_changes
        self._dirty: set[str] = set()
        self._forgotten: set[str] = set()

    def __len__(self) -> int:
        return len(self._endpoints)

    def take_placement_hints(self) -> set[str]:
        """The endpoints whose own telemetry said, since the last call, that a model version
        changed state or that the server started or stopped draining: placement should probe
        them now rather than at their turn in its cycle."""
        with self._lock:
            hints, self._placement_hints = self._placement_hints, set()
        return hints

    def ingest(self, request: ExportMetricsServiceRequest, received_at: float) -> IngestResult:
        """Decodes and stores one export request; never raises on bad data."""
        points, ignored, errors = decode_request(request, self.max_points_per_request)
        return self.ingest_points(points, ignored, errors, received_at)

    def ingest_points(
        self,
        points: Sequence[PointTuple],
        ignored: Mapping[str, int],
        errors: Sequence[str],
        received_at: float,
    ) -> IngestResult:
        """Stores what ``decode_request`` made of one request (perhaps in another process)."""
        reasons = Counter(ignored)
        accepted = 0
        with self._lock:
            self._forget(received_at)
            seen: set[str] = set()
            key, endpoint = None, None
            for p in points:
                if p[0] != key:  # an export's points come endpoint by endpoint
                    key = p[0]
                    endpoint = self._endpoint(key, received_at, key not in seen)
                    seen.add(key)
                if endpoint is None:
                    reasons["endpoint_limit"] += 1
                elif self._store(endpoint, p, received_at):
                    accepted += 1
                else:
                    reasons["series_limit"] += 1
        return IngestResult(accepted, tuple(sorted(reasons.items())), tuple(errors[:5]))

    def _endpoint(self, key: str, now: float, first_in_request: bool) -> _Endpoint | None:
        endpoint = self._endpoints.get(key)
        if endpoint is None:
            if len(self._endpoints) >= self.max_endpoints:
                self._forget(now, force=True)
                if len(self._endpoints) >= self.max_endpoints:
                    return None
            endpoint = self._endpoints[key] = _Endpoint(now, self.default_interval_s)
            self._forgotten.discard(key)
        elif first_in_request:
            gap = now - endpoint.last_seen
            if gap >= 0.05:  # several requests of one export round are one arrival
                endpoint.interval_s = 0.7 * endpoint.interval_s + 0.3 * gap
            endpoint.last_seen = max(endpoint.last_seen, now)
        endpoint.computed = None
        if self._track:
            self._dirty.add(key)
        return endpoint

    def _forget(self, now: float, force: bool = False) -> None:
        if not force and now - self._last_forget < 1.0:
            return
        self._last_forget = now
        for key in [
            k for k, e in self._endpoints.items() if now - e.last_seen > self.forget_after_s
        ]:
            del self._endpoints[key]
            if self._track:
                self._forgotten.add(key)
                self._dirty.discard(key)

    def _shared(self, key: Any, value: Any) -> Any:
        """One object for what thousands of endpoints repeat (histogram bounds, label sets),
        kept for the first MAX_INTERNED distinct ones."""
        found = self._interned.get(key)
        if found is None:
            found = value
            if len(self._interned) < MAX_INTERNED:
                self._interned[key] = value
        return found

    def _store(self, endpoint: _Endpoint, p: PointTuple, now: float) -> bool:
        # Unpacked rather than read by name: decoder processes send plain tuples (unpickling
        # a named tuple calls its class, which cost the control plane 13% of its time).
        endpoint_key, name, kind, attrs, point_values, bounds, delta, start_ns, duration_s = p
        key = (name, attrs)
        series = endpoint.series.get(key)
        if series is None or series.kind != kind or series.bounds != bounds:
            if series is None and len(endpoint.series) >= self.max_series_per_endpoint:
                endpoint.dropped_series += 1
                return False
            known = endpoint.first_seen < now  # a new series of a known endpoint: a new version
            bounds = self._shared(("bounds", bounds), bounds)  # one copy of the usual bounds
            attrs, labels = self._shared(("attrs", attrs), (attrs, dict(attrs)))  # and of labels
            series = endpoint.series[(name, attrs)] = _Series(kind, bounds, labels)
            endpoint.shape += 1
            if known and name in PLACEMENT_SIGNALS:
                self._placement_hints.add(endpoint_key)
        samples = series.samples
        if kind == "gauge":
            if name in PLACEMENT_SIGNALS and samples and samples[-1][1] != point_values:
                self._placement_hints.add(endpoint_key)
            samples.clear()
            samples.append((now, point_values, 0.0))
            return True
        duration = min(max(duration_s, 0.0), self.forget_after_s)
        if not samples and endpoint.first_seen < now and series.last_start == 0:
            # A series new at a known endpoint did not exist at its previous report (a
            # version's first error): it was zero one reporting interval ago, not at the
            # exporter's start, which would date its baseline out of the window and lose its
            # first report.
            duration = min(duration, endpoint.interval_s)
        # The exporter's time of this point, known when it sends a start time.
        exported = start_ns / 1e9 + duration_s if start_ns else 0.0
        if delta:
            base = samples[-1][1] if samples else None
            values = (
                point_values
                if base is None
                else _like(point_values, map(operator.add, base, point_values))
            )
        else:
            values = point_values
            restarted = start_ns > series.last_start > 0
            if samples and 0 < start_ns <= series.last_start and exported < samples[-1][2]:
                # An older export arriving late (a retry, or one of a run since restarted):
                # what it counted is in the newer one already, or gone. Read as a counter
                # going back it would restart the window and hide a change for a round.
                return True
            if samples and (restarted or _went_back(values, samples[-1][1], start_ns)):
                samples.clear()  # the counter went back: a restart starts a new window
            series.last_start = max(series.last_start, start_ns)
        if not samples and duration > 0:
            zero_at = exported - duration if exported else 0.0
            samples.append((now - duration, _like(values, (0.0 for _ in values)), zero_at))
        elif samples and samples[-1][0] >= now:  # one arrival (or reordered): the newer value
            now = samples.pop()[0]
        samples.append((now, values, exported))
        while samples[0][0] < now - self.window_s:
            samples.popleft()
        return True

    # -- reading -------------------------------------------------------------------------------
    def snapshot(self, now: float, ages: bool = True) -> dict[str, EndpointTelemetry]:
        """Every endpoint's telemetry at ``now``. ``ages=False`` (the routing loop, which reads
        no age): an endpoint with no new data since it was last computed comes back as it was
        computed, the same object, only its ``stale`` flag brought up to date; re-making every
        signal of every endpoint to age it cost 30 us an endpoint at every tick."""
        with self._lock:
            self._forget(now, force=True)
            return {key: self._computed(key, e, now, ages) for key, e in self._endpoints.items()}

    def changed(self, now: float) -> tuple[dict[str, EndpointTelemetry], set[str]]:
        """(the telemetry at ``now`` of every endpoint that reported since the last call, the
        endpoints forgotten since): what a telemetry shard sends the control plane. Needs
        ``track_changes``."""
        with self._lock:
            self._forget(now)
            dirty, self._dirty = self._dirty, set()
            forgotten, self._forgotten = self._forgotten, set()
            endpoints = self._endpoints
            return {k: self._computed(k, endpoints[k], now, False) for k in dirty}, forgotten

    def _computed(self, key: str, e: _Endpoint, now: float, ages: bool) -> EndpointTelemetry:
        """The endpoint's telemetry; unchanged data since the last read is only aged (routing
        reads every endpoint twice per reporting interval; at fleet scale this halves it)."""
        if e.computed is not None and e.computed[0] <= now:
            e.computed, telemetry = read_computed(e.computed, now, ages, self.stale_after_intervals)
            return telemetry
        telemetry = self._telemetry(key, e, now)
        e.computed = (now, telemetry)
        return telemetry

    def as_json(self, now: float, ages: bool = True) -> dict[str, Any]:
        """What the admin's GET /telemetry serves (``ages``: see ``snapshot``)."""
        return telemetry_document(
            self.snapshot(now, ages), self.window_s, self.stale_after_intervals
        )

    def version_stats(
        self, model: str, now: float, since: float | None = None
    ) -> dict[str, VersionTelemetry]:
        """Per version of ``model`` across every endpoint: requests, p99 and error rate over the
        window (only what arrived after ``since``, when given), histograms merged first."""
        with self._lock:
            parts = self._version_series(model, since, copy=False)
            return version_telemetry([p for _, p in parts.values()], now, self.window_s)

    def version_series(self, model: str, since: float | None = None) -> VersionSeries:
        """What ``version_stats`` is computed from, per endpoint: (its last report, per version
        (duration series, request series)), copied: a telemetry shard sends it to the control
        plane, which merges the shards' (``version_telemetry``)."""
        with self._lock:
            return self._version_series(model, since, copy=True)

    def _version_series(self, model: str, since: float | None, copy: bool) -> VersionSeries:
        out: VersionSeries = {}
        for key, e in self._endpoints.items():
            for (name, _), s in e.series.items():
                labels = s.labels
                if labels.get("model") != model or not s.samples:
                    continue
                if s.samples[-1][0] < e.last_seen - self.window_s:
                    continue  # an unloaded version
                index = 0 if name == DURATION else 1 if name == REQUESTS else None
                if index is None:
                    continue
                if since is not None or copy:
                    s = _after(s, -math.inf if since is None else since)
                if s.samples:  # else nothing arrived since
                    versions = out.setdefault(key, (e.last_seen, {}))[1]
                    pair = versions.setdefault(labels.get("version", ""), ([], []))
                    pair[index].append((labels, s))
        return out

    def _telemetry(self, key: str, e: _Endpoint, now: float) -> EndpointTelemetry:
        layout = e.layout
        cutoff = e.last_seen - self.window_s
        if layout is None or not layout.holds(e, cutoff):
            layout = e.layout = _Layout(e, cutoff)
        window = self.window_s
        age = now - e.last_seen
        p50, p99 = _percentiles_ms(layout.durations, (0.5, 0.99), now, window)
        qps = _rate(layout.requests, now, window)
        fields: dict[str, Any] = {}
        for name, series in layout.gauges:
            if len(series) == 1:  # the usual: one series, whose samples are its last value
                at, values, _ = series[0][1].samples[-1]
                fields[name] = _new_pair(Signal, (values[0], now - at))
            else:
                fields[name] = _gauge_sum(series, now)
        draining = _gauge_sum(layout.draining, now)
        if layout.single:  # the usual server: its model's figures are the endpoint's
            models: tuple[ModelTelemetry, ...] = (
                _made(ModelTelemetry, model=layout.models[0], p99_ms=p99, qps=qps),
            )
        else:
            models = tuple(
                _made(
                    ModelTelemetry,
                    model=model,
                    p99_ms=_percentiles_ms(durations, (0.99,), now, window)[0],
                    qps=_rate(requests, now, window),
                )
                for model, durations, requests in layout.by_model
            )
        return _made(
            EndpointTelemetry,
            endpoint=key,
            age_s=age,
            interval_s=e.interval_s,
            stale=is_stale(age, e.interval_s, self.stale_after_intervals),
            p50_ms=p50,
            p99_ms=p99,
            qps=qps,
            error_rate=_error_rate(layout.requests, now, window),
            memory_source=layout.memory_source,
            draining=None if draining is None else Flag(draining.value > 0, draining.age_s),
            models=models,
            series=len(e.series),
            dropped_series=e.dropped_series,
            labels=_labels(layout.labels) if layout.labels else (),
            **fields,
        )


class _Layout:
    """Which of an endpoint's series feed which signal. A server's series are the same from one
    report to the next, so this is made when one appears or goes quiet, not at every report
    (at fleet scale a telemetry shard windows 10,000 reports a second)."""

    __slots__ = ("by_model", "draining", "durations", "gauges", "labels", "live", "memory_source",
                 "models", "quiet", "requests", "shape", "single")  # fmt: skip

    def __init__(self, e: _Endpoint, cutoff: float) -> None:
        self.shape = e.shape
        live: dict[str, Labeled] = {}  # metric name -> its series still reporting
        self.live: list[_Series] = []
        self.quiet: list[_Series] = []  # reported, but not within the window
        for (name, _), s in e.series.items():
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
        self.labels = live.get("server_label", [])

    def holds(self, e: _Endpoint, cutoff: float) -> bool:
        """Whether this is still the endpoint's layout: no series new since, none gone quiet
        and none of the quiet ones back."""
        return (
            self.shape == e.shape
            and (not self.live or min([s.samples[-1][0] for s in self.live]) >= cutoff)
            and not any(s.samples and s.samples[-1][0] >= cutoff for s in self.quiet)
        )


# (EndpointTelemetry field, the gauge it sums)
_GAUGES = (
    ("queue_depth", "inference_queue_depth"),
    ("in_flight", "inference_in_flight_requests"),
    ("memory_used_bytes", "accelerator_memory_used_bytes"),
    ("memory_total_bytes", "accelerator_memory_total_bytes"),
    ("kv_blocks_used", "kv_cache_blocks_used"),
    ("kv_blocks_total", "kv_cache_blocks_total"),
)


def telemetry_document(
    snapshot: Mapping[str, EndpointTelemetry], window_s: float, stale_after_intervals: float
) -> dict[str, Any]:
    """GET /telemetry's body."""
    return {
        "window_s": window_s,
        "stale_after_intervals": stale_after_intervals,
        "endpoints": {k: telemetry_json(snapshot[k]) for k in sorted(snapshot)},
    }


def telemetry_json(t: EndpointTelemetry) -> dict[str, Any]:
    """``dataclasses.asdict(t)``, without its deep copies: 10-20x faster, which matters when a
    live-view frame or GET /telemetry covers thousands of endpoints."""

    def plain(s: Signal | Flag | None) -> dict[str, Any] | None:
        return None if s is None else {"value": s.value, "age_s": s.age_s}

    out: dict[str, Any] = {}
    for name in _TELEMETRY_FIELDS:
        value = getattr(t, name)
        if isinstance(value, Signal | Flag):
            value = plain(value)
        elif name == "labels":
            value = dict(value)
        elif name == "models":
            value = tuple(
                {"model": m.model, "p99_ms": plain(m.p99_ms), "qps": plain(m.qps)} for m in value
            )
        out[name] = value
    return out


_TELEMETRY_FIELDS = tuple(f.name for f in dataclasses.fields(EndpointTelemetry))


# Positions of the fields pickled as plain tuples (annotations are strings here).
_PAIRS_AT = tuple(
    i
    for i, f in enumerate(dataclasses.fields(EndpointTelemetry))
    if f.type in ("Signal | None", "Flag | None")
)
_MODELS_AT = _TELEMETRY_FIELDS.index("models")
_new_pair = tuple.__new__


def _plain(pair: Signal | Flag | None) -> tuple[Any, Any] | None:
    return None if pair is None else (pair[0], pair[1])


def _flat_telemetry(t: EndpointTelemetry) -> tuple[Any, ...]:
    values = list(map(t.__dict__.__getitem__, _TELEMETRY_FIELDS))
    for i in _PAIRS_AT:
        values[i] = _plain(values[i])
    values[_MODELS_AT] = tuple((m.model, _plain(m.p99_ms), _plain(m.qps)) for m in t.models)
    return tuple(values)


def _rebuild_telemetry(flat: tuple[Any, ...]) -> EndpointTelemetry:
    values = list(flat)
    for i in _PAIRS_AT:
        pair = values[i]
        if pair is not None:
            values[i] = _new_pair(Flag if i == _DRAINING_AT else Signal, pair)
    values[_MODELS_AT] = tuple(
        _made(
            ModelTelemetry,
            model=model,
            p99_ms=None if p99 is None else _new_pair(Signal, p99),
            qps=None if qps is None else _new_pair(Signal, qps),
        )
        for model, p99, qps in values[_MODELS_AT]
    )
    return _made(EndpointTelemetry, zip(_TELEMETRY_FIELDS, values, strict=True))


_DRAINING_AT = _TELEMETRY_FIELDS.index("draining")


# -- pure computations over series -----------------------------------------------------------
def _made(cls: type[_Frozen], pairs: Iterable[tuple[str, Any]] = (), **fields: Any) -> _Frozen:
    """``cls(**fields)`` (and ``pairs``) for a frozen dataclass given every field, without its
    __init__: that sets each field through object.__setattr__ (8 us for an EndpointTelemetry,
    3 for a ModelTelemetry; a shard makes one of each per endpoint report, 10,000 a second, and
    the control plane unpickles what it pushes)."""
    made: _Frozen = object.__new__(cls)
    made.__dict__.update(pairs, **fields)
    return made


def _went_back(values: Vec, before: Vec, start_ns: int) -> bool:
    """Whether a cumulative point went below the one before it (a restart: its window starts
    again). Value by value when the exporter sends no start time. With one, a restart comes
    with a new start time, checked before this; a histogram's total going down is the safety
    net (its 70 buckets compared one by one were a fifth of storing a server's report)."""
    if len(values) == 1:
        return values[0] < before[0]
    if start_ns:
        return sum(values) < sum(before)
    return any(map(float.__lt__, values, before))


def _like(values: Vec, items: Iterable[float]) -> Vec:
    """``items`` stored like ``values``: an array of doubles stays one."""
    return array("d", items) if isinstance(values, array) else tuple(items)


def is_stale(age_s: float, interval_s: float, stale_after_intervals: float) -> bool:
    """An endpoint is stale once its last report is older than that many of its intervals."""
    return age_s > stale_after_intervals * interval_s


def _aged(t: EndpointTelemetry, dt: float, stale_after_intervals: float) -> EndpointTelemetry:
    """``t`` read ``dt`` seconds later with no new data: every age grows by ``dt``."""
    if dt == 0:
        return t

    def older(s: Signal | None) -> Signal | None:
        return None if s is None else Signal(s.value, s.age_s + dt)

    age = t.age_s + dt
    return dataclasses.replace(
        t,
        age_s=age,
        stale=is_stale(age, t.interval_s, stale_after_intervals),
        p50_ms=older(t.p50_ms),
        p99_ms=older(t.p99_ms),
        qps=older(t.qps),
        error_rate=older(t.error_rate),
        queue_depth=older(t.queue_depth),
        in_flight=older(t.in_flight),
        memory_used_bytes=older(t.memory_used_bytes),
        memory_total_bytes=older(t.memory_total_bytes),
        kv_blocks_used=older(t.kv_blocks_used),
        kv_blocks_total=older(t.kv_blocks_total),
        draining=None if t.draining is None else Flag(t.draining.value, t.draining.age_s + dt),
        models=tuple(ModelTelemetry(m.model, older(m.p99_ms), older(m.qps)) for m in t.models),
    )


Labeled = list[tuple[dict[str, str], _Series]]
# endpoint -> (its last report, version -> (duration series, request series))
VersionSeries = dict[str, tuple[float, dict[str, tuple[Labeled, Labeled]]]]


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
            _percentiles_ms(durations.get(version, []), (0.99,), now, window_s)[0],
            _error_rate(requests.get(version, []), now, window_s),
        )
        for version in sorted(durations.keys() | requests.keys())
    }


def read_computed(
    cached: tuple[float, EndpointTelemetry], now: float, ages: bool, stale_after_intervals: float
) -> tuple[tuple[float, EndpointTelemetry], EndpointTelemetry]:
    """(the entry to keep, the telemetry to return) for telemetry computed at ``cached[0]``
    and read at ``now`` with no new data. ``ages``: every age brought to ``now``. Else the
    same object, unless its stale flag flips: then it is aged once and kept aged."""
    at, computed = cached
    if ages:
        return cached, _aged(computed, now - at, stale_after_intervals)
    age = computed.age_s + now - at
    if is_stale(age, computed.interval_s, stale_after_intervals) == computed.stale:
        return cached, computed
    computed = _aged(computed, now - at, stale_after_intervals)
    return (now, computed), computed


def _only(series: Labeled, model: str) -> Labeled:
    return [(a, s) for a, s in series if a.get("model", "") == model]


def _memory_source(used: Labeled) -> str | None:
    sources = {a.get("source", "") for a, _ in used}
    return "nvml" if "nvml" in sources else min(sources) if sources else None


def _labels(series: Labeled) -> tuple[tuple[str, str], ...]:
    """The (name, value) pairs whose gauge is set; one value per name (the greatest)."""
    found = {
        a.get("name", ""): a.get("value", "")
        for a, s in sorted(series, key=lambda item: item[0].get("value", ""))
        if s.samples[-1][1][0] > 0
    }
    return tuple(sorted((k, v) for k, v in found.items() if k and v))


def _gauge_sum(series: Labeled, now: float) -> Signal | None:
    if not series:
        return None
    if len(series) == 1:  # the usual case, read without the generators below
        at, values, _ = series[0][1].samples[-1]
        return Signal(values[0], now - at)
    newest = [s.samples[-1] for _, s in series]
    return Signal(sum(v[1][0] for v in newest), now - min(v[0] for v in newest))


def window_delta(samples: deque[Sample], window_s: float) -> tuple[Vec, float, float]:
    """(newest - baseline, the span in seconds, the newest arrival); see ``window_ends``."""
    new, base, span, t_new = window_ends(samples, window_s)
    return _like(new, map(operator.sub, new, base)), span, t_new


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


def _rate(series: Labeled, now: float, window_s: float) -> Signal | None:
    total, newest, found = 0.0, -math.inf, False
    for _, s in series:
        delta, span, t = s.delta(window_s)
        if span > 0:
            total, newest, found = total + delta[0] / span, max(newest, t), True
    return Signal(total, now - newest) if found else None


def _after(series: _Series, since: float) -> _Series:
    """A copy holding the samples that arrived at or after ``since`` (empty when none did):
    the first of them is the baseline, so what was reported before ``since`` never counts.
    Except a zero just before ``since``, which a series first seen after it starts from (a
    version's first errors): without it they would count only from its second report, and a
    canary could pass a step on its successes alone."""
    copy = _Series(series.kind, series.bounds, series.labels)
    samples = list(series.samples)
    first = next((i for i, sample in enumerate(samples) if sample[0] >= since), len(samples))
    if first < len(samples):
        zero_before = first > 0 and not any(samples[first - 1][1])
        copy.samples.extend(samples[first - 1 if zero_before else first :])
    return copy


def _count(series: Labeled, window_s: float) -> float:
    return sum(s.delta(window_s)[0][0] for _, s in series)


def _error_rate(series: Labeled, now: float, window_s: float) -> Signal | None:
    errors = total = 0.0
    newest = -math.inf
    for attrs, s in series:
        delta, span, t = s.delta(window_s)
        if span > 0:
            total += delta[0]
            errors += 0.0 if attrs.get("code", "").lower() in OK_CODES else delta[0]
            newest = max(newest, t)
    if newest == -math.inf:
        return None
    return Signal(errors / total if total > 0 else 0.0, now - newest)


def _percentiles_ms(
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
