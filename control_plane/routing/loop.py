"""Routing's own loop: telemetry turned into weights and ejections, and Envoy's checks into
the clusters it does not check, then a rebuild asked for when either moved.

It runs every ROUTING_INTERVAL_S, or sooner when telemetry moved (``wake``, set by the
telemetry shards), never within ROUTING_MIN_GAP_S of the last run. Ticking whenever telemetry
arrives (at most every 0.1 s) was measured not to help on a loaded host: the same median, a
longer tail and more idle CPU at 1,000 endpoints (bench_scale.py, an earlier build). With
telemetry shards only telemetry that moved (rare at rest) wakes routing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from control_plane.config.topology import Topology
from control_plane.discovery.placement import EndpointReport, Reports
from control_plane.metrics import ControlPlaneMetrics
from control_plane.model.mesh import EndpointAddress, MeshState, cluster_model
from control_plane.routing import partitions
from control_plane.routing.envoy_checks import changes, checked_down_by_model
from control_plane.routing.router import Router
from control_plane.scoring.types import RECOMPUTE_PERIOD_S
from control_plane.telemetry.envoy import EnvoyStats
from control_plane.telemetry.readings import TelemetryReadings

log = logging.getLogger("control_plane")
ROUTING_INTERVAL_S = RECOMPUTE_PERIOD_S
ROUTING_MIN_GAP_S = 0.1


async def ticks_or_wakes(
    wake: asyncio.Event, interval: float, min_gap: float, run: Callable[[], Awaitable[None]]
) -> None:
    """Runs ``run`` ``interval`` after the last run ended, or once ``wake`` is set but no
    sooner than ``min_gap`` after it (routing: at rest nothing moves and the tick is all
    there is; a change waits for the gap, not for the tick). Forever."""
    loop = asyncio.get_running_loop()
    while True:
        ended = loop.time()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), interval)
        await asyncio.sleep(max(0.0, ended + min_gap - loop.time()))
        wake.clear()
        await run()


class RoutingLoop:
    def __init__(
        self,
        router: Router,
        telemetry: TelemetryReadings,
        envoy_stats: EnvoyStats,
        metrics: ControlPlaneMetrics,
        topology: Callable[[], Topology],
        reports: Callable[[], Reports],
        mesh_state: Callable[[], MeshState | None],
        on_change: Callable[[str], None],
        last_reachable: Callable[[], Mapping[EndpointAddress, EndpointReport]] = dict,
    ) -> None:
        self.router = router
        self.telemetry = telemetry
        self.envoy_stats = envoy_stats
        self.metrics = metrics
        self._topology = topology
        self._reports = reports
        self._mesh_state = mesh_state
        self._on_change = on_change  # asks for a rebuild, with the reason
        self.wake = asyncio.Event()  # telemetry moved: recompute before the next tick
        # listener.health_checks: model: the endpoints Envoy's checks find down, per model
        self.checked_down: dict[str, frozenset[EndpointAddress]] = {}
        self._last_reachable = last_reachable
        # Unreachable from here, reached by Envoy: kept on their last report (partitions)
        self.held: dict[EndpointAddress, EndpointReport] = {}

    def reports(self) -> Reports:
        """The placement reports routing and the clusters are built from: the poller's, with
        each held endpoint's last reachable report in place."""
        return partitions.with_held(self._reports(), self.held)

    def refresh_held(self, now: float) -> bool:
        """Re-reads which unreachable endpoints Envoy still finds healthy. True (and logged as
        decisions) when that changed."""
        held = partitions.held_endpoints(
            self._reports(),
            self._last_reachable(),
            lambda keys, max_age_s: self.envoy_stats.checks_pass(keys, now, max_age_s),
            self.held,
        )
        if held == self.held:
            return False
        for report, words in partitions.changes(self.held, held):
            for model in sorted({m for m, _ in report.ready_models}):
                self.router.log(model, words, time.time())
            log.warning("%s", words)
        self.held = held
        return True

    async def run_forever(self) -> None:
        await ticks_or_wakes(self.wake, ROUTING_INTERVAL_S, ROUTING_MIN_GAP_S, self.once)

    async def once(self) -> None:
        now = time.monotonic()
        telemetry = await asyncio.to_thread(self.telemetry.snapshot, now, False)
        held = self.refresh_held(now)
        started = time.perf_counter()
        topology = self._topology()
        # Every hedged model's share in one pass, and none read when no model hedges
        shares = self._retry_shares(now) if any(m.hedging for m in topology.models) else {}
        result = self.router.recompute(topology, telemetry, self.reports(), now, shares.get)
        self.metrics.routing_recompute.observe(time.perf_counter() - started)
        self.metrics.routing_pools.labels("computed").inc(result.pools_computed)
        self.metrics.routing_pools.labels("skipped").inc(result.pools_skipped)
        for cause in result.new_ejections:
            self.metrics.ejections.labels(cause).inc()
        checks = self._follow_envoy_checks(now)
        if result.changed or checks or held:
            why = (
                "telemetry-driven weights or ejections"
                if result.changed
                else "Envoy's checks"
                if checks
                else "endpoints held on Envoy's word"
            )
            self._on_change(why)

    def _retry_shares(self, now: float) -> dict[str, float | None]:
        """Envoy's retries per first try to each model's clusters over the window (hedging's
        guard); empty before the first mesh state."""
        state = self._mesh_state()
        if state is None:
            return {}
        clusters_by_model: dict[str, list[str]] = {}
        for cluster in state.clusters:
            if (model := cluster_model(cluster)) is not None:
                clusters_by_model.setdefault(model, []).append(cluster)
        return self.envoy_stats.retry_shares(clusters_by_model, now)

    def _follow_envoy_checks(self, now: float) -> bool:
        """With ``listener.health_checks: model``: what Envoy's checks of each model's own
        cluster find, for its other clusters. True when that changed (logged as decisions)."""
        found: dict[str, frozenset[EndpointAddress]] = {}
        state = self._mesh_state()
        if self._topology().listener.health_checks == "model" and state is not None:
            unhealthy = self.envoy_stats.checked_down(now)
            if unhealthy or self.checked_down:
                found = checked_down_by_model(unhealthy, state.clusters)
        if found == self.checked_down:
            return False
        for model, words in changes(self.checked_down, found):
            self.router.log(model, words, time.time())
            log.info("%s: %s", model, words)
        self.checked_down = found
        return True
