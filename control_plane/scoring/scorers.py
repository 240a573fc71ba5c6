"""Step 2-3: per-signal scores in [0, 1] (None when the signal is missing), and their weighted
combination with the pool's ScoreWeights, renormalised over the scorers that have a value."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from control_plane.scoring.types import DEVICE_CLASS, EndpointSignals, PoolPolicy


def _clamp01(x: float) -> float:
    return min(1.0, max(0.0, x))


def _headroom(used: float | None, total: float | None) -> float | None:
    """1 - used/total clamped to [0, 1]; None when either is missing or total is not positive."""
    if used is None or total is None or total <= 0:
        return None
    return _clamp01(1.0 - used / total)


class Scorer(Protocol):
    # Names match the ScoreWeights fields, so a scorer's weight is getattr(weights, name).
    @property
    def name(self) -> str: ...

    @property
    def consumes(self) -> tuple[str, ...]: ...

    # True when an endpoint's score depends on the rest of the pool, not only on its own
    # signals and the policy: its score cannot be kept while the endpoint's signals are.
    @property
    def reads_pool(self) -> bool: ...

    def score(
        self, endpoint: EndpointSignals, pool: Sequence[EndpointSignals], policy: PoolPolicy
    ) -> float | None: ...


@dataclass(frozen=True)
class QpsScorer:
    """QPS headroom: 1 - qps / capacity, where capacity is that of the endpoint's device class.

    ``policy.capacity_for(device_class)``: an a100 rated 3000 qps at 1500 qps scores 0.5, a
    cpu endpoint rated 200 qps at 150 qps scores 0.25; an endpoint without a device class, or
    of a class the pool does not list, is measured against ``policy.capacity_qps``.
    """

    name: str = "qps"
    consumes: tuple[str, ...] = ("qps", "labels")
    reads_pool: bool = False

    def score(
        self, endpoint: EndpointSignals, pool: Sequence[EndpointSignals], policy: PoolPolicy
    ) -> float | None:
        capacity_qps = policy.capacity_for(endpoint.label(DEVICE_CLASS))
        return _headroom(endpoint.qps, capacity_qps)


@dataclass(frozen=True)
class LatencyScorer:
    name: str = "latency"
    consumes: tuple[str, ...] = ("p99_ms",)
    reads_pool: bool = False

    def score(
        self, endpoint: EndpointSignals, pool: Sequence[EndpointSignals], policy: PoolPolicy
    ) -> float | None:
        # p99 at or above the SLA scores 0: over-SLA endpoints are not ranked among themselves.
        return _headroom(endpoint.p99_ms, policy.sla_p99_ms)


def _headroom_above_need(used: float | None, total: float | None, need: float) -> float | None:
    """How much of what a card could ever have free beyond ``need`` bytes it has free now.

    clamp01((free - need) / (total - need)), free = total - used. The same used share means
    different things on different cards: with need = 10 GB, a 24 GB card at 80% used has
    4.8 GB free and cannot take the model (0), an 80 GB card at 80% has 16 GB free, 6 GB
    beyond the need out of at most 70 GB (about 0.086), and at 50% about 0.43. An empty card
    scores 1. A card no larger than the need can never take the model: 0. None when used or
    total is missing or total is not positive.
    """
    if used is None or total is None or total <= 0:
        return None
    if total <= need:
        return 0.0
    free = total - used
    return _clamp01((free - need) / (total - need))


@dataclass(frozen=True)
class MemoryScorer:
    """Accelerator (or host) memory headroom.

    Without ``policy.memory_need_bytes``: 1 - used / total. With it: the free memory beyond
    what the model needs, as a share of the most a card of that size could have beyond the
    need (`_headroom_above_need`), so cards of different sizes are compared by how close
    they are to being unable to run the model, not by their used share.
    """

    name: str = "memory"
    consumes: tuple[str, ...] = ("memory_used_bytes", "memory_total_bytes")
    reads_pool: bool = False

    def score(
        self, endpoint: EndpointSignals, pool: Sequence[EndpointSignals], policy: PoolPolicy
    ) -> float | None:
        used, total = endpoint.memory_used_bytes, endpoint.memory_total_bytes
        if policy.memory_need_bytes is None:
            return _headroom(used, total)
        return _headroom_above_need(used, total, policy.memory_need_bytes)


@dataclass(frozen=True)
class KvCacheScorer:
    name: str = "kv_cache"
    consumes: tuple[str, ...] = ("kv_blocks_used", "kv_blocks_total")
    reads_pool: bool = False

    def score(
        self, endpoint: EndpointSignals, pool: Sequence[EndpointSignals], policy: PoolPolicy
    ) -> float | None:
        return _headroom(endpoint.kv_blocks_used, endpoint.kv_blocks_total)


@dataclass(frozen=True)
class QueueScorer:
    name: str = "queue"
    consumes: tuple[str, ...] = ("queue_depth",)
    reads_pool: bool = True  # relative to the deepest queue in the pool

    def score(
        self, endpoint: EndpointSignals, pool: Sequence[EndpointSignals], policy: PoolPolicy
    ) -> float | None:
        # Queue depth has no absolute scale, so it is relative to the deepest queue in the pool.
        if endpoint.queue_depth is None:
            return None
        depths = [s.queue_depth for s in pool if s.queue_depth is not None]
        deepest = max([endpoint.queue_depth, *depths])
        if deepest <= 0:
            return 1.0
        return _clamp01(1.0 - endpoint.queue_depth / deepest)


@dataclass(frozen=True)
class LabelScorer:
    """The share of the pool's preferred labels (``policy.prefer_labels``) the endpoint has.

    Each (name, accepted values) pair counts 1 and is matched when the endpoint's label
    ``name`` is one of the accepted values: preferring device_class a100 and zone us-east-1a,
    an a100 in us-west-2b scores 0.5. None when the pool prefers no labels. Labels come from
    placement, not telemetry, so this is never None for lack of telemetry.
    """

    name: str = "labels"
    consumes: tuple[str, ...] = ("labels",)
    reads_pool: bool = False

    def score(
        self, endpoint: EndpointSignals, pool: Sequence[EndpointSignals], policy: PoolPolicy
    ) -> float | None:
        preferred = policy.prefer_labels
        if not preferred:
            return None
        matched = sum(endpoint.label(label) in accepted for label, accepted in preferred)
        return matched / len(preferred)


SCORERS: tuple[Scorer, ...] = (
    QpsScorer(),
    LatencyScorer(),
    MemoryScorer(),
    KvCacheScorer(),
    QueueScorer(),
    LabelScorer(),
)


@dataclass(frozen=True)
class EndpointScore:
    endpoint: str
    score: float | None  # None: no weighted scorer had a value (the endpoint is neutral)
    parts: dict[str, float | None]  # each weighted scorer's value (weight-0 scorers left out)


def weighted_mean(parts: Mapping[str, float | None], weights: Mapping[str, float]) -> float | None:
    """Sum of weight x part over the parts with a value, the weights renormalised to sum 1."""
    present = {n: v for n, v in parts.items() if v is not None and weights.get(n, 0.0) > 0}
    total = sum(weights[n] for n in present)
    if total <= 0:
        return None
    return sum(weights[n] * v for n, v in present.items()) / total


def over_sla_factor(p99_ms: float | None, policy: PoolPolicy) -> float:
    """(SLA / p99) ** exponent above the SLA, else 1.

    The weighted sum alone is gentle: a server at 1.5x its SLA scores 0 on latency but keeps
    its QPS and memory headroom, about 60% of a healthy server's weight, and its QPS headroom
    grows as it loses traffic. The factor makes a slow server lose weight in proportion to how
    far past the SLA it is (at 2x the SLA and exponent 2: a quarter of its score).
    """
    if p99_ms is None or policy.sla_p99_ms <= 0 or p99_ms <= policy.sla_p99_ms:
        return 1.0
    return float((policy.sla_p99_ms / p99_ms) ** policy.over_sla_exponent)


def kv_full_factor(headroom: float | None, policy: PoolPolicy) -> float:
    """headroom / (1 - kv_full_at) once the KV cache's headroom (the kv_cache scorer's
    1 - used/total) is under 1 - ``policy.kv_full_at``, else 1.

    The KV-cache scorer alone is gentle too: at 35% of a generative pool's weights, a server
    whose cache was 97% used kept half the weight of an empty one from its other headroom,
    yet every new sequence there waits for blocks to free. With kv_full_at 0.8, a server at
    90% used keeps half its score, at 97% 15%, and a full one none (its weight floors at 1).
    """
    if headroom is None or headroom >= 1.0 - policy.kv_full_at:  # kv_full_at 1: never
        return 1.0
    return headroom / (1.0 - policy.kv_full_at)


def errors_factor(error_rate: float | None, policy: PoolPolicy) -> float:
    """1 - error_rate / error_rate_eject, from 1 with no errors to 0 at the ejection threshold.

    No scorer reads the error rate, so a server failing 40% of its requests (under the 50%
    that ejects it, or held in by the ejection cap, or in a pool failing open) kept its full
    weight, and failing fast even raised its latency headroom. Now it keeps a fifth of its
    score at 40% (threshold 50%), half at 25%, and 0.998 at 0.1%: noise costs nothing.
    """
    if not error_rate or policy.error_rate_eject <= 0:
        return 1.0
    return _clamp01(1.0 - error_rate / policy.error_rate_eject)


def scorer_weights(policy: PoolPolicy, scorers: Sequence[Scorer] = SCORERS) -> dict[str, float]:
    """Each scorer's weight in the pool's policy (0.0 for a scorer ScoreWeights does not name)."""
    return {s.name: float(getattr(policy.score_weights, s.name, 0.0)) for s in scorers}


def combine(
    endpoint: EndpointSignals,
    pool: Sequence[EndpointSignals],
    policy: PoolPolicy,
    scorers: Sequence[Scorer] = SCORERS,
    weights: Mapping[str, float] | None = None,
) -> EndpointScore:
    """``weights``: ``scorer_weights(policy, scorers)``, made once for a whole pool."""
    weights = scorer_weights(policy, scorers) if weights is None else weights
    parts = {s.name: s.score(endpoint, pool, policy) for s in scorers if weights[s.name] > 0}
    measured = [v for n, v in parts.items() if n != "labels" and v is not None]
    # Labels are placement, not evidence: with no telemetry at all the endpoint stays neutral.
    score = weighted_mean(parts, weights) if measured else None
    # Each only when its signal counts at all (weight 0 means the operator routes without it;
    # the kv_cache part is absent then).
    latency_counts = weights.get("latency", 0) > 0
    factors = {
        "over_sla": over_sla_factor(endpoint.p99_ms, policy) if latency_counts else 1.0,
        "kv_full": kv_full_factor(parts.get("kv_cache"), policy),
        "errors": errors_factor(endpoint.error_rate, policy),
    }
    for name, factor in factors.items():
        if score is not None and factor < 1.0:
            parts[name] = factor  # in the reason: "over_sla 0.25", "kv_full 0.15", "errors 0.5"
            score *= factor
    return EndpointScore(endpoint.endpoint, score, parts)
