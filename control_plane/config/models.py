"""The topology's ``models:`` section: each model's route, capacity, routing policy, placement
rule and canary progression, checked with every error collected (``control_plane.config.topology``
documents the whole file's schema and raises the errors)."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from control_plane.model import lanes
from control_plane.model.canary import CanaryPolicy, parse_policy
from control_plane.model.mesh import (
    AFFINITY_MODES,
    Affinity,
    CircuitBreaker,
    HedgingPolicy,
    ModelRoute,
    RateLimit,
)
from control_plane.model.schema import Checker, show
from control_plane.scoring.types import PoolPolicy, ScoreWeights

_MODEL = {
    "name": "name", "sla_p99_ms": "positive", "capacity_qps": "positive",
    "timeout_s": "positive", "version_split": "split", "routing": "routing", "canary": "canary",
    "rate_limit": "rate_limit", "circuit_breaker": "circuit_breaker", "fallback": "name",
    "generative": "bool", "placement": "mapping", "memory_bytes": "positive",
    "sla_classes": "mapping", "large_inputs": "mapping", "hedging": "mapping",
    "idempotent": "bool", "affinity": "affinity",
}  # fmt: skip
# models[].hedging (control_plane.routing.hedging); defaults: HedgingPolicy's
_HEDGING = {
    "enabled": "bool", "multiplier": "positive", "floor_ms": "positive",
    "budget_percent": "percent", "hysteresis": "fraction", "stalled_try": "fraction",
}  # fmt: skip
# A try still unanswered at this share of the model's timeout races another host, whether or
# not adaptive hedging is on (models[].hedging.stalled_try; 0 turns it off).
DEFAULT_STALLED_TRY = 0.5
_PLACEMENT_RULE = ("require", "prefer", "prefer_weight")
DEFAULT_PREFER_WEIGHT = 0.2  # the labels scorer's weight when a model prefers labels
_RATE_LIMIT = {"requests_per_s": "positive", "burst": "count"}
_CIRCUIT_BREAKER = {"max_requests": "count", "max_pending_requests": "count"}
# models[].routing: telemetry-driven routing of the model's pool (defaults: PoolPolicy's).
_ROUTING = {
    "score_weights": "score_weights", "memory_watermark": "fraction",
    "latency_eject_factor": "positive", "latency_eject_windows": "count",
    "latency_eject_vs_pool": "nonnegative",
    "error_rate_eject": "fraction", "max_ejected_share": "fraction",
    "backoff_base_s": "positive", "backoff_max_s": "positive", "slow_start_s": "nonnegative",
    "ewma_alpha": "fraction", "hysteresis": "fraction", "max_step": "fraction",
    "over_sla_exponent": "nonnegative", "recompute_tolerance": "fraction",
    "kv_full_at": "fraction",
}  # fmt: skip
# A generative pool is scored mostly on KV-cache headroom and waiting sequences: a server whose
# cache is nearly full loses weight before it has to turn sequences away.
GENERATIVE_SCORE_WEIGHTS = ScoreWeights(qps=0.15, latency=0.2, memory=0.1, kv_cache=0.35, queue=0.2)
_SCORE_WEIGHTS = {
    k: "nonnegative" for k in ("qps", "latency", "memory", "kv_cache", "queue", "labels")
}


def parse_models(
    c: Checker, value: object
) -> tuple[
    tuple[ModelRoute, ...],
    tuple[tuple[str, float], ...],
    tuple[tuple[str, PoolPolicy], ...],
    tuple[tuple[str, CanaryPolicy], ...],
]:
    items = c.sequence(value, "models")
    if items == []:
        c.errors.append("models: must list at least one model")
    routes: list[ModelRoute] = []
    capacity: list[tuple[str, float]] = []
    policies: list[tuple[str, PoolPolicy]] = []
    canaries: list[tuple[str, CanaryPolicy]] = []
    first: dict[str, int] = {}
    for index, item in enumerate(items or []):
        path = f"models[{index}]"
        if (m := c.mapping(item, path)) is None:
            continue
        c.keys(m, path, _MODEL, required=("name", "sla_p99_ms", "capacity_qps"))
        name = c.value(m, path, "name", "name", "")
        if name in first:
            where = f"first at models[{first[name]}]"
            c.errors.append(f"{path}.name: duplicate model {show(name)} ({where})")
        first.setdefault(name, index)
        sla = c.value(m, path, "sla_p99_ms", "positive", 1.0)
        timeout = c.value(m, path, "timeout_s", "positive", max(1.0, 20 * sla / 1000))
        split = c.value(m, path, "version_split", "split", ())
        classes = (
            lanes.parse_sla_classes(c, m["sla_classes"], f"{path}.sla_classes", timeout)
            if "sla_classes" in m else ()
        )  # fmt: skip
        large = (
            lanes.parse_large_inputs(c, m["large_inputs"], f"{path}.large_inputs")
            if "large_inputs" in m else None
        )  # fmt: skip
        generative = c.value(m, path, "generative", "bool", False)
        idempotent = c.value(m, path, "idempotent", "bool", True)
        hedging, stalled_try = _hedging(c, m, path, generative, idempotent)
        routes.append(
            ModelRoute(
                name, sla, timeout, split, parse_rate_limit(c, m, path), _breaker(c, m, path),
                c.value(m, path, "fallback", "name", None), sla_classes=classes,
                large_inputs=large, hedging=hedging, stalled_try_share=stalled_try,
                affinity=_affinity(c, m.get("affinity", "none"), f"{path}.affinity"),
                idempotent=idempotent,
            )
        )  # fmt: skip
        per_class = _capacity(c, m, path)
        capacity.append((name, per_class[0][1]))
        affinity = routes[-1].affinity is not None
        routing = (m.get("routing", {}), f"{path}.routing", capacity[-1][1], sla, generative)
        pool = _placement(c, m, path, _policy(c, *routing, affinity=affinity))
        policies.append((name, dataclasses.replace(pool, capacity_by_class=per_class[1:])))
        if "canary" in m and (canary := c.mapping(m["canary"], f"{path}.canary")) is not None:
            policy, errors = parse_policy(canary, CanaryPolicy(), f"{path}.canary.")
            c.errors.extend(errors)
            canaries.append((name, policy))
    _check_fallbacks(c, routes)
    return tuple(routes), tuple(capacity), tuple(policies), tuple(canaries)


def _hedging(
    c: Checker, m: dict[str, Any], path: str, generative: bool, idempotent: bool
) -> tuple[HedgingPolicy | None, float]:
    """``hedging:``: the adaptive policy, off unless ``enabled: true``, and the stalled-try
    share (``stalled_try``: a try unanswered at this share of the timeout races another host).
    Neither for a model declared ``idempotent: false`` (a hedge runs the request twice); no
    stalled-try hedge for a generative model (a long generation is not a stall)."""
    given = c.mapping(m.get("hedging", {}), f"{path}.hedging") or {}
    where = f"{path}.hedging"
    c.keys(given, where, _HEDGING)
    default = HedgingPolicy()
    # Off unless asked for: on a host whose tries take longer through Envoy than the servers'
    # P99 says (CPU contention, container networks), hedges of healthy tries add load that
    # raises every server's latency; the container tier saw the pool go unhealthy so.
    enabled = c.value(given, where, "enabled", "bool", False)
    if enabled and not idempotent:
        c.errors.append(f"{where}.enabled: a model declared idempotent: false cannot be hedged")
    if enabled and generative:  # a generation's time follows its length: a hedge runs it twice
        c.errors.append(f"{where}.enabled: a generative model cannot be hedged")
    policy = HedgingPolicy(  # checked even while off: a bad value is an error either way
        multiplier=c.value(given, where, "multiplier", "positive", default.multiplier),
        floor_ms=c.value(given, where, "floor_ms", "positive", default.floor_ms),
        budget_percent=c.value(given, where, "budget_percent", "percent", default.budget_percent),
        hysteresis=c.value(given, where, "hysteresis", "fraction", default.hysteresis),
    )
    stalled_try = c.value(given, where, "stalled_try", "fraction", DEFAULT_STALLED_TRY)
    stalled = 0.0 if generative or not idempotent else float(stalled_try)
    return (policy if enabled else None), stalled


# models[].affinity: a mode, or a mapping with the mode and its options (defaults: Affinity's)
_AFFINITY = {
    "mode": "", "prefix_blocks": "count", "block_bytes": "count", "session_header": "",
    "hash_balance_factor": "count", "one_request_streams": "bool",
}  # fmt: skip
_HEADER_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")
MAX_PREFIX_BYTES = 4096  # the key's hex is twice this: a header well under Envoy's limits


def _affinity(c: Checker, value: object, path: str) -> Affinity | None:
    """``affinity: none | prefix | session``, or ``{mode: ..., prefix_blocks, block_bytes,
    session_header, hash_balance_factor, one_request_streams}``; None for ``none``."""
    given = {"mode": value} if isinstance(value, str) else c.mapping(value, path) or {}
    c.keys(given, path, _AFFINITY)
    mode = given.get("mode", "prefix")
    where = path if isinstance(value, str) else f"{path}.mode"
    if mode not in AFFINITY_MODES:
        c.fail(where, f"must be one of {', '.join(AFFINITY_MODES)}", mode)
        return None
    default = Affinity()
    found = {
        k: c.value(given, path, k, kind, getattr(default, k))
        for k, kind in _AFFINITY.items()
        if kind
    }
    header = given.get("session_header", default.session_header)
    if (
        not isinstance(header, str)
        or not _HEADER_NAME.fullmatch(header)
        or header.startswith(("x-infermesh-", "authorization", "x-model-"))
    ):
        c.fail(f"{path}.session_header", "must be a lower-case header name a client sets "
               "(not x-infermesh-*, x-model-*, authorization)", header)  # fmt: skip
        header = default.session_header
    result = Affinity(mode, session_header=header, **found)
    if result.hash_balance_factor < 100:
        c.fail(f"{path}.hash_balance_factor", "must be >= 100 (a percentage of the mean load)",
               result.hash_balance_factor)  # fmt: skip
    for key in ("prefix_blocks", "block_bytes"):
        if getattr(result, key) < 1:
            c.fail(f"{path}.{key}", "must be >= 1", getattr(result, key))
    if result.prefix_bytes > MAX_PREFIX_BYTES:
        c.fail(f"{path}.prefix_blocks", f"prefix_blocks x block_bytes must be <= "
               f"{MAX_PREFIX_BYTES}", result.prefix_bytes)  # fmt: skip
    return None if mode == "none" else result


def _capacity(c: Checker, m: dict[str, Any], path: str) -> tuple[tuple[str, float], ...]:
    """``capacity_qps``: a number, or per device class ``{default: 1000, a100: 3000}``;
    ("default", capacity) first."""
    given = m.get("capacity_qps")
    if not isinstance(given, dict):
        return (("default", c.value(m, path, "capacity_qps", "positive", 1.0)),)
    where = f"{path}.capacity_qps"
    if "default" not in given:
        c.errors.append(f"{where}.default: required (the capacity of unlisted device classes)")
    by_class = [(str(k), c.value(given, where, k, "positive", 1.0)) for k in given]
    default = dict(by_class).get("default", 1.0)
    return (("default", default), *sorted((k, v) for k, v in by_class if k != "default"))


def _placement(c: Checker, m: dict[str, Any], path: str, policy: PoolPolicy) -> PoolPolicy:
    """``placement: {require, prefer, prefer_weight}`` and ``memory_bytes`` onto the policy."""
    memory = c.value(m, path, "memory_bytes", "positive", None)
    rule = c.mapping(m.get("placement", {}), f"{path}.placement") or {}
    where = f"{path}.placement"
    c.keys(rule, where, _PLACEMENT_RULE)
    require = lanes.parse_label_rule(c, rule.get("require", {}), f"{where}.require")
    prefer = lanes.parse_label_rule(c, rule.get("prefer", {}), f"{where}.prefer")
    default_weight = DEFAULT_PREFER_WEIGHT if prefer else policy.score_weights.labels
    weight = c.value(rule, where, "prefer_weight", "nonnegative", default_weight)
    weights = dataclasses.replace(policy.score_weights, labels=weight)
    return dataclasses.replace(
        policy, require_labels=require, prefer_labels=prefer, memory_need_bytes=memory,
        score_weights=weights,
    )  # fmt: skip


def parse_rate_limit(
    c: Checker, m: dict[str, Any], path: str, key: str = "rate_limit"
) -> RateLimit | None:
    """``m[key]`` as a token bucket (None when absent); the default burst is one second's."""
    if key not in m:
        return None
    fields = c.section(m, key, _RATE_LIMIT, RateLimit(1.0, 0), path)
    given = m[key] if isinstance(m[key], dict) else {}
    where = f"{path}.{key}"
    if "requests_per_s" not in given:
        c.errors.append(f"{where}.requests_per_s: required")
    if "burst" in given and fields["burst"] == 0:
        c.errors.append(f"{where}.burst: must be >= 1, got 0")
    return RateLimit(
        fields["requests_per_s"], fields["burst"] or math.ceil(fields["requests_per_s"])
    )


def _breaker(c: Checker, m: dict[str, Any], path: str) -> CircuitBreaker | None:
    if "circuit_breaker" not in m:
        return None
    fields = c.section(m, "circuit_breaker", _CIRCUIT_BREAKER, CircuitBreaker(), path)
    for key, value in fields.items():
        if value < 1:
            c.errors.append(f"{path}.circuit_breaker.{key}: must be >= 1, got {value}")
    return CircuitBreaker(**fields)


def _check_fallbacks(c: Checker, routes: list[ModelRoute]) -> None:
    """A fallback is another model of the topology, without a fallback of its own."""
    by_name = {r.name: r for r in routes}
    for index, route in enumerate(routes):
        if route.fallback is None:
            continue
        target = by_name.get(route.fallback)
        where = f"models[{index}].fallback"
        if route.fallback == route.name:
            c.errors.append(f"{where}: a model cannot be its own fallback")
        elif target is None:
            c.errors.append(f"{where}: {show(route.fallback)} is not a model of the topology")
        elif target.fallback is not None:
            c.errors.append(
                f"{where}: {show(route.fallback)} has a fallback of its own (one level only)"
            )


def _policy(
    c: Checker,
    value: object,
    path: str,
    capacity: float,
    sla: float,
    generative: bool = False,
    affinity: bool = False,
) -> PoolPolicy:
    """``routing:``. With ``affinity``, ``kv_full_at`` defaults to 1 (off): a pool's weights
    are its Maglev table, so a score that falls steeply as a cache fills moves prefixes off
    the servers that hold them (bench_affinity at width 256: affinity's TTFT P90 was 0.26-0.38x
    least_request's in 6 of 6 rounds with it off, over 0.5x in 4 of 9 with it on); the bounded
    load (hash_balance_factor) already spills new streams off a server holding more than its
    share."""
    weights = GENERATIVE_SCORE_WEIGHTS if generative else ScoreWeights()
    default = PoolPolicy(capacity_qps=capacity, sla_p99_ms=sla, score_weights=weights)
    if affinity:
        default = dataclasses.replace(default, kv_full_at=1.0)
    m = c.mapping(value, path) or {}
    c.keys(m, path, _ROUTING)
    options = {
        k: c.value(m, path, k, kind, getattr(default, k))
        for k, kind in _ROUTING.items()
        if kind != "score_weights"
    }
    if "latency_eject_windows" in m and options["latency_eject_windows"] < 1:
        c.errors.append(
            f"{path}.latency_eject_windows: must be >= 1, got {options['latency_eject_windows']}"
        )
    w = c.mapping(m.get("score_weights", {}), f"{path}.score_weights") or {}
    c.keys(w, f"{path}.score_weights", _SCORE_WEIGHTS)
    weights = ScoreWeights(
        **{
            k: c.value(w, f"{path}.score_weights", k, kind, getattr(default.score_weights, k))
            for k, kind in _SCORE_WEIGHTS.items()
        }
    )
    if sum(dataclasses.astuple(weights)) <= 0:
        c.errors.append(f"{path}.score_weights: at least one weight must be > 0")
    return dataclasses.replace(default, score_weights=weights, **options)
