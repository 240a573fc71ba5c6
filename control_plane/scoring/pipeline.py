"""Step 5: one pure decision for one model pool.

filter -> score -> combine -> smooth (EWMA on the combined score) -> proportional integer
weights -> needs_push (the target vs the last pushed weights) -> limit_step toward it. When no
push is needed the decision keeps the previously pushed weights, so small wobbles never reach
Envoy.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from control_plane.scoring.filters import filter_pool
from control_plane.scoring.scorers import EndpointScore, combine
from control_plane.scoring.types import RECOMPUTE_PERIOD_S, EndpointSignals, PoolPolicy
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
    signals: Sequence[EndpointSignals],
    policy: PoolPolicy,
    previous: PoolState | None,
    elapsed_s: float = RECOMPUTE_PERIOD_S,
) -> tuple[PoolDecision, PoolState]:
    """``elapsed_s``: since the pool's previous decision; one sooner than RECOMPUTE_PERIOD_S
    smooths and steps by its share of a period (a longer one counts as one period)."""
    prev = previous or PoolState()
    share = min(max(elapsed_s, 0.0), RECOMPUTE_PERIOD_S) / RECOMPUTE_PERIOD_S
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
    alpha = policy.ewma_alpha
    if share < 1.0 and alpha < 1.0:
        alpha = 1.0 - (1.0 - alpha) ** share  # n short steps smooth as much as one period
    smoothed = smooth(prev_scores, raw, alpha)
    # Neutral endpoints sit at the median of the scored ones: neither favoured nor starved.
    median = median_or_neutral(list(smoothed.values()))
    smoothed.update({ep: median for ep in neutral_why})

    target = proportional_weights(smoothed, policy.max_weight)
    step = max(1, round(policy.max_step * policy.max_weight * share))
    stepped = limit_step(prev.weights, target, step)
    # Hysteresis judges where the weights are going, not this recompute's step: a step
    # smaller than the hysteresis (a short recompute, or a small max_step) would else never
    # move anything.
    push = previous is None or needs_push(
        prev.weights, target, policy.hysteresis, policy.max_weight
    )
    weights = stepped if push else dict(prev.weights)

    reasons = {ep: f"excluded: {why}" for ep, why in result.excluded.items()}
    for ep, sc in scores.items():
        reasons[ep] = _reason(ep, sc, smoothed[ep], weights[ep], neutral_why.get(ep))
    decision = PoolDecision(weights=weights, scores=scores, reasons=reasons, push=push)
    return decision, PoolState(scores=smoothed, weights=weights)
