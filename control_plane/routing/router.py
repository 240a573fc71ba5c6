"""Telemetry-driven routing: per model pool, weights and ejections from what endpoints report.

Every recompute turns the telemetry store's view and the placement into ``EndpointSignals``
per pool, runs the scoring pipeline (filters -> scorers -> weights) and the ejection rules,
applies slow start to endpoints that (re)joined, and keeps what it decided and why. The control
plane pushes only when a pool's decision says so (hysteresis), so noise does not churn Envoy.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from control_plane.config.topology import Topology
from control_plane.discovery.placement import EndpointReport
from control_plane.model.lanes import fleet_labels
from control_plane.model.mesh import EndpointAddress, EndpointHealth
from control_plane.routing.hedging import (
    HedgeState,
    PerTry,
    follow,
    pool_p99_ms,
)
from control_plane.routing.signals import SignalsMade, pool_signals, ready_members
from control_plane.scoring.at_rest import at_rest, signals_moved
from control_plane.scoring.ejection import (
    UNHEALTHY,
    EjectionCause,
    EjectionDecision,
    EjectionState,
    decide_ejections,
)
from control_plane.scoring.filters import REQUIRED_LABELS
from control_plane.scoring.pipeline import PoolDecision, PoolState, decide_pool
from control_plane.scoring.slow_start import apply_slow_start
from control_plane.scoring.types import RECOMPUTE_PERIOD_S, EndpointSignals, Labels, PoolPolicy
from control_plane.scoring.weights import needs_push
from control_plane.telemetry.values import EndpointTelemetry

MAX_DECISIONS = 500


@dataclass
class PoolMemory:
    """What one pool's previous recompute left behind."""

    state: PoolState | None = None
    ejections: dict[str, EjectionState] = field(default_factory=dict)
    joined_at: dict[str, float] = field(default_factory=dict)  # for slow start
    probation: set[str] = field(default_factory=set)  # back from a latency ejection
    weights: dict[EndpointAddress, int] = field(default_factory=dict)
    health: dict[EndpointAddress, EndpointHealth] = field(default_factory=dict)
    explanation: Explanation | None = None  # the last recompute's values, see explain()
    # The signals and policy of the last recompute when it left the pool at rest (else None):
    # while neither moves, the pool is not recomputed.
    rest: tuple[list[EndpointSignals], PoolPolicy] | None = None
    computed_at: float | None = None  # the time of the last recompute
    hedging: HedgeState = field(default_factory=HedgeState)  # routing.hedging


def _probation(
    memory: PoolMemory,
    signals: list[EndpointSignals],
    states: Mapping[str, EjectionState],
    policy: PoolPolicy,
    now: float,
) -> set[str]:
    """Endpoints back from a latency ejection keep weight 1 (a trickle that measures them)
    until their p99 is within the SLA, or no worse than the rest of the pool's median (an
    ejection is relative to the pool, so is the way back: when every server is over the SLA,
    one kept at 1 is capacity lost and no safer); then slow start ramps them up from then.

    Every median leaves out the endpoints on probation as this recompute found them: one that
    leaves does not count in the next one's, so the outcome does not depend on the order
    (a set's, which PYTHONHASHSEED sets: two replicas could disagree)."""
    by_endpoint = {s.endpoint: s for s in signals}
    found = frozenset(memory.probation)
    for endpoint in sorted(found):
        signal = by_endpoint.get(endpoint)
        state = states.get(endpoint)
        if signal is None or state is None or state.ejected:
            memory.probation.discard(endpoint)  # gone, or out again (a new back-off)
        elif signal.p99_ms is not None and signal.p99_ms <= max(
            policy.sla_p99_ms, _others_p99_ms(endpoint, signals, states, found)
        ):
            memory.probation.discard(endpoint)
            memory.joined_at[endpoint] = now
    return set(memory.probation)


def _others_p99_ms(
    endpoint: str,
    signals: list[EndpointSignals],
    states: Mapping[str, EjectionState],
    probation: frozenset[str],
) -> float:
    """The median p99 of the pool's serving endpoints but ``endpoint`` and those on probation
    (0 when none reports one)."""
    kept = [
        s.p99_ms
        for s in signals
        if s.endpoint != endpoint
        and s.endpoint not in probation
        and s.p99_ms is not None
        and not s.stale
        and (state := states.get(s.endpoint)) is not None
        and not state.ejected
    ]
    return statistics.median(kept) if kept else 0.0


@functools.lru_cache(maxsize=1 << 16)
def _address(key: str) -> EndpointAddress:
    host, _, port = key.rpartition(":")
    return EndpointAddress(host.strip("[]"), int(port))


def record_decision(decisions: deque[dict[str, Any]], pool: str, text: str, wall: float) -> None:
    """One entry of ``GET /decisions`` (routing, canaries and circuits share one log)."""
    decisions.append({"at": round(wall, 3), "pool": pool, "decision": text})


@dataclass(frozen=True)
class RecomputeResult:
    """What one ``Router.recompute`` did, as values (the decisions' words are in the log)."""

    changed: bool  # Envoy should be told (weights, health or labels moved)
    new_ejections: tuple[str, ...]  # one cause label per endpoint newly ejected
    pools_computed: int
    pools_skipped: int  # at rest: nothing it reads moved past its tolerance


class Router:
    def __init__(self) -> None:
        self.pools: dict[str, PoolMemory] = {}
        self.decisions: deque[dict[str, Any]] = deque(maxlen=MAX_DECISIONS)
        self.labels: dict[str, Labels] = {}  # every endpoint's, as of the last recompute
        self.pools_computed = 0  # pools recomputed, and skipped at rest, since the start
        self.pools_skipped = 0
        self._made: SignalsMade = {}  # the last recompute's signals, by model and endpoint
        # The reports last seen and their ready members (see recompute).
        self._members_of: tuple[object, dict[str, list[EndpointAddress]]] = (None, {})

    def log(self, pool: str, event: str, now_wall: float) -> None:
        """A decision about ``pool`` that is not routing's own (an operator's split, Envoy's
        checks), in the same log."""
        record_decision(self.decisions, pool, event, now_wall)

    def recompute(
        self,
        topology: Topology,
        telemetry: Mapping[str, EndpointTelemetry],
        reports: Mapping[EndpointAddress, EndpointReport],
        now: float,
        retry_share: Callable[[str], float | None] | None = None,
    ) -> RecomputeResult:
        """Updates every pool's weights and health; what it did (``changed``: Envoy should
        be told). ``reports`` is replaced, not changed in place, between calls (as placement
        does). ``retry_share(model)``: Envoy's retries per first try to the model's clusters
        (hedging's guard)."""
        changed = False
        wall = time.time()
        new_ejections: list[str] = []
        computed, skipped = self.pools_computed, self.pools_skipped
        # Placement replaces its reports mapping when a report changes and never changes one it
        # handed out, so the members are derived once per mapping (a sort of the whole fleet:
        # half of a recompute at rest at 10,000 endpoints).
        if reports is not self._members_of[0]:
            self._members_of = (reports, ready_members(reports))
        members = self._members_of[1]
        reported = {key: t.labels for key, t in telemetry.items() if t.labels}
        labels = fleet_labels(topology.endpoint_labels, reported)
        if labels != self.labels:
            self.labels = labels
            changed = True  # lanes and placement rules move endpoints between clusters
        made: tuple[SignalsMade, SignalsMade] = (self._made, {})
        for model in topology.models:
            memory = self.pools.setdefault(model.name, PoolMemory())
            policy = topology.policy(model.name)
            signals = pool_signals(model.name, telemetry, reports, members, labels, made)
            if model.hedging is None and memory.hedging.per_try:  # turned off (a reload)
                memory.hedging, changed = HedgeState(), True
            rest = memory.rest
            tolerance = policy.recompute_tolerance
            # A hedged pool is never at rest: its guard moves with time (the P99 window, the
            # calm before a boost is undone) and with Envoy's retry share, not with signals.
            if (
                model.hedging is None
                and rest
                and rest[1] == policy
                and not signals_moved(rest[0], signals, tolerance)
            ):
                self.pools_skipped += 1
                continue
            self.pools_computed += 1
            previous = (memory.state, memory.ejections)
            last, memory.computed_at = memory.computed_at, now
            elapsed = RECOMPUTE_PERIOD_S if last is None else now - last
            # Ejection, its share cap and failing open judge the pool the model is routed to:
            # endpoints its placement rule leaves out are not in it.
            pool = signals
            if policy.require_labels:
                pool = [s for s in signals if not REQUIRED_LABELS.mismatch(s, policy)]
            window = topology.telemetry.window_s  # what error rates and P99s are read over
            ejection = decide_ejections(pool, policy, memory.ejections, now, window)
            out = {ep for ep, h in ejection.health.items() if h == UNHEALTHY}  # not the scale
            decision, memory.state = decide_pool(signals, policy, memory.state, elapsed, out)
            for event in ejection.events:
                self.log(model.name, event, wall)
            for endpoint in ejection.states.keys() - memory.ejections.keys():
                memory.joined_at[endpoint] = now  # new, or back after leaving: ramp up
            for endpoint in memory.joined_at.keys() - ejection.states.keys():
                del memory.joined_at[endpoint]  # left the pool (not ready, removed)
            for endpoint, before in memory.ejections.items():
                after = ejection.states.get(endpoint)
                if before.draining and after is not None and not after.draining:
                    memory.joined_at[endpoint] = now  # back from draining: ramp up again
                if before.ejected and after is not None and not after.ejected:
                    memory.joined_at[endpoint] = now  # returning: ramp up again
                    if EjectionCause.LATENCY in before.causes:
                        memory.probation.add(endpoint)
            for endpoint, now_state in ejection.states.items():
                was = memory.ejections.get(endpoint)
                if now_state.ejected and (was is None or not was.ejected):
                    new_ejections.append(ejection_cause(now_state.causes))
            memory.ejections = dict(ejection.states)
            p99 = pool_p99_ms(pool, ejection.health)  # hedging from the pool's healthy P99
            hedged = retry_share(model.name) if model.hedging and retry_share else None
            hedging = follow(model.hedging, model.sla_p99_ms, p99, now, memory.hedging, hedged)
            if (hedge := hedging.per_try) != memory.hedging.per_try:
                self.log(model.name, f"hedging: {hedge.why if hedge else 'off'}", wall)
                changed = True
            memory.hedging = hedging
            on_probation = _probation(memory, signals, ejection.states, policy, now)
            ramped = apply_slow_start(decision.weights, memory.joined_at, now, policy.slow_start_s)
            ramped.update({ep: 1 for ep in on_probation if ep in ramped})
            weights = {_address(k): v for k, v in ramped.items()}
            health = {_address(k): EndpointHealth(v) for k, v in ejection.health.items()}
            # A ramp that ended since the last recompute (probation's too: its end starts one)
            # is pushed whatever the size of its last move: under the hysteresis, a weight of
            # 11 or less ramping from 1 was never pushed, and at rest it stayed at 1 for good.
            settled = last is not None and any(
                last < t + policy.slow_start_s <= now for t in memory.joined_at.values()
            )
            pushed = settled and weights != memory.weights
            pushed = pushed or self._push_wanted(policy, memory, weights, health)
            if pushed:
                self.log(model.name, f"weights {_describe(weights)}", wall)
                memory.weights, memory.health = weights, health
                changed = True
            # Explained when asked (GET /status), from this recompute's values: building the
            # words for every endpoint of every computed pool was a tenth of a recompute.
            memory.explanation = (signals, decision, ejection, on_probation, ramped, policy,
                                  memory.weights)  # fmt: skip
            outcome = (memory.state, memory.ejections)
            still = at_rest(previous, outcome, memory.joined_at, on_probation, policy, now)
            memory.rest = (signals, policy) if still else None
        for gone in self.pools.keys() - {m.name for m in topology.models}:
            del self.pools[gone]  # removed by a reload: not routed, and it starts anew if back
        self._made = made[1]
        return RecomputeResult(
            changed, tuple(new_ejections), self.pools_computed - computed,
            self.pools_skipped - skipped,
        )  # fmt: skip

    @staticmethod
    def _push_wanted(
        policy: PoolPolicy,
        memory: PoolMemory,
        weights: dict[EndpointAddress, int],
        health: dict[EndpointAddress, EndpointHealth],
    ) -> bool:
        """Compares what would be pushed now (slow start applied) with what was pushed last.

        The pool decision alone cannot say: its weights stay put while a slow-start ramp
        moves the pushed ones, so judging by it would leave a ramp stuck at its first step.
        """
        if health != memory.health or weights.keys() != memory.weights.keys():
            return True
        before = {a.key: w for a, w in memory.weights.items()}
        after = {a.key: w for a, w in weights.items()}
        return needs_push(before, after, policy.hysteresis, policy.max_weight)

    def pool_weights(self) -> dict[str, dict[EndpointAddress, int]]:
        return {name: dict(m.weights) for name, m in self.pools.items()}

    def pool_hedges(self) -> dict[str, PerTry]:
        """Per model, the per-try timeout telemetry set (hedged models with a P99 only)."""
        return {n: h for n, m in self.pools.items() if (h := m.hedging.per_try) is not None}

    def pool_health(self) -> dict[str, dict[EndpointAddress, EndpointHealth]]:
        return {name: dict(m.health) for name, m in self.pools.items()}

    def explain(self) -> dict[str, Any]:
        pools = sorted(self.pools.items())
        return {name: _explain(m.explanation, m.hedging.per_try) for name, m in pools}


Explanation = tuple[
    list[EndpointSignals], PoolDecision, EjectionDecision, set[str], dict[str, int], PoolPolicy,
    dict[EndpointAddress, int],
]  # fmt: skip


def _explain(explanation: Explanation | None, hedge: PerTry | None = None) -> dict[str, Any]:
    """Each endpoint's score, weight, health and why, in words; the hedging in force."""
    if explanation is None:
        return {}
    if hedge is not None:
        return {**_explain(explanation), "hedging": dataclasses.asdict(hedge)}
    signals, decision, ejection, on_probation, ramped, policy, weights = explanation
    return {
        "endpoints": {
            s.endpoint: {
                "score": _round(decision.scores.get(s.endpoint)),
                "weight": weights.get(_address(s.endpoint)),
                "health": ejection.health.get(s.endpoint, "HEALTHY"),
                # what a reader (the live view) goes by; "reason" is for people
                "state": _state(s.endpoint, on_probation, decision, ramped),
                "reason": _reason(s.endpoint, decision, ejection.health, ejection.reasons)
                + (
                    f", probation: weight 1 until p99 <= SLA {policy.sla_p99_ms:g} ms or the "
                    "rest of the pool's median"
                    if s.endpoint in on_probation
                    else _ramp(decision.weights.get(s.endpoint), ramped.get(s.endpoint))
                )
                + _pushed(ramped.get(s.endpoint), weights.get(_address(s.endpoint))),
            }
            for s in signals
        },
        "fail_open": ejection.fail_open,
    }


def _round(score: Any) -> float | None:
    value = getattr(score, "score", score)
    return None if value is None else round(float(value), 3)


def _describe(weights: Mapping[EndpointAddress, int]) -> str:
    return ", ".join(f"{a.key}={w}" for a, w in sorted(weights.items())) or "none"


def _reason(
    endpoint: str, decision: PoolDecision, health: Mapping[str, str], ejections: Mapping[str, str]
) -> str:
    """Why the endpoint has its weight or health, in words."""
    if health.get(endpoint, "HEALTHY") != "HEALTHY":
        return ejections.get(endpoint, "")
    weight_reason = decision.reasons.get(endpoint, "")
    ejection_reason = ejections.get(endpoint, "")
    if ejection_reason.startswith("would eject"):  # held back by the share cap: say both
        return f"{weight_reason}; {ejection_reason}"
    return weight_reason


def _state(
    endpoint: str, on_probation: set[str], decision: PoolDecision, ramped: Mapping[str, int]
) -> str:
    """ "probation", "slow_start" or "" (the live view's words for the rest come from health)."""
    if endpoint in on_probation:
        return "probation"
    computed, now = decision.weights.get(endpoint), ramped.get(endpoint)
    return "slow_start" if computed is not None and now is not None and computed != now else ""


def _ramp(computed: int | None, ramped: int | None) -> str:
    if computed is None or ramped is None or computed == ramped:
        return ""
    return f", slow start -> {ramped}"


def _pushed(computed: int | None, pushed: int | None) -> str:
    if computed is None or pushed is None or computed == pushed:
        return ""
    return f"; pushed {pushed} (moves within the hysteresis wait)"


def ejection_cause(causes: frozenset[EjectionCause]) -> str:
    """One label for metrics, the first of memory, latency, errors (else "other")."""
    for cause in (EjectionCause.MEMORY, EjectionCause.LATENCY, EjectionCause.ERRORS):
        if cause in causes:
            return cause.value
    return "other"
