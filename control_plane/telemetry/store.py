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
``inference_requests`` (codes OK/0/200 are successes), and the last gauges. A restart (a
later start time, or a counter going down; for a histogram with a start time, its total)
restarts its series' window. Series not updated within ``window_s`` of the endpoint's last
report (an unloaded model) drop out. Memory is bounded: endpoints, series per endpoint,
samples per series and points per request are capped (the excess is counted under a reason
and dropped). The store is locked, so the receiver may ingest in a worker thread while the
event loop reads ``snapshot``/``as_json``.

The signals are values of ``telemetry_values``; the series and the computations over their
windows are ``telemetry_series``.

Why it is one module of this length: ingestion and the windowed reads share the per-endpoint
series and its lock; reading is its own section.
"""

from __future__ import annotations

import math
import operator
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)

from control_plane.telemetry.decode import PointTuple, decode_request
from control_plane.telemetry.series import (
    DURATION,
    REQUESTS,
    Layout,
    Series,
    VersionSeries,
    abandoned_rate,
    copy_since,
    error_rate,
    gauge_sum,
    like,
    percentiles_ms,
    rate,
    server_labels,
    share,
    version_telemetry,
    went_back,
)
from control_plane.telemetry.values import (
    EndpointTelemetry,
    Flag,
    IngestResult,
    ModelTelemetry,
    VersionTelemetry,
    is_stale,
    made,
    read_computed,
    telemetry_document,
)

PLACEMENT_SIGNALS = frozenset({"model_state", "server_draining"})  # see take_placement_hints
MAX_INTERNED = 10_000


Attrs = tuple[tuple[str, str], ...]


class _Endpoint:
    __slots__ = ("computed", "dropped_series", "first_seen", "interval_s", "last_seen", "layout",
                 "series", "shape")  # fmt: skip

    def __init__(self, now: float, interval_s: float) -> None:
        self.first_seen = self.last_seen = now
        self.interval_s = interval_s
        self.series: dict[tuple[str, Attrs], Series] = {}
        self.dropped_series = 0
        # (when, its telemetry) until the next point arrives: a later read only ages it
        self.computed: tuple[float, EndpointTelemetry] | None = None
        self.layout: Layout | None = None  # see _telemetry
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
            seen: dict[str, _Endpoint | None] = {}
            key, endpoint = None, None
            for p in points:
                if p[0] != key:  # an export's points come endpoint by endpoint
                    key = p[0]
                    endpoint = seen[key] = self._endpoint(key, received_at, key not in seen)
                if endpoint is None:
                    reasons["endpoint_limit"] += 1
                elif self._store(endpoint, p, received_at):
                    accepted += 1
                else:
                    reasons["series_limit"] += 1
            if self._track:
                # A telemetry shard windows each endpoint as its report is stored, while its
                # samples are in the CPU's cache: at the next push, after other endpoints'
                # reports, the same took ~1.6x as long (5,000 endpoints a shard).
                for key, endpoint in seen.items():
                    if endpoint is not None:
                        at = max(received_at, endpoint.last_seen)
                        endpoint.computed = (at, self._telemetry(key, endpoint, at))
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
            series = endpoint.series[(name, attrs)] = Series(kind, bounds, labels)
            endpoint.shape += 1
            if known and name in PLACEMENT_SIGNALS:
                self._placement_hints.add(endpoint_key)
        samples = series.samples
        if kind == "gauge":
            if samples and samples[-1][0] > now:
                return True  # arrived before the value held (requests stored out of order)
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
                else like(point_values, map(operator.add, base, point_values))
            )
        else:
            values = point_values
            restarted = start_ns > series.last_start > 0
            if samples and 0 < start_ns <= series.last_start and exported < samples[-1][2]:
                # An older export arriving late (a retry, or one of a run since restarted):
                # what it counted is in the newer one already, or gone. Read as a counter
                # going back it would restart the window and hide a change for a round.
                return True
            if samples and (restarted or went_back(values, samples[-1][1], start_ns)):
                # The counter went back: a restart starts a new window. (Never dated before
                # the sample it replaces: a series' newest arrival only moves on; see Layout.)
                now = max(now, samples[-1][0])
                samples.clear()
            series.last_start = max(series.last_start, start_ns)
        if not samples and duration > 0:
            zero_at = exported - duration if exported else 0.0
            samples.append((now - duration, like(values, (0.0 for _ in values)), zero_at))
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

    def changed(self, now: float) -> tuple[dict[str, tuple[float, EndpointTelemetry]], set[str]]:
        """(every endpoint that reported since the last call: (when its telemetry was read, as
        read then), the endpoints forgotten since): what a telemetry shard sends the control
        plane. Needs ``track_changes``, which windows an endpoint when its report is stored:
        its ages are as of then (its stale flag as of ``now``)."""
        with self._lock:
            self._forget(now)
            dirty, self._dirty = self._dirty, set()
            forgotten, self._forgotten = self._forgotten, set()
            out = {}
            stale_after = self.stale_after_intervals
            for key in dirty:
                e = self._endpoints[key]
                if e.computed is None:
                    e.computed = (now, self._telemetry(key, e, now))
                elif e.computed[0] < now:
                    e.computed = read_computed(e.computed, now, False, stale_after)[0]
                out[key] = e.computed
            return out, forgotten

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
                    s = copy_since(s, -math.inf if since is None else since)
                if s.samples:  # else nothing arrived since
                    versions = out.setdefault(key, (e.last_seen, {}))[1]
                    pair = versions.setdefault(labels.get("version", ""), ([], []))
                    pair[index].append((labels, s))
        return out

    def _telemetry(self, key: str, e: _Endpoint, now: float) -> EndpointTelemetry:
        layout = e.layout
        cutoff = e.last_seen - self.window_s
        if layout is None or not layout.holds(e.shape, cutoff):
            layout = e.layout = Layout(e.series, e.shape, cutoff)
        window = self.window_s
        age = now - e.last_seen
        p50, p99 = percentiles_ms(layout.durations, (0.5, 0.99), now, window)
        qps = rate(layout.requests, now, window)
        fields: dict[str, Any] = {name: gauge_sum(s, now) for name, s in layout.gauges}
        draining = gauge_sum(layout.draining, now)
        errors = error_rate(layout.requests, now, window)
        abandoned = abandoned_rate(layout.requests, now, window)
        if layout.single:  # the usual server: its model's figures are the endpoint's
            models: tuple[ModelTelemetry, ...] = (
                made(ModelTelemetry, model=layout.models[0], p99_ms=p99, qps=qps,
                     error_rate=errors, abandoned_rate=abandoned),
            )  # fmt: skip
        else:
            models = tuple(
                made(
                    ModelTelemetry,
                    model=model,
                    p99_ms=percentiles_ms(durations, (0.99,), now, window)[0],
                    qps=rate(requests, now, window),
                    error_rate=error_rate(requests, now, window),
                    abandoned_rate=abandoned_rate(requests, now, window),
                )
                for model, durations, requests in layout.by_model
            )
        return made(
            EndpointTelemetry,
            endpoint=key,
            age_s=age,
            interval_s=e.interval_s,
            stale=is_stale(age, e.interval_s, self.stale_after_intervals),
            p50_ms=p50,
            p99_ms=p99,
            qps=qps,
            error_rate=errors,
            abandoned_rate=abandoned,
            prefix_cache_hit_rate=share(*layout.prefix, now, window) if layout.prefix[1] else None,
            memory_source=layout.memory_source,
            draining=None if draining is None else Flag(draining.value > 0, draining.age_s),
            models=models,
            series=len(e.series),
            dropped_series=e.dropped_series,
            labels=server_labels(layout.labels) if layout.labels else (),
            **fields,
        )
