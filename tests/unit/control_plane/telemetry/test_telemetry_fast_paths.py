"""The store's fleet-scale shortcuts give the same answers as the long way round: a read with
no new data only ages the last one, windows are cached per series, checks made once per
metric or per bounds still reject what they rejected per point; and model-state changes in
an endpoint's own telemetry become placement hints."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from opentelemetry.proto.metrics.v1 import metrics_pb2 as m

from control_plane.telemetry.store import TelemetryStore
from control_plane.telemetry.values import Flag, Signal, telemetry_json
from tests.otlp_support import BOUNDS, counter, gauge, histogram, request

EP2 = "127.0.0.1:8002"


def traffic(store: TelemetryStore, rounds: int, seed: int) -> None:
    rng = random.Random(seed)
    latencies: list[float] = []
    served = 0.0
    for t in range(1, rounds + 1):
        latencies += [rng.uniform(0.001, 0.2) for _ in range(rng.randint(0, 40))]
        served += rng.randint(0, 40)
        for endpoint in (None, EP2):
            metrics = [
                histogram(latencies, t),
                counter(served, t),
                gauge("inference_queue_depth", rng.randint(0, 9), model="m"),
                gauge("server_draining", 0),
            ]
            store.ingest(request(metrics, *(() if endpoint is None else (endpoint,))), float(t))


def fresh(store: TelemetryStore, now: float) -> dict[str, object]:
    for endpoint in store._endpoints.values():
        endpoint.computed = None
    return dict(store.snapshot(now))


def test_a_read_without_new_data_equals_computing_it_again() -> None:
    for seed in range(5):
        store = TelemetryStore(window_s=4.0)
        traffic(store, 8, seed)
        first = store.snapshot(8.25)
        for later in (8.25, 8.5, 9.9, 30.0):  # the last one: every endpoint is stale
            aged = store.snapshot(later)
            assert aged == fresh(store, later)
        assert first == fresh(store, 8.25)


def test_new_data_is_not_hidden_by_the_cache() -> None:
    store = TelemetryStore(window_s=4.0)
    traffic(store, 3, 1)
    before = store.snapshot(3.5)["127.0.0.1:8001"]
    store.ingest(request([histogram([5.0] * 1000, 4.0)]), 4.0)  # a burst of 5 s requests
    after = store.snapshot(4.5)["127.0.0.1:8001"]
    assert before.p99_ms is not None and after.p99_ms is not None
    assert after.p99_ms.value > 10 * before.p99_ms.value
    assert after == fresh(store, 4.5)["127.0.0.1:8001"]


def test_bad_bounds_are_rejected_in_every_point_that_has_them() -> None:
    good = histogram([0.01], 1.0)
    bad = histogram([0.01], 1.0, version="2")
    bad.histogram.data_points[0].explicit_bounds[:] = list(reversed(BOUNDS))
    also_bad = histogram([0.02], 1.0, version="3")
    also_bad.histogram.data_points[0].explicit_bounds[:] = list(reversed(BOUNDS))
    result = TelemetryStore().ingest(request([bad, good, also_bad]), 1.0)
    assert result.points == 1
    assert dict(result.ignored) == {"bad_buckets": 2}


def test_a_metric_of_the_wrong_type_is_counted_per_point() -> None:
    wrong = gauge("inference_requests", 1.0, code="OK")
    wrong.gauge.data_points.add().as_double = 2.0
    result = TelemetryStore().ingest(request([wrong, gauge("inference_queue_depth", 1)]), 1.0)
    assert result.points == 1 and dict(result.ignored) == {"wrong_type": 2}
    assert result.errors == ("wrong_type: inference_requests: gauge for a counter",)


def state(value: float, version: str = "1", name: str = "READY") -> m.Metric:
    return gauge("model_state", value, model="m", version=version, state=name)


def test_model_state_changes_become_placement_hints() -> None:
    store = TelemetryStore()
    store.ingest(request([state(0), state(1, name="LOADING")]), 1.0)
    assert store.take_placement_hints() == set()  # a first report: placement probes new ones
    store.ingest(request([state(0), state(1, name="LOADING")]), 2.0)
    assert store.take_placement_hints() == set()  # nothing changed
    store.ingest(request([state(1), state(0, name="LOADING")]), 3.0)
    assert store.take_placement_hints() == {"127.0.0.1:8001"}
    assert store.take_placement_hints() == set()  # taken
    store.ingest(request([state(1), state(1, version="2", name="LOADING")]), 4.0)
    assert store.take_placement_hints() == {"127.0.0.1:8001"}  # a new version appeared
    store.ingest(request([gauge("server_draining", 0)], EP2), 4.0)
    store.ingest(request([gauge("server_draining", 1)], EP2), 5.0)
    store.ingest(request([gauge("inference_queue_depth", 7, model="m")]), 5.0)
    assert store.take_placement_hints() == {EP2}  # draining counts; a queue depth does not


def as_plain(value: Any) -> Any:
    """The reference: every dataclass and signal as a mapping of its fields, recursively."""
    if isinstance(value, Signal | Flag):
        return {"value": value.value, "age_s": value.age_s}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: as_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return tuple(as_plain(v) for v in value)
    return value


def test_telemetry_json_is_every_field_as_a_mapping() -> None:
    store = TelemetryStore(window_s=4.0)
    traffic(store, 6, 3)
    store.ingest(request([state(1), gauge("accelerator_memory_used_bytes", 5e8, source="nvml")]), 6)
    for later in (6.0, 7.5, 40.0):
        for t in store.snapshot(later).values():
            # Labels become a mapping in JSON ({"device_class": "cpu"}).
            assert telemetry_json(t) == {**as_plain(t), "labels": dict(t.labels)}
    assert store.as_json(7.5)["endpoints"]["127.0.0.1:8001"]["draining"] == {
        "value": False,
        "age_s": 1.5,
    }


def test_telemetry_made_without_init_is_the_dataclass_it_would_make() -> None:
    """The store makes EndpointTelemetry and ModelTelemetry without their __init__: every
    field is set, and each equals, hashes and replaces like one made the usual way."""
    store = TelemetryStore(window_s=4.0)
    traffic(store, 4, 3)
    for telemetry in store.snapshot(4.25).values():
        fields = {f.name: getattr(telemetry, f.name) for f in dataclasses.fields(telemetry)}
        assert set(telemetry.__dict__) == set(fields)
        usual = type(telemetry)(**fields)
        assert telemetry == usual and hash(telemetry) == hash(usual)
        assert dataclasses.replace(telemetry, age_s=1.0) == dataclasses.replace(usual, age_s=1.0)
        for model in telemetry.models:
            assert set(model.__dict__) == {f.name for f in dataclasses.fields(model)}
            assert model == type(model)(
                **{f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
            )
