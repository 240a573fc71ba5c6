"""Step 1: decide which endpoints of a pool are scored, kept neutral, or excluded.

Not-ready and draining endpoints are excluded from routing (the caller sets their health).
A stale endpoint is only filtered out of SCORING: its telemetry cannot be trusted, so it
keeps routing at a neutral score (the pool's median), never zero, because missing telemetry
is not evidence that the endpoint is bad.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from control_plane.scoring.types import EndpointSignals

Dropped = dict[str, str]


@dataclass(frozen=True)
class _Filter:
    """Drops the endpoints for which the signal named in `consumes` is set to `drop_when`."""

    name: str
    consumes: tuple[str, ...]
    reason: str
    drop_when: bool

    def drops(self, endpoint: EndpointSignals) -> bool:
        return bool(getattr(endpoint, self.consumes[0])) is self.drop_when

    def apply(self, signals: Sequence[EndpointSignals]) -> tuple[list[EndpointSignals], Dropped]:
        kept = [s for s in signals if not self.drops(s)]
        dropped = {s.endpoint: self.reason for s in signals if self.drops(s)}
        return kept, dropped


NOT_READY = _Filter("not_ready", ("ready",), "model not READY", drop_when=False)
DRAINING = _Filter("draining", ("draining",), "server reports draining", drop_when=True)
STALE = _Filter("stale", ("stale",), "telemetry stale", drop_when=True)

# Filters that remove an endpoint from routing, in order; the first that drops it names the
# reason. STALE is not among them: it only moves an endpoint to the neutral list.
EXCLUDING_FILTERS: tuple[_Filter, ...] = (NOT_READY, DRAINING)


@dataclass(frozen=True)
class FilterResult:
    scored: list[EndpointSignals]  # routed, with a score from their telemetry
    neutral: list[str]  # routed at the pool's median score (telemetry stale)
    excluded: dict[str, str]  # not routed: endpoint -> reason in words


def filter_pool(signals: Sequence[EndpointSignals]) -> FilterResult:
    """Split one pool; exclusion wins over staleness (a stale draining endpoint is excluded)."""
    kept = list(signals)
    excluded: Dropped = {}
    for f in EXCLUDING_FILTERS:
        kept, dropped = f.apply(kept)
        excluded.update(dropped)
    scored, stale = STALE.apply(kept)
    return FilterResult(scored=scored, neutral=list(stale), excluded=excluded)
