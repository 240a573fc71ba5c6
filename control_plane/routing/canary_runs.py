"""The control plane's canaries: operator requests, one judgement per tick, and their record.

``CanaryRuns`` keeps one ``CanaryRun`` per model (the latest; a finished run stays visible
until the next one starts). It validates the admin API's requests, asks telemetry about the
canary and stable versions on every tick and returns the models whose version split changed;
the control plane puts ``run.split()`` in place and rebuilds the snapshot.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from typing import Any

from control_plane.config.topology import Topology
from control_plane.metrics import ControlPlaneMetrics
from control_plane.model import canary
from control_plane.model.canary import CanaryRun, VersionStats
from control_plane.routing.router import record_decision
from control_plane.telemetry.values import VersionTelemetry

REQUEST_FIELDS = ("version", "stable", "abort")
JUDGE_INTERVAL_S = 0.5  # how often running canaries are judged


class Refusal(enum.Enum):
    """Why a canary request is refused (the admin API answers 400, 404 and 409)."""

    INVALID = "invalid"  # the request itself is malformed
    UNKNOWN = "unknown"  # no such model
    CONFLICT = "conflict"  # the mesh's state does not allow it now


class CanaryRejected(Exception):
    """A canary request that cannot be carried out; the message names the field and why."""

    def __init__(self, refusal: Refusal, message: str) -> None:
        super().__init__(message)
        self.refusal = refusal


def version_stats(seen: VersionTelemetry | None) -> VersionStats:
    if seen is None:
        return VersionStats()
    p99 = seen.p99_ms.value if seen.p99_ms is not None else None
    errors = seen.error_rate.value if seen.error_rate is not None else None
    return VersionStats(seen.requests, p99, errors)


def _version(value: object, field: str) -> str:
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(text, str) or not text.isdigit():
        raise CanaryRejected(Refusal.INVALID, f'{field}: expected a version number like "2"')
    return str(int(text))


class CanaryRuns:
    def __init__(self, decisions: deque[dict[str, Any]], metrics: ControlPlaneMetrics) -> None:
        self.runs: dict[str, CanaryRun] = {}
        self._decisions = decisions
        self._metrics = metrics

    def running(self, model: str) -> CanaryRun | None:
        run = self.runs.get(model)
        return run if run is not None and not run.finished else None

    def request(
        self,
        topology: Topology,
        model: str,
        body: Mapping[str, Any],
        split: tuple[tuple[str, int], ...],
        ready_versions: Collection[str],
        now: float,
        wall: float,
    ) -> CanaryRun:
        """Starts or aborts ``model``'s canary as the admin request asks (CanaryRejected if not)."""
        route = next((m for m in topology.models if m.name == model), None)
        if route is None:
            raise CanaryRejected(Refusal.UNKNOWN, f"model {model!r} is not in the topology")
        current = self.running(model)
        if body.get("abort", False) is not False:
            if body["abort"] is not True or set(body) != {"abort"}:
                raise CanaryRejected(Refusal.INVALID, 'abort: expected {"abort": true} alone')
            if current is None:
                raise CanaryRejected(Refusal.CONFLICT, f"no canary of {model} is running")
            return self._set(canary.abort(current, wall, "aborted by an operator"), wall)
        if "version" not in body:
            raise CanaryRejected(Refusal.INVALID, 'version: required, e.g. {"version": "2"}')
        version = _version(body["version"], "version")
        if current is not None:
            raise CanaryRejected(
                Refusal.CONFLICT,
                f"a canary of {model} (v{current.canary}) is running: abort it first",
            )
        if version not in ready_versions:
            raise CanaryRejected(
                Refusal.CONFLICT, f"version: {model} v{version} is READY on no endpoint"
            )
        stable = self._stable(body, version, split, ready_versions)
        fields = {k: v for k, v in body.items() if k not in REQUEST_FIELDS}
        policy, errors = canary.parse_policy(fields, topology.canary_policy(model))
        if errors:
            raise CanaryRejected(Refusal.INVALID, "; ".join(errors))
        run = canary.start(model, stable, version, policy, route.sla_p99_ms, now, wall)
        return self._set(run, wall)

    def abort(self, model: str, reason: str, wall: float) -> bool:
        """Stops ``model``'s running canary, if any (its split is the caller's to replace)."""
        run = self.running(model)
        if run is not None:
            self._set(canary.abort(run, wall, f"aborted: {reason}"), wall)
        return run is not None

    @staticmethod
    def _stable(
        body: Mapping[str, Any],
        version: str,
        split: tuple[tuple[str, int], ...],
        ready_versions: Collection[str],
    ) -> str:
        if "stable" in body:
            stable = _version(body["stable"], "stable")
            if stable not in ready_versions:
                raise CanaryRejected(Refusal.CONFLICT, f"stable: v{stable} is READY on no endpoint")
        else:  # the version with the most traffic now, else the newest other READY one
            weighted = sorted((w, int(v)) for v, w in split if v != version and w > 0)
            others = sorted(int(v) for v in ready_versions if v != version)
            if weighted:
                stable = str(weighted[-1][1])
            elif others:
                stable = str(others[-1])
            else:
                raise CanaryRejected(
                    Refusal.CONFLICT, "stable: no other READY version to compare against"
                )
        if stable == version:
            raise CanaryRejected(Refusal.INVALID, "stable: must differ from version")
        return stable

    async def judge_forever(
        self,
        stats_of: Callable[[list[str], float], Mapping[str, Mapping[str, VersionTelemetry]]],
        ready: Callable[[str, str], bool],
        on_step: Callable[[str, CanaryRun], None],
    ) -> None:
        """Every JUDGE_INTERVAL_S: the running canaries judged on their versions' telemetry
        (``stats_of``, read off the event loop), and ``on_step`` told of each that moved."""
        while True:
            await asyncio.sleep(JUDGE_INTERVAL_S)
            models = [m for m in self.runs if self.running(m)]
            if not models:
                continue
            now = time.monotonic()
            stats = await asyncio.to_thread(stats_of, models, now)
            for model in self.tick(stats, ready, now, time.time()):
                on_step(model, self.runs[model])

    def tick(
        self,
        stats: Mapping[str, Mapping[str, VersionTelemetry]],
        ready: Callable[[str, str], bool],
        now: float,
        wall: float,
    ) -> list[str]:
        """Judges every running canary by ``stats`` (model -> version -> telemetry); returns
        the models whose split changed."""
        changed = []
        for model, run in list(self.runs.items()):
            if run.finished:
                continue
            seen = stats.get(model, {})
            after = canary.judge(
                run,
                version_stats(seen.get(run.canary)),
                version_stats(seen.get(run.stable)),
                ready(model, run.canary),
                now,
                wall,
            )
            if after is not run:
                self._set(after, wall)
                if after.percent != run.percent or after.status != run.status:
                    changed.append(model)
        return changed

    def _set(self, run: CanaryRun, wall: float) -> CanaryRun:
        """Keeps ``run``; a new history entry also becomes a decision and a metric."""
        before = self.runs.get(run.model)
        self.runs[run.model] = run
        if run.history and (before is None or before.history[-1:] != run.history[-1:]):
            reason = run.history[-1]["reason"]
            split = " ".join(f"v{v}={w}" for v, w in run.split())
            record_decision(self._decisions, run.model, f"canary: {reason} ({split})", wall)
            outcome = run.status if run.finished else "advanced"
            if len(run.history) == 1:
                outcome = "started"
            self._metrics.canary_transitions.labels(run.model, outcome).inc()
        self._metrics.canary_percent.labels(run.model).set(run.percent)
        return run

    def as_json(self, now: float) -> dict[str, Any]:
        return {model: run.as_json(now) for model, run in sorted(self.runs.items())}
