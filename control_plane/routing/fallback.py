"""Fallback while a model's circuit is open: the control plane's half of the degradation path.

Envoy falls back by itself when a model's pool has no healthy endpoint (an aggregate cluster,
see ``control_plane.xds.protection``), but it cannot fall back when a circuit breaker overflows: it
answers UNAVAILABLE. So the control plane watches Envoy's overflow counters (OTLP stat sink);
when a model with a fallback had requests refused between Envoy's last two reports, its routes
go to the fallback's pool for a hold time (5 s, doubling on each trip within a minute, at most
60 s), then back to the model's own pool: a circuit breaker's open -> half-open -> closed, one
level up. Every change is a decision with its reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from control_plane.config.topology import Topology
from control_plane.model.mesh import model_cluster
from control_plane.routing.router import record_decision

HOLD_S = 5.0
MAX_HOLD_S = 60.0
TRIPS_FORGOTTEN_AFTER_S = 60.0
WATCH_INTERVAL_S = 0.5  # how often the circuits are judged


@dataclass(frozen=True)
class CircuitState:
    open_until: float = 0.0  # monotonic; while now < open_until the fallback serves
    trips: int = 0
    last_trip: float = -math.inf

    def is_open(self, now: float) -> bool:
        return now < self.open_until


def step(state: CircuitState, overflows: float, now: float) -> tuple[CircuitState, str | None]:
    """The next state after seeing ``overflows`` refused requests; and why it changed."""
    if overflows > 0 and not state.is_open(now):
        recent = now - state.last_trip < TRIPS_FORGOTTEN_AFTER_S
        trips = state.trips + 1 if recent else 1
        hold = min(MAX_HOLD_S, HOLD_S * 2 ** (trips - 1))
        reason = (
            f"circuit open: {overflows:.0f} requests refused by the circuit breaker; "
            f"fallback serves for {hold:g} s"
        )
        return CircuitState(now + hold, trips, now), reason
    if state.open_until and not state.is_open(now):
        return dataclasses.replace(state, open_until=0.0), "circuit closed: own pool serves again"
    return state, None


class Fallbacks:
    """Per model with a fallback: its circuit as the control plane sees it."""

    def __init__(self, decisions: deque[dict[str, Any]]) -> None:
        self.states: dict[str, CircuitState] = {}
        self._decisions = decisions

    async def watch_forever(
        self,
        topology: Callable[[], Topology],
        overflows: Callable[[set[str], float], float],
        on_change: Callable[[list[str]], None],
    ) -> None:
        """Every WATCH_INTERVAL_S: each circuit judged on Envoy's recent overflows, and
        ``on_change`` told of the models whose circuit opened or closed."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            changed = self.tick(topology(), overflows, time.monotonic(), time.time())
            if changed:
                on_change(changed)

    def tick(
        self,
        topology: Topology,
        overflows: Callable[[set[str], float], float],
        now: float,
        wall: float,
    ) -> list[str]:
        """Steps every model that has a fallback (``overflows(clusters, now)``: requests its
        clusters refused lately); returns those whose routes must change."""
        changed = []
        for model in topology.models:
            if model.fallback is None:
                continue
            prefix = model_cluster(model.name)
            clusters = {prefix, *(model_cluster(model.name, v) for v, _ in model.version_split)}
            before = self.states.get(model.name, CircuitState())
            after, reason = step(before, overflows(clusters, now), now)
            self.states[model.name] = after
            if reason is not None:  # opened or closed: the routes change
                record_decision(self._decisions, model.name, reason, wall)
                changed.append(model.name)
        return changed

    def open_models(self, now: float) -> set[str]:
        return {name for name, state in self.states.items() if state.is_open(now)}

    def as_json(self, now: float) -> dict[str, Any]:
        return {
            name: {
                "open": state.is_open(now),
                "open_for_s": round(max(0.0, state.open_until - now), 1),
                "trips": state.trips,
            }
            for name, state in sorted(self.states.items())
        }
