"""Slow start: an endpoint that joins or returns ramps linearly to its full weight."""

from __future__ import annotations

from collections.abc import Mapping

# Start at a tenth of the weight rather than zero: EDS weights must stay >= 1 and a tiny share
# of traffic is what warms the endpoint (and refreshes its telemetry).
SLOW_START_FLOOR = 0.1


def slow_start_factor(
    since: float | None, now: float, duration_s: float, floor: float = SLOW_START_FLOOR
) -> float:
    """A factor in (0, 1]: floor at `since`, rising linearly to 1 after duration_s."""
    if since is None or duration_s <= 0:
        return 1.0
    elapsed = now - since
    if elapsed >= duration_s:
        return 1.0
    if elapsed <= 0:  # clock skew or a join stamped in the future: stay at the floor
        return floor
    return floor + (1.0 - floor) * (elapsed / duration_s)


def apply_slow_start(
    weights: Mapping[str, int],
    joined_at: Mapping[str, float],
    now: float,
    duration_s: float,
) -> dict[str, int]:
    """Scale each weight by its endpoint's ramp; an endpoint missing from joined_at is at full
    weight. A result is never below 1 (Envoy treats weight 0 as invalid)."""
    out: dict[str, int] = {}
    for endpoint, weight in weights.items():
        factor = slow_start_factor(joined_at.get(endpoint), now, duration_s)
        out[endpoint] = max(1, int(weight * factor + 0.5))
    return out
