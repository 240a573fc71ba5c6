"""Step 1: decide which endpoints of a pool are scored, kept neutral, or excluded.

Not-ready and draining endpoints, and those without a label value the pool's placement rule
requires (``PoolPolicy.require_labels``), are excluded from routing (the caller sets their
health).
A stale endpoint is only filtered out of SCORING: its telemetry cannot be trusted, so it
keeps routing at a neutral score (the pool's median), never zero, because missing telemetry
is not evidence that the endpoint is bad.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from control_plane.scoring.types import EndpointSignals, PoolPolicy

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
        kept: list[EndpointSignals] = []
        dropped: Dropped = {}
        for s in signals:
            if self.drops(s):
                dropped[s.endpoint] = self.reason
            else:
                kept.append(s)
        return kept, dropped


NOT_READY = _Filter("not_ready", ("ready",), "model not READY", drop_when=False)
DRAINING = _Filter("draining", ("draining",), "server reports draining", drop_when=True)
STALE = _Filter("stale", ("stale",), "telemetry stale", drop_when=True)

# Filters that remove an endpoint from routing, in order; the first that drops it names the
# reason. STALE is not among them: it only moves an endpoint to the neutral list.
EXCLUDING_FILTERS: tuple[_Filter, ...] = (NOT_READY, DRAINING)


@dataclass(frozen=True)
class _RequiredLabelsFilter:
    """Drops the endpoints that lack a label value the pool's ``require_labels`` accepts.

    Unlike `_Filter` it reads the pool's policy: the rule is per model pool, the labels are
    per endpoint. Runs after EXCLUDING_FILTERS, so a not-ready or draining endpoint keeps
    that reason even when its labels are wrong too.
    """

    name: str = "labels"
    consumes: tuple[str, ...] = ("labels",)

    def mismatch(self, endpoint: EndpointSignals, policy: PoolPolicy) -> str | None:
        """Why the endpoint fails the requirement, in words; None when it meets it.

        Every required label that is missing or has a value outside its accepted list is
        named, e.g. "labels: device_class is a10g, needs one of a100, h100".
        """
        misses = []
        for label, accepted in policy.require_labels:
            value = endpoint.label(label)
            if value in accepted:
                continue
            has = "missing" if value is None else f"is {value}"
            misses.append(f"{label} {has}, needs one of {', '.join(accepted) or '(none)'}")
        return f"labels: {'; '.join(misses)}" if misses else None

    def apply(
        self, signals: Sequence[EndpointSignals], policy: PoolPolicy
    ) -> tuple[list[EndpointSignals], Dropped]:
        kept: list[EndpointSignals] = []
        dropped: Dropped = {}
        for s in signals:
            why = self.mismatch(s, policy)
            if why is None:
                kept.append(s)
            else:
                dropped[s.endpoint] = why
        return kept, dropped


REQUIRED_LABELS = _RequiredLabelsFilter()


@dataclass(frozen=True)
class FilterResult:
    scored: list[EndpointSignals]  # routed, with a score from their telemetry
    neutral: list[str]  # routed at the pool's median score (telemetry stale)
    excluded: dict[str, str]  # not routed: endpoint -> reason in words


def filter_pool(signals: Sequence[EndpointSignals], policy: PoolPolicy) -> FilterResult:
    """Split one pool; exclusion wins over staleness (a stale draining endpoint is excluded).

    Not ready, then draining, then the pool's required labels: the first that drops an
    endpoint names the reason. Every endpoint may be excluded (the caller handles an empty
    pool).
    """
    kept = list(signals)
    excluded: Dropped = {}
    for f in EXCLUDING_FILTERS:
        kept, dropped = f.apply(kept)
        excluded.update(dropped)
    kept, dropped = REQUIRED_LABELS.apply(kept, policy)
    excluded.update(dropped)
    scored, stale = STALE.apply(kept)
    return FilterResult(scored=scored, neutral=list(stale), excluded=excluded)
