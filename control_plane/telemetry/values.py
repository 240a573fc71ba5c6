"""What the telemetry store reads out: per-endpoint signals as immutable values (pure, no
I/O), made and pickled cheaply because a telemetry shard makes ten thousand a second and the
control plane unpickles what it pushes."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

_Frozen = TypeVar("_Frozen")
_new_pair = tuple.__new__


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
    # The model's own requests: on a server with several models, one that fails must not make
    # the server look broken in the other models' pools.
    error_rate: Signal | None = None
    abandoned_rate: Signal | None = None


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
    abandoned_rate: Signal | None = None  # cancelled by their callers (hedges that lost)
    queue_depth: Signal | None = None
    in_flight: Signal | None = None
    memory_used_bytes: Signal | None = None
    memory_total_bytes: Signal | None = None
    memory_source: str | None = None  # "nvml" when any device reports it, else "process"
    kv_blocks_used: Signal | None = None
    kv_blocks_total: Signal | None = None
    prefix_cache_hit_rate: Signal | None = None  # prompt tokens the prefix cache held, a share
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


def made(cls: type[_Frozen], pairs: Iterable[tuple[str, Any]] = (), **fields: Any) -> _Frozen:
    """``cls(**fields)`` (and ``pairs``) for a frozen dataclass given every field, without its
    __init__: that sets each field through object.__setattr__ (8 us for an EndpointTelemetry,
    3 for a ModelTelemetry; a shard makes one of each per endpoint report, 10,000 a second, and
    the control plane unpickles what it pushes)."""
    made: _Frozen = object.__new__(cls)
    made.__dict__.update(pairs, **fields)
    return made


def is_stale(age_s: float, interval_s: float, stale_after_intervals: float) -> bool:
    """An endpoint is stale once its last report is older than that many of its intervals."""
    return age_s > stale_after_intervals * interval_s


def aged(t: EndpointTelemetry, dt: float, stale_after_intervals: float) -> EndpointTelemetry:
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
        abandoned_rate=older(t.abandoned_rate),
        queue_depth=older(t.queue_depth),
        in_flight=older(t.in_flight),
        memory_used_bytes=older(t.memory_used_bytes),
        memory_total_bytes=older(t.memory_total_bytes),
        kv_blocks_used=older(t.kv_blocks_used),
        kv_blocks_total=older(t.kv_blocks_total),
        prefix_cache_hit_rate=older(t.prefix_cache_hit_rate),
        draining=None if t.draining is None else Flag(t.draining.value, t.draining.age_s + dt),
        models=tuple(
            ModelTelemetry(
                m.model, older(m.p99_ms), older(m.qps), older(m.error_rate), older(m.abandoned_rate)
            )
            for m in t.models
        ),
    )


def read_computed(
    cached: tuple[float, EndpointTelemetry], now: float, ages: bool, stale_after_intervals: float
) -> tuple[tuple[float, EndpointTelemetry], EndpointTelemetry]:
    """(the entry to keep, the telemetry to return) for telemetry computed at ``cached[0]``
    and read at ``now`` with no new data. ``ages``: every age brought to ``now``. Else the
    same object, unless its stale flag flips: then it is aged once and kept aged."""
    at, computed = cached
    if ages:
        return cached, aged(computed, now - at, stale_after_intervals)
    age = computed.age_s + now - at
    if is_stale(age, computed.interval_s, stale_after_intervals) == computed.stale:
        return cached, computed
    computed = aged(computed, now - at, stale_after_intervals)
    return (now, computed), computed


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
                {"model": m.model, "p99_ms": plain(m.p99_ms), "qps": plain(m.qps),
                 "error_rate": plain(m.error_rate), "abandoned_rate": plain(m.abandoned_rate)}
                for m in value
            )  # fmt: skip
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


_DRAINING_AT = _TELEMETRY_FIELDS.index("draining")


def _plain(pair: Signal | Flag | None) -> tuple[Any, Any] | None:
    return None if pair is None else (pair[0], pair[1])


def _flat_telemetry(t: EndpointTelemetry) -> tuple[Any, ...]:
    values = list(map(t.__dict__.__getitem__, _TELEMETRY_FIELDS))
    for i in _PAIRS_AT:
        values[i] = _plain(values[i])
    values[_MODELS_AT] = tuple(
        (m.model, _plain(m.p99_ms), _plain(m.qps), _plain(m.error_rate), _plain(m.abandoned_rate))
        for m in t.models
    )
    return tuple(values)


def _rebuild_telemetry(flat: tuple[Any, ...]) -> EndpointTelemetry:
    values = list(flat)
    for i in _PAIRS_AT:
        pair = values[i]
        if pair is not None:
            values[i] = _new_pair(Flag if i == _DRAINING_AT else Signal, pair)
    values[_MODELS_AT] = tuple(
        made(
            ModelTelemetry,
            model=model,
            p99_ms=None if p99 is None else _new_pair(Signal, p99),
            qps=None if qps is None else _new_pair(Signal, qps),
            error_rate=None if errors is None else _new_pair(Signal, errors),
            abandoned_rate=None if abandoned is None else _new_pair(Signal, abandoned),
        )
        for model, p99, qps, errors, abandoned in values[_MODELS_AT]
    )
    return made(EndpointTelemetry, zip(_TELEMETRY_FIELDS, values, strict=True))
