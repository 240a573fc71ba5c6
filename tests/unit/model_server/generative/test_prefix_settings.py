"""Prefix caching's switch (the config.pbtxt parameter), its metrics, how its counters reach
the control plane over the model server's OTLP export (GET /telemetry's
``prefix_cache_hit_rate``), and how new sequences are grouped for one prefill run."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from tritonclient.grpc import model_config_pb2

from control_plane.telemetry.store import TelemetryStore
from control_plane.telemetry.values import telemetry_document
from model_server.generative.kv_cache import KvCache, KvShape
from model_server.generative.prefill import prefill_groups, prefill_inputs
from model_server.generative.text import engine_settings, generation_observer, prefix_caching
from model_server.observability.metrics import ServerMetrics
from model_server.observability.telemetry import build_request

SHAPE = KvShape(layers=1, heads=1, head_dim=2, block_tokens=4, total_blocks=4)


def config(**parameters: str) -> model_config_pb2.ModelConfig:
    c = model_config_pb2.ModelConfig(name="lm")
    for key, value in parameters.items():
        c.parameters[key].string_value = value
    return c


def test_prefix_caching_is_on_unless_the_config_turns_it_off() -> None:
    assert prefix_caching(config()) is True
    assert prefix_caching(config(prefix_caching="false")) is False
    assert prefix_caching(config(prefix_caching=" Off ")) is False
    assert prefix_caching(config(prefix_caching="true")) is True
    with pytest.raises(ValueError, match=r"parameters\['prefix_caching'\]: expected true or"):
        engine_settings(config(prefix_caching="sometimes"))  # fails the load, named
    assert engine_settings(config(max_prefill_sequences="8"))[0]["max_prefill_sequences"] == 8
    # A cache that cannot hold one whole context: every long request would be refused as
    # "retry later" (429) for ever, and chat without max_tokens asks for the whole context.
    with pytest.raises(ValueError, match=r"kv_cache_blocks.*16 blocks of 16 tokens hold 256"):
        engine_settings(config(kv_cache_blocks="16"))
    assert engine_settings(config(kv_cache_blocks="32"))[0]["kv_cache_blocks"] == 32  # 512


def fill(cache: KvCache, name: str, tokens: list[int]) -> None:
    cached = cache.admit(name, tokens, len(tokens) + 1)
    n = len(tokens) - cached
    data = [np.zeros((1, n, 2), np.float32)]
    cache.append(name, data, data, tokens[cached:])


def test_hits_lookups_and_evictions_reach_the_control_plane() -> None:
    metrics = ServerMetrics(CollectorRegistry())
    cache = KvCache(SHAPE, observe=generation_observer(metrics, "lm"))
    store = TelemetryStore(window_s=10)
    store.ingest(build_request(metrics.registry, "10.0.0.1:1"), received_at=99.0)  # all 0
    fill(cache, "a", [1] * 9)  # 9 looked up, none cached; 2 full blocks keyed
    store.ingest(build_request(metrics.registry, "10.0.0.1:1"), received_at=100.0)
    cache.release("a")
    fill(cache, "b", [1] * 8 + [2])  # 9 looked up, 8 from the cache
    cache.release("b")  # its 2 full blocks stay cached
    fill(cache, "c", [3] * 9)  # 3 blocks: the 2 free ones, then the oldest cached one
    store.ingest(build_request(metrics.registry, "10.0.0.1:1"), received_at=101.0)

    def value(name: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"model": "lm"})

    assert value("prefix_cache_hit_tokens_total") == 8
    assert value("prefix_cache_lookup_tokens_total") == 27
    assert value("prefix_cache_prefill_saved_ratio") is None  # set by publish_engine only
    assert cache.stats.evictions == value("prefix_cache_evictions_total") == 1
    seen = store.snapshot(101.0)["10.0.0.1:1"].prefix_cache_hit_rate
    assert seen is not None and seen.value == pytest.approx(8 / 27)  # over the window
    document = telemetry_document(store.snapshot(101.0), 10, 3)
    assert document["endpoints"]["10.0.0.1:1"]["prefix_cache_hit_rate"]["value"] == seen.value


def test_decode_steps_are_counted_by_where_their_past_came_from() -> None:
    metrics = ServerMetrics(CollectorRegistry())
    observe = generation_observer(metrics, "lm")
    for what in ("decode_step_carried", "decode_step_carried", "decode_step_gathered"):
        observe(what, 1.0)

    def steps(past: str) -> float | None:
        labels = {"model": "lm", "past": past}
        return metrics.registry.get_sample_value("generation_decode_steps_total", labels)

    assert (steps("carried"), steps("gathered")) == (2, 1)


def test_a_server_without_prefix_counters_reads_none() -> None:
    store = TelemetryStore(window_s=10)
    store.ingest(build_request(ServerMetrics(CollectorRegistry()).registry, "e:1"), 100.0)
    assert store.snapshot(100.0)["e:1"].prefix_cache_hit_rate is None


def test_prefills_group_rows_of_like_length() -> None:
    assert prefill_groups([5, 7, 6, 400, 390], max_rows=8) == [[0, 2, 1], [4, 3]]
    assert prefill_groups([5, 7, 6], max_rows=2) == [[0, 2], [1]]
    assert prefill_groups([3, 300], max_rows=8) == [[0], [1]]  # padding a 3 to 300: no
    assert prefill_groups([1000, 1000, 1000, 1000, 1000], max_rows=8) == [[0, 1, 2, 3], [4]]


def test_prefill_inputs_left_pad_past_and_new_tokens_and_continue_positions() -> None:
    ids, mask, positions = prefill_inputs([[7, 8], [9]], cached=[1, 3], past_length=3)
    assert ids.tolist() == [[7, 8], [0, 9]]
    assert mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 0, 1]]
    assert positions.tolist() == [[1, 2], [0, 3]]
