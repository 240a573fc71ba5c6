"""Step 4: turn scores into integer EDS weights, smoothly and without needless pushes."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping


def _round_half_up(x: float) -> int:
    # Python's round() is banker's rounding; half-up keeps the mapping monotone and predictable.
    return math.floor(x + 0.5)


def proportional_weights(
    scores: Mapping[str, float], max_weight: int, unscaled: Collection[str] = ()
) -> dict[str, int]:
    """Best endpoint gets max_weight, the others round(score / best x max_weight), at least 1.

    Each weight is rounded on its own (no largest-remainder): there is no fixed total to hit,
    so independent rounding already keeps every ratio within half a unit and is monotone in the
    score (a higher score never gets a lower weight). A routed endpoint never gets 0, since EDS
    weight 0 would silently take it out of rotation. All scores 0 (or below): all equal.
    ``unscaled`` (ejected endpoints) get a weight but do not set ``best``: Envoy sends them
    nothing, so their idle headroom must not squeeze the others into a few units.
    """
    if max_weight < 1:
        raise ValueError(f"max_weight must be >= 1, got {max_weight}")
    best = max((s for ep, s in scores.items() if ep not in unscaled), default=0.0)
    if best <= 0:
        return {ep: max(1, max_weight // 2) for ep in scores}
    return {
        ep: min(max_weight, max(1, _round_half_up(max(0.0, s) / best * max_weight)))
        for ep, s in scores.items()
    }


def smooth(
    previous: Mapping[str, float], current: Mapping[str, float], alpha: float
) -> dict[str, float]:
    """EWMA alpha x current + (1 - alpha) x previous; new endpoints take the current value.

    Endpoints only in `previous` are gone from the pool and are dropped.
    """
    return {
        ep: v if ep not in previous else alpha * v + (1.0 - alpha) * previous[ep]
        for ep, v in current.items()
    }


def limit_step(
    previous: Mapping[str, int], target: Mapping[str, int], max_step_weight: int
) -> dict[str, int]:
    """Move each weight toward its target by at most max_step_weight; new ones go to target."""
    step = max(0, max_step_weight)
    out: dict[str, int] = {}
    for ep, want in target.items():
        if ep not in previous:
            out[ep] = want
            continue
        have = previous[ep]
        out[ep] = have + max(-step, min(step, want - have))
    return out


def needs_push(
    previous: Mapping[str, int], new: Mapping[str, int], hysteresis: float, max_weight: int
) -> bool:
    """True when the endpoint set changed or a weight moved by more than hysteresis x max_weight."""
    if set(previous) != set(new):
        return True
    threshold = hysteresis * max_weight
    return any(abs(new[ep] - previous[ep]) > threshold for ep in new)
