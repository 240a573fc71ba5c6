"""Step 5: one pure decision for one model pool.

filter -> score -> combine -> smooth (EWMA on the combined score) -> proportional integer
weights -> limit_step vs the last pushed weights -> needs_push. When no push is needed the
decision keeps the previously pushed weights, so small wobbles never reach Envoy.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from control_plane.scoring.filters import filter_pool
from control_plane.scoring.scorers import EndpointScore, combine
from control_plane.scoring.types import EndpointSignals, PoolPolicy
from control_plane.scoring.weights import limit_step, needs_push, proportional_weights, smooth

NEUTRAL_WHEN_NONE_SCORED = 0.5


@dataclass(frozen=True)
class PoolState:
    """What one decision hands to the next for the same pool."""

    scores: Mapping[str, float] = field(default_factory=dict)  # smoothed combined scores
    weights: Mapping[str, int] = field(default_factory=dict)  # last pushed weights


@dataclass(frozen=True)
class PoolDecision:
    weights: dict[str, int]  # routed endpoints only; excluded ones get no weight
    scores: dict[str, EndpointScore]  # this round's raw scores (neutral ones: score None)
    reasons: dict[str, str]  # every endpoint, in words
    push: bool


def median_or_neutral(values: Sequence[float]) -> float:
    return statistics.median(values) if values else NEUTRAL_WHEN_NONE_SCORED


def _format_parts(parts: Mapping[str, float | None]) -> str:
    return ", ".join(f"{n} {'n/a' if v is None else f'{v:.2f}'}" for n, v in parts.items())


def _reason(
    ep: str, score: EndpointScore, smoothed: float, weight: int, neutral_why: str | None
) -> str:
    if neutral_why is not None:
        return f"neutral: {neutral_why} (pool median {smoothed:.2f}) -> weight {weight}"
    return (
        f"score {score.score:.2f} ({_format_parts(score.parts)}), smoothed {smoothed:.2f}"
        f" -> weight {weight}"
    )


def decide_pool(
    signals: Sequence[EndpointSignals], policy: PoolPolicy, previous: PoolState | None
) -> tuple[PoolDecision, PoolState]:
    prev = previous or PoolState()
    result = filter_pool(signals, policy)
    scores = {s.endpoint: combine(s, result.scored, policy) for s in result.scored}
    for ep in result.neutral:
        scores[ep] = EndpointScore(ep, None, {})
    neutral_why = {ep: "telemetry stale" for ep in result.neutral}
    neutral_why.update(
        {
            ep: "no scoring signals"
            for ep, sc in scores.items()
            if sc.score is None and ep not in neutral_why
        }
    )
    raw = {ep: sc.score for ep, sc in scores.items() if sc.score is not None}
    prev_scores = {ep: v for ep, v in prev.scores.items() if ep not in neutral_why}
    smoothed = smooth(prev_scores, raw, policy.ewma_alpha)
    # Neutral endpoints sit at the median of the scored ones: neither favoured nor starved.
    median = median_or_neutral(list(smoothed.values()))
    smoothed.update({ep: median for ep in neutral_why})

    target = proportional_weights(smoothed, policy.max_weight)
    step = max(1, round(policy.max_step * policy.max_weight))
    stepped = limit_step(prev.weights, target, step)
    push = previous is None or needs_push(
        prev.weights, stepped, policy.hysteresis, policy.max_weight
    )
    weights = stepped if push else dict(prev.weights)

    reasons = {ep: f"excluded: {why}" for ep, why in result.excluded.items()}
    for ep, sc in scores.items():
        reasons[ep] = _reason(ep, sc, smoothed[ep], weights[ep], neutral_why.get(ep))
    decision = PoolDecision(weights=weights, scores=scores, reasons=reasons, push=push)
    return decision, PoolState(scores=smoothed, weights=weights)
