"""Step 5: one pure decision for one model pool.

filter -> score -> combine -> smooth (EWMA on the combined score) -> proportional integer
weights -> needs_push (the target vs the last pushed weights) -> limit_step toward it. When no
push is needed the decision keeps the previously pushed weights, so small wobbles never reach
Envoy.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from control_plane.scoring.filters import filter_pool
from control_plane.scoring.scorers import SCORERS, EndpointScore, combine, scorer_weights
from control_plane.scoring.types import RECOMPUTE_PERIOD_S, EndpointSignals, PoolPolicy
from control_plane.scoring.weights import limit_step, needs_push, proportional_weights, smooth

NEUTRAL_WHEN_NONE_SCORED = 0.5


@dataclass(frozen=True)
class PoolState:
    """What one decision hands to the next for the same pool."""

    scores: Mapping[str, float] = field(default_factory=dict)  # smoothed combined scores
    weights: Mapping[str, int] = field(default_factory=dict)  # last pushed weights
    # Each scored endpoint's raw score with the signals it was combined from, under
    # ``policy``: the next decision keeps a score whose endpoint's signals are the same object
    # (routing hands an endpoint's signals on while its telemetry has not changed), so a pool
    # where one endpoint moved combines one score, not the pool's.
    combined: Mapping[str, tuple[EndpointSignals, EndpointScore]] = field(default_factory=dict)
    policy: PoolPolicy | None = None


@dataclass(frozen=True)
class PoolDecision:
    weights: dict[str, int]  # routed endpoints only; excluded ones get no weight
    scores: dict[str, EndpointScore]  # this round's raw scores (neutral ones: score None)
    push: bool
    excluded: Mapping[str, str]  # endpoint -> why it is not routed, in words
    smoothed: Mapping[str, float]  # every routed endpoint's smoothed score
    neutral_why: Mapping[str, str]  # routed at the pool's median: why

    # In words when asked (GET /status): building them at every decision was a twentieth of a
    # recompute of every pool.
    @functools.cached_property
    def reasons(self) -> dict[str, str]:
        """Every endpoint's weight or exclusion, in words."""
        reasons = {ep: f"excluded: {why}" for ep, why in self.excluded.items()}
        for ep, sc in self.scores.items():
            reasons[ep] = _reason(
                ep, sc, self.smoothed[ep], self.weights[ep], self.neutral_why.get(ep)
            )
        return reasons


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
    ejected: Collection[str] = (),
) -> tuple[PoolDecision, PoolState]:
    """``elapsed_s``: since the pool's previous decision; one sooner than RECOMPUTE_PERIOD_S
    smooths and steps by its share of a period (a longer one counts as one period).
    ``ejected``: endpoints the ejection decision takes out (UNHEALTHY). They are still scored
    and weighted, but set neither the best score nor the neutral median: an ejected server
    gets no traffic, so its idle QPS headroom and missing P99 would make it the best, and the
    served ones would share a few weight units where rounding and hysteresis hide them."""
    prev = previous or PoolState()
    share = min(max(elapsed_s, 0.0), RECOMPUTE_PERIOD_S) / RECOMPUTE_PERIOD_S
    result = filter_pool(signals, policy)
    weights_by_scorer = scorer_weights(policy)
    # A pool-relative scorer in use changes every score when any endpoint moves.
    keep = prev.policy == policy and not any(
        s.reads_pool and weights_by_scorer[s.name] > 0 for s in SCORERS
    )
    before = prev.combined if keep else {}
    combined: dict[str, tuple[EndpointSignals, EndpointScore]] = {}
    scores: dict[str, EndpointScore] = {}
    for s in result.scored:
        kept = before.get(s.endpoint)
        if kept is None or (kept[0] is not s and kept[0] != s):
            kept = (s, combine(s, result.scored, policy, weights=weights_by_scorer))
        elif kept[0] is not s:
            kept = (s, kept[1])  # equal signals: compared by identity from now on
        combined[s.endpoint] = kept
        scores[s.endpoint] = kept[1]
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
    median = median_or_neutral([v for ep, v in smoothed.items() if ep not in ejected])
    smoothed.update({ep: median for ep in neutral_why})

    target = proportional_weights(smoothed, policy.max_weight, ejected)
    step = max(1, round(policy.max_step * policy.max_weight * share))
    stepped = limit_step(prev.weights, target, step)
    # Hysteresis judges where the weights are going, not this recompute's step: a step
    # smaller than the hysteresis (a short recompute, or a small max_step) would else never
    # move anything.
    push = previous is None or needs_push(
        prev.weights, target, policy.hysteresis, policy.max_weight
    )
    weights = stepped if push else dict(prev.weights)

    decision = PoolDecision(weights, scores, push, result.excluded, smoothed, neutral_why)
    return decision, PoolState(smoothed, weights, combined, policy)
