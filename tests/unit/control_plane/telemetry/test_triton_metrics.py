"""Triton's Prometheus metrics -> our Points, checked through a real TelemetryStore (no network)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

import pytest

from control_plane.telemetry.store import TelemetryStore
from control_plane.telemetry.triton import TritonMapper, TritonScrape, bucket_shares
from control_plane.telemetry.values import EndpointTelemetry, Signal
from tests.triton_metrics_support import family, requests

EP = "10.0.0.7:8001"
T0_NS = 1_700_000_000 * 10**9
SAMPLE = Path(__file__).resolve().parents[3] / "data" / "triton_metrics_sample.txt"


def feed(
    texts: Sequence[str], interval_s: float = 1.0
) -> tuple[EndpointTelemetry, list[TritonScrape]]:
    """Each text scraped ``interval_s`` apart by one mapper into one store, read at the end."""
    store, mapper, scrapes = TelemetryStore(window_s=10.0), TritonMapper(EP), []
    for i, text in enumerate(texts):
        scrape = mapper.scrape(text, T0_NS + int(i * interval_s * 1e9))
        store.ingest_points(scrape.points, scrape.ignored, scrape.errors, 100.0 + i * interval_s)
        scrapes.append(scrape)
    return store.snapshot(100.0 + (len(texts) - 1) * interval_s)[EP], scrapes


def value(signal: Signal | None) -> float:
    assert signal is not None
    return signal.value


# -- latency -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("scrapes", "p50_ms", "p99_ms"),
    [
        # one interval: 100 requests averaging 4.2 ms -> all in the (4, 4.5] ms bucket
        ([(100, 500_000), (200, 500_000 + 100 * 4_200)], (4.0, 4.5), (4.0, 4.5)),
        # 98 fast requests, then 2 slow ones: P99 is the slow interval's mean, P50 the fast one's
        ([(0, 0), (98, 98 * 2_100), (100, 98 * 2_100 + 2 * 48_000)], (2.0, 2.3), (45.0, 50.0)),
        # 1000 at 1 ms then 5 at 100 ms: the slow interval holds < 1%, so P99 stays fast
        ([(0, 0), (1000, 1_000_000), (1005, 1_500_000)], (0.9, 1.0), (0.9, 1.0)),
    ],
    ids=["one-interval", "slow-interval-is-p99", "slow-interval-under-1pct"],
)
def test_latency_is_placed_at_each_interval_mean(
    scrapes: list[tuple[float, float]],
    p50_ms: tuple[float, float],
    p99_ms: tuple[float, float],
) -> None:
    t, _ = feed([requests(n, us) for n, us in scrapes])
    assert p50_ms[0] <= value(t.p50_ms) <= p50_ms[1]
    assert p99_ms[0] <= value(t.p99_ms) <= p99_ms[1]


def test_first_scrape_is_only_a_baseline() -> None:
    t, [scrape] = feed([requests(5000, 5000 * 3_000, failure=50)])
    assert t.p99_ms is None and t.qps is None and t.error_rate is None
    counts = {p.attrs: p.values[0] for p in scrape.points if p.name == "inference_requests"}
    assert set(counts.values()) == {0.0}  # what Triton counted before is not dated


def test_summary_quantiles_spread_the_interval() -> None:
    quantiles: dict[str, float | str] = {"0.5": 2_000, "0.9": 5_000, "0.99": 20_000, "0.999": "NaN"}
    summary = family(
        "nv_inference_request_summary_us",
        "summary",
        *(({"model": "m", "version": "1", "quantile": q}, v) for q, v in quantiles.items()),
    )
    t, _ = feed([requests(0, 0), requests(1000, 1000 * 3_000) + summary])
    assert 1.75 <= value(t.p50_ms) <= 2.0  # Triton's P50, not the 3 ms mean
    assert 17.5 <= value(t.p99_ms) <= 20.0  # Triton's P99


def test_bucket_shares_fall_back_to_the_mean() -> None:
    assert bucket_shares(10, 0.004, {}) == [(0.004, 10)]
    assert bucket_shares(10, None, {}) == []
    shares = bucket_shares(100, 0.004, {0.5: 1000.0, 0.99: 9000.0})
    assert shares == [(0.001, 50.0), (0.009, 50.0)]  # the top quantile takes the rest


def test_triton_restart_gives_no_negative_or_absurd_latency() -> None:
    t, scrapes = feed(
        [
            requests(1000, 1000 * 5_000),
            requests(1100, 1100 * 5_000),  # +100 at 5 ms
            requests(10, 10 * 5_000),  # restarted: 10 since, at 5 ms
            requests(30, 30 * 5_000),  # +20 at 5 ms
        ]
    )
    assert 4.5 <= value(t.p50_ms) <= 5.0 and 4.5 <= value(t.p99_ms) <= 5.0
    assert value(t.qps) == pytest.approx(130 / 3)
    ok = [p.values[0] for s in scrapes for p in s.points if ("code", "OK") in p.attrs]
    assert ok == [0, 100, 110, 130]  # re-based: never goes down
    buckets = [sum(p.values) for s in scrapes for p in s.points if p.kind == "histogram"]
    assert buckets == [0, 100, 110, 130] and all(math.isfinite(b) for b in buckets)


def test_duration_counter_appearing_late_is_not_a_zero_latency() -> None:
    success_only = family("nv_inference_request_success", "counter", ({"model": "m"}, 10))
    t, _ = feed([success_only, requests(20, 0, model="m", version="")])
    assert t.p99_ms is None  # no duration baseline yet: no observation rather than 0 ms


# -- requests and errors -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("failures", "error_rate"), [(0, 0.0), (10, 0.1), (100, 1.0)], ids=["none", "10pct", "all"]
)
def test_success_and_failure_give_qps_and_error_rate(failures: int, error_rate: float) -> None:
    ok = 100 - failures
    t, _ = feed([requests(0, 0), requests(ok, ok * 1_000, failure=failures)], interval_s=2.0)
    assert value(t.error_rate) == pytest.approx(error_rate)
    assert value(t.qps) == pytest.approx(50.0)  # 100 answers in 2 s, failures included
    if ok:  # Triton times only successes: dividing by all answers would say < 1 ms
        assert 0.9 < value(t.p50_ms) <= value(t.p99_ms) <= 1.0
    else:
        assert t.p99_ms is None


def test_versions_are_separate_series() -> None:
    def two_versions(n1: float, n2: float) -> str:
        v1, v2 = {"model": "m", "version": "1"}, {"model": "m", "version": "2"}
        return family("nv_inference_request_success", "counter", (v1, n1), (v2, n2)) + family(
            "nv_inference_request_duration_us", "counter", (v1, n1 * 1_000), (v2, n2 * 9_000)
        )

    t, [_, scrape] = feed([two_versions(0, 0), two_versions(90, 10)])
    versions = {dict(p.attrs)["version"] for p in scrape.points if p.kind == "histogram"}
    assert versions == {"1", "2"}
    assert [m.model for m in t.models] == ["m"]
    assert 0.9 <= value(t.p50_ms) <= 1.0 and 8.5 <= value(t.p99_ms) <= 10.0


# -- gauges ------------------------------------------------------------------------------------
def test_pending_requests_are_the_queue_summed_over_versions() -> None:
    pending = family(
        "nv_inference_pending_request_count",
        "gauge",
        ({"model": "a", "version": "1"}, 3),
        ({"model": "a", "version": "2"}, 4),
        ({"model": "b", "version": "1"}, 5),
    )
    t, [scrape] = feed([pending])
    assert value(t.queue_depth) == 12
    queues = {p.attrs: p.values[0] for p in scrape.points if p.name == "inference_queue_depth"}
    assert queues == {(("model", "a"),): 7.0, (("model", "b"),): 5.0}


GPU = family(
    "nv_gpu_memory_used_bytes", "gauge", ({"gpu_uuid": "GPU-a"}, 3e9), ({"gpu_uuid": "GPU-b"}, 1e9)
) + family(
    "nv_gpu_memory_total_bytes", "gauge", ({"gpu_uuid": "GPU-a"}, 8e9), ({"gpu_uuid": "GPU-b"}, 8e9)
)
CPU = family("nv_cpu_memory_used_bytes", "gauge", ({}, 6e9)) + family(
    "nv_cpu_memory_total_bytes", "gauge", ({}, 32e9)
)


@pytest.mark.parametrize("text", [GPU + CPU, GPU], ids=["gpu-and-cpu", "gpu-only"])
def test_gpu_memory(text: str) -> None:
    t, [scrape] = feed([text])
    assert t.memory_source == "nvml"
    assert value(t.memory_used_bytes) == 4e9 and value(t.memory_total_bytes) == 16e9
    sources = {dict(p.attrs)["source"] for p in scrape.points if "memory" in p.name}
    assert sources == {"nvml"}  # host memory is not sent beside the GPUs'


def test_host_memory_is_not_a_memory_signal() -> None:
    """The whole host's RAM (which other processes fill) is no budget of the server's: a
    CPU-only Triton has no memory signal, so the memory scorer drops out for it."""
    scrape = TritonMapper(EP).scrape(CPU, T0_NS)
    assert not [p for p in scrape.points if "memory" in p.name]
    assert scrape.ignored.get("unknown_metric", 0) >= 2 and not scrape.errors


@pytest.mark.parametrize("labels", [{"model": "llm", "version": "1"}, {}], ids=["model", "none"])
def test_kv_cache_blocks(labels: dict[str, str]) -> None:
    kv = family(
        "nv_trt_llm_kv_cache_block_metrics",
        "gauge",
        *(({**labels, "kv_cache_block_type": k}, v) for k, v in
          {"tokens_per": 64, "used": 100, "free": 6139, "max": 6239}.items()),
    )  # fmt: skip
    t, [scrape] = feed([kv])
    assert value(t.kv_blocks_used) == 100 and value(t.kv_blocks_total) == 6239
    models = {dict(p.attrs)["model"] for p in scrape.points if p.name.startswith("kv_cache")}
    assert models == {labels.get("model", "")}
    assert scrape.ignored == {"unknown_metric": 2}  # free, tokens_per


def test_tensorrt_llm_waiting_and_active_requests() -> None:
    trt = family(
        "nv_trt_llm_request_metrics",
        "gauge",
        *(({"model": "llm", "version": "1", "request_type": k}, v) for k, v in
          {"waiting": 6, "active": 9, "max": 512, "scheduled": 9, "context": 1}.items()),
    )  # fmt: skip
    pending = family("nv_inference_pending_request_count", "gauge", ({"model": "llm"}, 1))
    t, _ = feed([trt + pending])
    assert value(t.queue_depth) == 7 and value(t.in_flight) == 9


# -- what is not used, and what is broken ------------------------------------------------------
def test_unknown_metrics_are_ignored_and_counted() -> None:
    mv = {"model": "m", "version": "1"}
    other = (
        family("nv_inference_count", "counter", (mv, 10))
        + family("nv_inference_queue_duration_us", "counter", (mv, 10))
        + family("nv_gpu_utilization", "gauge", ({"gpu_uuid": "GPU-a"}, 0.5))
        + "some_untyped_metric 1\n"
    )
    store, mapper = TelemetryStore(), TritonMapper(EP)
    scrape = mapper.scrape(other + requests(1, 1), T0_NS)
    assert scrape.ignored == {"unknown_metric": 4} and scrape.errors == ()
    result = store.ingest_points(scrape.points, scrape.ignored, scrape.errors, 1.0)
    assert result.points == 3 and result.rejected == 0


@pytest.mark.parametrize(
    ("text", "usable"),
    [
        (requests(5, 5) + 'nv_inference_request_failure{model="m" 3\n', 3),
        (requests(5, 5) + "nv_gpu_memory_used_bytes not-a-number\n", 3),
        ("\x00\xff\xfe binary garbage", 0),
        ('{model="m"} 1\n', 0),
        ('nv_inference_request_success{model="m",version="1"}\n', 0),
    ],
    ids=["cut-line", "bad-value", "binary", "no-name", "no-value"],
)
def test_malformed_text_is_reported_not_raised(text: str, usable: int) -> None:
    scrape = TritonMapper(EP).scrape(text, T0_NS)
    assert scrape.errors and scrape.errors[0].startswith("malformed exposition")
    assert scrape.ignored.get("malformed") == 1
    assert len(scrape.points) == usable  # the families before the bad line still count


def test_nan_values_are_dropped_with_a_message() -> None:
    text = family("nv_inference_pending_request_count", "gauge", ({"model": "m"}, "NaN"))
    scrape = TritonMapper(EP).scrape(text, T0_NS)
    assert scrape.points == () and scrape.ignored == {"nan": 1} and len(scrape.errors) == 1


def test_empty_body_is_no_data() -> None:
    assert TritonMapper(EP).scrape("", T0_NS) == TritonScrape((), {}, ())


@pytest.mark.skipif(not SAMPLE.exists(), reason="no sample from a real tritonserver yet")
def test_real_triton_sample() -> None:
    """tritonserver's own /metrics (CPU host, summaries on), scraped after a baseline with its
    request counters at zero: the 50 requests land at its summary quantiles."""
    text = SAMPLE.read_text()
    scrape = TritonMapper(EP).scrape(text, T0_NS)
    assert scrape.errors == ()
    result = TelemetryStore().ingest_points(scrape.points, scrape.ignored, scrape.errors, 1.0)
    assert result.points == len(scrape.points) and result.rejected == 0

    counters = r"^(nv_inference_request_(success|duration_us)\{[^}]*\}) \S+$"
    baseline = re.sub(counters, r"\1 0", text, flags=re.MULTILINE)
    assert baseline != text
    t, [_, last] = feed([baseline, text])
    names = {p.name for p in last.points}
    assert {"inference_requests", "inference_request_duration_seconds"} <= names
    if "nv_inference_pending_request_count" in text:
        assert t.queue_depth is not None
    if "nv_gpu_memory_used_bytes" not in text:
        assert t.memory_used_bytes is None  # host RAM is not a memory signal
    quantiles = dict(
        re.findall(r'^nv_inference_request_summary_us\{.*quantile="([\d.]+)"\} (\S+)$', text, re.M)
    )
    if "0.5" in quantiles and "0.99" in quantiles:  # within the bucket of Triton's quantiles
        assert value(t.p50_ms) == pytest.approx(float(quantiles["0.5"]) / 1000, rel=0.16)
        assert value(t.p99_ms) == pytest.approx(float(quantiles["0.99"]) / 1000, rel=0.16)
    assert value(t.error_rate) == 0.0 and value(t.qps) > 0
