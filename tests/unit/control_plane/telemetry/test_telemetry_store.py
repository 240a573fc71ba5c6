"""The pure telemetry store: percentiles, rates, resets, staleness, bounds (no network)."""

from __future__ import annotations

import bisect
import json
import math
import random
from collections.abc import Sequence

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.metrics.v1 import metrics_pb2 as m

from control_plane.config.topology import TelemetryOptions, TopologyError, parse_topology
from control_plane.telemetry.series import bucket_quantile
from control_plane.telemetry.store import TelemetryStore
from infermesh.cli import main, telemetry_rows
from tests.otlp_support import BOUNDS, DELTA, EP, counter, gauge, histogram, request


def true_quantile(xs: Sequence[float], q: float) -> float:
    return sorted(xs)[max(0, math.ceil(q * len(xs)) - 1)]


def bucket_of(x: float) -> tuple[float, float]:
    i = bisect.bisect_left(BOUNDS, x)
    return (BOUNDS[i - 1] if i else 0.0), (BOUNDS[i] if i < len(BOUNDS) else BOUNDS[-1])


@pytest.mark.parametrize(
    ("bounds", "counts", "q", "expected"),
    [
        ((1.0, 2.0), (0, 10, 0), 0.5, 1.5),  # halfway through (1, 2]
        ((1.0, 2.0), (10, 0, 0), 0.99, 0.99),  # first bucket starts at 0
        ((1.0, 2.0), (0, 0, 5), 0.99, 2.0),  # +Inf gives the last bound
        ((1.0, 2.0, 4.0), (2, 0, 2, 0), 0.5, 1.0),  # the rank ends the first bucket
    ],
)
def test_bucket_quantile_table(
    bounds: tuple[float, ...], counts: tuple[float, ...], q: float, expected: float
) -> None:
    assert bucket_quantile(bounds, counts, q) == pytest.approx(expected)
    assert math.isnan(bucket_quantile(bounds, (0,) * len(counts), q))


latency_lists = st.lists(st.floats(min_value=0.0002, max_value=20.0), min_size=1, max_size=300)


@settings(max_examples=60, deadline=None)
@given(before=latency_lists, during=latency_lists)
def test_p99_from_cumulative_within_bucket_resolution(
    before: list[float], during: list[float]
) -> None:
    store = TelemetryStore(window_s=10)
    store.ingest(request([histogram(before, 100.0)]), received_at=1000.0)
    store.ingest(request([histogram(before + during, 120.0)]), received_at=1010.0)
    # the window ending at the newest sample starts at the older one: only `during` counts
    for q, name in ((0.99, "p99_ms"), (0.5, "p50_ms")):
        got = getattr(store.snapshot(1011.0)[EP], name)
        assert got is not None and got.age_s == pytest.approx(1.0)
        lo, hi = bucket_of(true_quantile(during, q))
        assert lo * 1000 - 1e-9 <= got.value <= hi * 1000 + 1e-9, (q, lo, hi, got)


@settings(max_examples=40, deadline=None)
@given(rounds=st.lists(latency_lists, min_size=2, max_size=5))
def test_delta_temporality_gives_the_same(rounds: list[list[float]]) -> None:
    cumulative, delta = TelemetryStore(), TelemetryStore()
    seen: list[float] = []
    for i, batch in enumerate(rounds):
        seen += batch
        t = 10.0 + i
        cumulative.ingest(
            request([histogram(seen, t, start_s=9), counter(len(seen), t, start_s=9)]),
            received_at=t,
        )
        delta.ingest(
            request(
                [
                    histogram(batch, t, DELTA, start_s=t - 1),
                    counter(len(batch), t, temporality=DELTA, start_s=t - 1),
                ]
            ),
            received_at=t,
        )
    now = 10.0 + len(rounds)
    a, b = cumulative.snapshot(now)[EP], delta.snapshot(now)[EP]
    assert a.p99_ms is not None and b.p99_ms is not None and a.qps is not None and b.qps
    # both start from a zero one second before their first point
    assert a == b
    assert b.qps.value == pytest.approx(len(seen) / len(rounds))
    lo, hi = bucket_of(true_quantile(seen, 0.99))
    assert lo * 1000 - 1e-9 <= b.p99_ms.value <= hi * 1000 + 1e-9


def test_qps_error_rate_and_models() -> None:
    store = TelemetryStore(window_s=10)
    for i in range(6):
        t = 100.0 + 2 * i
        metrics = [counter(50.0 * i, t, "OK"), counter(10.0 * i, t, "UNAVAILABLE")]
        store.ingest(request(metrics), received_at=t)
    e = store.snapshot(111.0)[EP]
    assert e.qps is not None and e.qps.value == pytest.approx(30.0)  # 300 requests in 10 s
    assert e.error_rate is not None and e.error_rate.value == pytest.approx(1 / 6)
    assert e.qps.age_s == pytest.approx(1.0)
    assert [(x.model, x.qps.value if x.qps else None) for x in e.models] == [
        ("m", pytest.approx(30.0))
    ]


@pytest.mark.parametrize(
    "mistake", ["INVALID_ARGUMENT", "PERMISSION_DENIED", "NOT_FOUND", "UNAUTHENTICATED", "400"]
)
def test_the_callers_mistakes_are_not_the_servers_errors(mistake: str) -> None:
    """A client sending malformed requests (with session affinity, all to one server) made
    that server's error rate 0.9 here, past the ejection threshold, on the code before."""
    store = TelemetryStore(window_s=10)
    for i in range(6):
        t = 100.0 + 2 * i
        metrics = [counter(10.0 * i, t, "OK"), counter(90.0 * i, t, mistake),
                   counter(1.0 * i, t, "INTERNAL")]  # fmt: skip
        store.ingest(request(metrics), received_at=t)
    e = store.snapshot(111.0)[EP]
    assert e.error_rate is not None and e.error_rate.value == pytest.approx(1 / 11)


@pytest.mark.parametrize("code", ["UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED",
                                  "429", "503", "error"])  # fmt: skip
def test_a_server_that_is_down_slow_or_full_has_errors(code: str) -> None:
    store = TelemetryStore(window_s=10)
    for i in range(6):
        t = 100.0 + 2 * i
        store.ingest(
            request([counter(10.0 * i, t, "OK"), counter(10.0 * i, t, code)]), received_at=t
        )
    e = store.snapshot(111.0)[EP]
    assert e.error_rate is not None and e.error_rate.value == pytest.approx(0.5)


def test_each_model_has_its_own_error_rate() -> None:
    """One model failing on a server with two: before, every pool of the server read the
    server's error rate (0.45 here), so the healthy model's pool could eject it too."""
    store = TelemetryStore(window_s=10)
    for i in range(6):
        t = 100.0 + 2 * i
        metrics = [counter(10.0 * i, t, model="good"), counter(1.0 * i, t, model="broken"),
                   counter(9.0 * i, t, "INTERNAL", model="broken")]  # fmt: skip
        store.ingest(request(metrics), received_at=t)
    e = store.snapshot(111.0)[EP]
    assert e.error_rate is not None and e.error_rate.value == pytest.approx(0.45)
    rates = {x.model: x.error_rate.value if x.error_rate else None for x in e.models}
    assert rates == {"good": 0.0, "broken": pytest.approx(0.9)}


def test_a_model_that_stops_reporting_leaves_and_one_that_comes_back_counts_again() -> None:
    """The store keeps which series feed which signal from one report to the next: a series
    going quiet, coming back or appearing must still change what is read."""
    store = TelemetryStore(window_s=10)

    def report(t: float, models: Sequence[str], n: float) -> None:
        metrics = []
        for model in models:
            c = counter(n, t)
            c.sum.data_points[0].attributes[0].value.string_value = model
            metrics.append(c)
        store.ingest(request(metrics), received_at=t)

    for t in range(5):
        report(float(t), ["m", "n"], 10.0 * t)
    assert [x.model for x in store.snapshot(4.0)[EP].models] == ["m", "n"]
    for t in range(5, 17):  # n is unloaded: it drops out once quiet for the window
        report(float(t), ["m"], 10.0 * t)
    e = store.snapshot(16.0)[EP]
    assert [x.model for x in e.models] == ["m"]
    assert e.qps is not None and e.qps.value == pytest.approx(10.0)
    report(17.0, ["m", "n"], 170.0)  # n is back, its counter where m's is
    e = store.snapshot(17.0)[EP]
    assert [x.model for x in e.models] == ["m", "n"]
    report(18.0, ["m", "n", "o"], 180.0)  # and a third appears
    e = store.snapshot(18.0)[EP]
    assert [x.model for x in e.models] == ["m", "n", "o"]
    assert e.qps is not None and e.qps.value > 10.0


def test_a_histogram_going_back_restarts_its_window() -> None:
    """With a start time, a restart comes with a new one, and the total going down is the
    safety net; without one, any bucket going down is a restart."""
    slow, fast = [2.0] * 100, [0.005] * 100
    kept = TelemetryStore(window_s=10)
    for t, latencies in ((0.0, slow), (1.0, slow + fast), (2.0, fast[:50]), (3.0, fast[:80])):
        kept.ingest(request([histogram(latencies, 100 + t, start_s=50)]), received_at=t)
    p99 = kept.snapshot(3.0)[EP].p99_ms  # the total went down at 2: counted from there
    assert p99 is not None and 0 < p99.value < 10  # the 30 fast ones since
    unknown_start = TelemetryStore(window_s=10)
    rounds = (
        (0.0, slow),
        (1.0, slow + fast),
        (2.0, slow[:10] + fast * 2),
        (3.0, slow[:20] + fast * 2),
    )
    for t, latencies in rounds:  # at 2 the total goes up, the slow bucket down
        point = histogram(latencies, t)
        point.histogram.data_points[0].start_time_unix_nano = 0
        unknown_start.ingest(request([point]), received_at=t)
    p99 = unknown_start.snapshot(3.0)[EP].p99_ms
    assert p99 is not None and p99.value > 1000  # the 10 slow ones since the restart


def test_version_stats_merge_every_endpoint() -> None:
    """A canary is judged on one version across the pool: histograms merge before the P99."""
    store = TelemetryStore(window_s=10)
    fast, slow = [0.004] * 50, [0.09] * 50
    for t, n in ((100.0, 0), (102.0, 1)):
        a = [histogram(fast * n, t, version="2"), histogram([0.01] * 99 * n, t, version="1"),
             counter(45.0 * n, t, version="2"), counter(5.0 * n, t, "INTERNAL", version="2"),
             counter(99.0 * n, t, version="1")]  # fmt: skip
        b = [histogram(slow * n, t, version="2"), counter(50.0 * n, t, version="2")]
        store.ingest(request(a, "10.0.0.1:1"), received_at=t)
        store.ingest(request(b, "10.0.0.2:1"), received_at=t)
    stats = store.version_stats("m", 103.0)
    assert set(stats) == {"1", "2"}
    v2 = stats["2"]
    assert v2.requests == pytest.approx(100)
    assert v2.error_rate is not None and v2.error_rate.value == pytest.approx(0.05)
    assert v2.p99_ms is not None and 75 <= v2.p99_ms.value <= 100  # the slow endpoint's tail
    assert stats["1"].p99_ms is not None and stats["1"].p99_ms.value <= 10
    assert store.version_stats("other", 103.0) == {}
    # Only what arrived after 101: the counters were zero before it, so all of it.
    since = store.version_stats("m", 103.0, since=101.0)
    assert since["2"].requests == pytest.approx(100)
    assert store.version_stats("m", 103.0, since=102.5) == {}  # nothing arrived since


def test_version_stats_since_count_a_series_first_seen_after_it() -> None:
    """A version's first errors make a new series after a canary started: they count at its
    first report (its zero dated at the exporter's start is the baseline), not its second."""
    store = TelemetryStore(window_s=10)
    store.ingest(request([counter(100.0, 100.0, version="2")]), received_at=100.0)
    store.ingest(request([counter(110.0, 101.0, version="2")]), received_at=101.0)
    errors = counter(10.0, 102.0, "UNAVAILABLE", version="2")
    store.ingest(request([counter(120.0, 102.0, version="2"), errors]), received_at=102.0)
    store.ingest(request([counter(130.0, 103.0, version="2"), counter(20.0, 103.0, "UNAVAILABLE",
                 version="2")]), received_at=103.0)  # fmt: skip
    stats = store.version_stats("m", 103.5, since=101.5)["2"]
    # OK: 120 -> 130 (its report at 102 is the baseline); errors: 0 -> 20 from their first
    assert stats.requests == pytest.approx(30)
    assert stats.error_rate is not None and stats.error_rate.value == pytest.approx(20 / 30)
    # What a version reported before the canary started never counts, errors included.
    later = store.version_stats("m", 103.5, since=102.5)["2"]
    assert later.requests == 0


def test_rates_use_the_exporters_timestamps_not_arrivals() -> None:
    """An exporter whose clock is 1,000 s off reports 100 requests a second; its exports
    arrive 0-0.5 s late. The rate is measured over its own timestamps (differences within one
    series: the skew cancels), so the receiver's queueing does not move it; a clock step
    (a span far from the arrivals') falls back to arrival times."""
    store = TelemetryStore(window_s=10)
    for i, late in enumerate([0.0, 0.5, 0.1, 0.4, 0.0, 0.3]):
        body = [counter(100.0 * (i + 1), 1000.0 + i, start_s=999.0)]
        store.ingest(request(body), received_at=10.0 + i + late)
    qps = store.snapshot(16.0)[EP].qps
    assert qps is not None and qps.value == pytest.approx(100.0)
    # By arrival times it would have been 600 requests over 6.3 s.
    stepped = TelemetryStore(window_s=10)
    for i, exported in enumerate([1000.0, 1001.0, 1002.0, 4600.0]):  # NTP stepped the clock
        body = [counter(100.0 * (i + 1), exported, start_s=999.0)]
        stepped.ingest(request(body), received_at=10.0 + i)
    qps = stepped.snapshot(14.0)[EP].qps
    assert qps is not None and qps.value == pytest.approx(400.0 / 4.0)  # zero at 9 -> 13


def test_counter_reset_restarts_the_window() -> None:
    store = TelemetryStore(window_s=10)
    for t, value in ((0.0, 100.0), (1.0, 200.0), (2.0, 300.0)):
        store.ingest(request([counter(value, 100 + t, start_s=50)]), received_at=t)
    qps = store.snapshot(2.0)[EP].qps
    assert qps is not None and qps.value == pytest.approx(100.0)
    # the server restarted 1 s ago: its counter starts again from 0
    store.ingest(request([counter(20.0, 103.0, start_s=102.0)]), received_at=3.0)
    qps = store.snapshot(3.0)[EP].qps
    assert qps is not None and qps.value == pytest.approx(20.0)
    store.ingest(request([counter(50.0, 104.0, start_s=102.0)]), received_at=4.0)
    qps = store.snapshot(4.0)[EP].qps
    assert qps is not None and qps.value == pytest.approx(25.0)  # 50 in 2 s, never negative


def test_an_older_export_arriving_late_is_not_a_reset() -> None:
    """A retried export of the same run (same start time, an older exporter time) arriving
    after a newer one is superseded, not read as a counter reset."""
    store = TelemetryStore(window_s=10)
    slow = [0.005] * 100 + [2.0] * 10
    for t, value, latencies in ((0.0, 100.0, [0.005] * 100), (1.0, 200.0, slow)):
        body = [counter(value, 100 + t, start_s=50), histogram(latencies, 100 + t, start_s=50)]
        store.ingest(request(body), received_at=t)
    before = store.snapshot(1.5)[EP]
    assert before.p99_ms is not None and before.p99_ms.value > 1000  # the slow requests
    late = [counter(100.0, 100.0, start_s=50), histogram([0.005] * 100, 100.0, start_s=50)]
    store.ingest(request(late), received_at=1.2)
    after = store.snapshot(1.5)[EP]
    assert after.qps == before.qps and after.p99_ms == before.p99_ms
    # The next export of the run counts from the window kept.
    store.ingest(request([counter(300.0, 102.0, start_s=50)]), received_at=2.0)
    qps = store.snapshot(2.0)[EP].qps
    assert qps is not None and qps.value == pytest.approx(100.0)


def test_counter_going_down_without_start_time_is_a_reset() -> None:
    store = TelemetryStore()
    for t, value in ((0.0, 100.0), (1.0, 200.0), (2.0, 5.0), (3.0, 15.0)):
        point = counter(value, t)
        point.sum.data_points[0].start_time_unix_nano = 0  # unknown start
        store.ingest(request([point]), received_at=t)
    qps = store.snapshot(3.0)[EP].qps
    assert qps is not None and qps.value == pytest.approx(10.0)


def test_staleness_after_n_observed_intervals() -> None:
    store = TelemetryStore(stale_after_intervals=3)
    for i in range(30):
        store.ingest(request([gauge("inference_in_flight_requests", 1)]), received_at=2.0 * i)
    last = 58.0
    e = store.snapshot(last + 5.0)[EP]
    assert e.interval_s == pytest.approx(2.0, rel=0.01) and not e.stale
    e = store.snapshot(last + 6.5)[EP]
    assert e.stale and e.age_s == pytest.approx(6.5)
    assert e.in_flight is not None and e.in_flight.age_s == pytest.approx(6.5)  # still shown


def test_the_routing_read_keeps_unchanged_telemetry_and_flags_staleness() -> None:
    """``snapshot(now, ages=False)``: no new data -> the same object (routing reads no age and
    keeps the signals it made from it); staleness still comes at its time; new data -> new."""
    store = TelemetryStore(stale_after_intervals=3)
    for i in range(30):
        store.ingest(request([gauge("inference_in_flight_requests", 1)]), received_at=2.0 * i)
    first = store.snapshot(58.5, ages=False)[EP]
    again = store.snapshot(60.0, ages=False)[EP]
    assert again is first and not again.stale
    stale = store.snapshot(64.5, ages=False)[EP]
    assert stale.stale and stale.age_s == pytest.approx(6.5)
    assert store.snapshot(65.0, ages=False)[EP] is stale  # stays stale, not re-made
    aged = store.snapshot(65.0)[EP]  # the full read still ages every signal
    assert aged.in_flight is not None and aged.in_flight.age_s == pytest.approx(7.0)
    store.ingest(request([gauge("inference_in_flight_requests", 2)]), received_at=66.0)
    fresh = store.snapshot(66.5, ages=False)[EP]
    assert not fresh.stale and fresh.in_flight is not None and fresh.in_flight.value == 2


def test_forgetting_and_endpoint_cap() -> None:
    store = TelemetryStore(forget_after_s=300, max_endpoints=2)
    store.ingest(request([gauge("server_draining", 0)], "10.0.0.1:1"), received_at=0.0)
    store.ingest(request([gauge("server_draining", 1)], "10.0.0.2:1"), received_at=100.0)
    result = store.ingest(request([gauge("server_draining", 0)], "10.0.0.3:1"), received_at=200)
    assert dict(result.ignored) == {"endpoint_limit": 1} and result.points == 0
    assert set(store.snapshot(250.0)) == {"10.0.0.1:1", "10.0.0.2:1"}
    assert set(store.snapshot(301.0)) == {"10.0.0.2:1"}  # the first one is forgotten
    draining = store.snapshot(301.0)["10.0.0.2:1"].draining
    assert draining is not None and draining.value is True
    result = store.ingest(request([gauge("server_draining", 0)], "10.0.0.3:1"), received_at=302)
    assert result.points == 1 and len(store) == 2


def test_series_cap() -> None:
    store = TelemetryStore(max_series_per_endpoint=3)
    metrics = [gauge("inference_queue_depth", 1, model=f"m{i}") for i in range(5)]
    result = store.ingest(request(metrics), received_at=1.0)
    assert result.points == 3 and dict(result.ignored) == {"series_limit": 2}
    e = store.snapshot(1.0)[EP]
    assert e.series == 3 and e.dropped_series == 2
    assert e.queue_depth is not None and e.queue_depth.value == 3


def test_gauges_memory_and_ages() -> None:
    store = TelemetryStore()
    store.ingest(
        request(
            [
                gauge("accelerator_memory_used_bytes", 10, device="0", source="nvml"),
                gauge("accelerator_memory_used_bytes", 20, device="1", source="nvml"),
                gauge("accelerator_memory_used_bytes", 5, device="0", source="process"),
                gauge("accelerator_memory_total_bytes", 100, device="0", source="nvml"),
                gauge("accelerator_memory_total_bytes", 100, device="1", source="nvml"),
                gauge("kv_cache_blocks_used", 7, model="m"),
                gauge("kv_cache_blocks_total", 70, model="m"),
                gauge("model_state", 1, model="m", version="1", state="READY"),
            ]
        ),
        received_at=100.0,
    )
    store.ingest(request([gauge("inference_queue_depth", 4, model="m")]), received_at=103.0)
    e = store.snapshot(104.0)[EP]
    assert e.memory_source == "nvml"
    assert e.memory_used_bytes is not None and e.memory_used_bytes.value == 30
    assert e.memory_used_bytes.age_s == pytest.approx(4.0)
    assert e.memory_total_bytes is not None and e.memory_total_bytes.value == 200
    assert e.kv_blocks_used is not None and e.kv_blocks_used.value == 7
    assert e.queue_depth is not None and e.queue_depth.age_s == pytest.approx(1.0)
    assert e.p99_ms is None and e.qps is None and e.draining is None
    body = json.loads(json.dumps(store.as_json(104.0)))
    row = body["endpoints"][EP]
    assert row["memory_used_bytes"] == {"value": 30, "age_s": pytest.approx(4.0)}
    assert row["stale"] is False and body["window_s"] == 10


def test_requests_stored_out_of_order_keep_the_newest_gauge() -> None:
    """Exports are stored by worker threads: one that arrived earlier may be stored later. A
    gauge keeps the value that arrived last, and the series still goes quiet on time."""
    store = TelemetryStore(window_s=10)
    both = [gauge("inference_queue_depth", 4, model="m"), gauge("inference_in_flight_requests", 1)]
    store.ingest(request(both), received_at=5.0)
    assert store.snapshot(6.0)[EP].queue_depth == (4, 1.0)
    store.ingest(request([gauge("inference_queue_depth", 9, model="m")]), received_at=4.0)
    assert store.snapshot(6.0)[EP].queue_depth == (4, 1.0)
    store.ingest(request([gauge("inference_in_flight_requests", 2)]), received_at=15.5)
    e = store.snapshot(16.5)[EP]  # the queue depth, last at 5, has gone quiet
    assert e.queue_depth is None and e.in_flight == (2, 1.0)


def test_bad_points_are_counted_and_skipped() -> None:
    nan = gauge("inference_queue_depth", math.nan, model="m")
    negative = counter(-1.0, 1.0)
    mismatched = histogram([0.01], 1.0)
    mismatched.histogram.data_points[0].bucket_counts.append(1)
    exponential = m.Metric(
        name="inference_request_duration_seconds",
        exponential_histogram=m.ExponentialHistogram(
            data_points=[m.ExponentialHistogramDataPoint()]
        ),
    )
    wrong = gauge("inference_requests", 1.0)
    unknown = gauge("process_cpu_seconds", 1.0)
    store = TelemetryStore(max_points_per_request=7)
    result = store.ingest(
        request([nan, negative, mismatched, exponential, wrong, unknown, gauge("x", 1), nan]),
        received_at=1.0,
    )
    assert dict(result.ignored) == {
        "nan": 1,
        "negative": 1,
        "bucket_mismatch": 1,
        "unsupported_type": 1,
        "wrong_type": 1,
        "unknown_metric": 2,
        "too_many_points": 1,
    }
    assert result.points == 0 and result.rejected == 6 and result.errors
    nobody = store.ingest(request([gauge("server_draining", 0)], None), received_at=1.0)
    assert dict(nobody.ignored) == {"no_instance_id": 1}


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_arbitrary_requests_never_crash(data: bytes) -> None:
    try:
        parsed = ExportMetricsServiceRequest.FromString(data)
    except DecodeError:
        return
    store = TelemetryStore()
    result = store.ingest(parsed, received_at=1.0)
    taken = sum(1 for _ in store.snapshot(1.0))  # and the store still answers
    assert result.points >= 0 and taken >= 0
    assert result.points <= sum(  # never more points than the request holds
        len(m.gauge.data_points) + len(m.sum.data_points) + len(m.histogram.data_points)
        + len(m.exponential_histogram.data_points) + len(m.summary.data_points)
        for rm in parsed.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
    )  # fmt: skip


def test_many_endpoints_random_traffic_stays_bounded() -> None:
    rng = random.Random(7)
    store = TelemetryStore(max_endpoints=50, forget_after_s=30, max_series_per_endpoint=20)
    for i in range(2000):
        ep = f"10.0.{rng.randrange(4)}.{rng.randrange(40)}:8001"
        labels = {"model": f"m{rng.randrange(30)}"}
        store.ingest(request([gauge("inference_queue_depth", i, **labels)], ep), i * 0.1)
    snapshot = store.snapshot(200.0)
    assert 0 < len(snapshot) <= 50 and all(e.series <= 20 for e in snapshot.values())


def test_cli_table_rows_from_as_json() -> None:
    store = TelemetryStore()
    store.ingest(
        request(
            [
                counter(100.0, 11.0, start_s=10.0),
                histogram([0.002] * 10, 11.0, start_s=10.0),
                gauge("accelerator_memory_used_bytes", 2**30, device="0", source="process"),
                gauge("server_draining", 1),
            ]
        ),
        received_at=5.0,
    )
    body = json.loads(json.dumps(store.as_json(20.0)))
    [row] = telemetry_rows(body)
    assert row[0] == EP and "STALE" in row[1] and "DRAINING" in row[1]
    assert row[2] == "100.0" and row[5] == "0.0%" and row[7] == "1.00G/- (process)"
    assert main(["telemetry", "--admin", "127.0.0.1:1"]) == 1  # nothing listens there


def test_topology_telemetry_section() -> None:
    base = {"models": [{"name": "m", "sla_p99_ms": 5, "capacity_qps": 1}]}
    assert parse_topology(base).telemetry == TelemetryOptions()
    options = {"host": "127.0.0.1", "port": 4317, "window_s": 5, "forget_after_s": 60}
    parsed = parse_topology({**base, "telemetry": options}).telemetry
    assert parsed == TelemetryOptions("127.0.0.1", 4317, 5.0, 3.0, 60.0)
    bad = {"port": 0, "window_s": -1, "stale_after_intervals": "x", "colour": 1}
    with pytest.raises(TopologyError) as caught:
        parse_topology({**base, "telemetry": bad})
    assert len(caught.value.errors) == 4
    assert any(e.startswith("telemetry.window_s: must be > 0") for e in caught.value.errors)
