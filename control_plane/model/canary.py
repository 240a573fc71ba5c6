"""SLO-gated canary: move a model's traffic to a new version step by step, or back at once.

A ``CanaryRun`` is an immutable value; ``judge`` takes one and what telemetry says about the
two versions now, and returns the next one (pure, no I/O, no clock of its own). The run
advances through ``policy.steps`` (percent of traffic on the canary), each held for at least
``dwell_s`` and only with enough evidence (``min_requests`` canary requests in the telemetry
window). It rolls back to 0% the first time the canary breaches the SLA (P99 above the model's
``sla_p99_ms``, error rate above ``max_error_rate``), does worse than the stable version by
more than the margins, or is READY nowhere; but a breach the stable version shares (with
evidence of its own) holds the run where it is instead: a host-wide slowdown is not the
canary's doing. Every transition is kept in ``history``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

RUNNING, PROMOTED, ROLLED_BACK, ABORTED = "running", "promoted", "rolled_back", "aborted"
MAX_HISTORY = 100


@dataclass(frozen=True)
class CanaryPolicy:
    """How a canary progresses (topology ``models[].canary``; the admin API may override)."""

    steps: tuple[int, ...] = (10, 25, 50, 100)  # percent on the canary; rising, ends at 100
    dwell_s: float = 30.0  # at least this long on each step
    max_error_rate: float = 0.01  # the canary's error rate may not exceed this (0..1)
    p99_margin: float = 1.25  # canary P99 <= margin x stable P99 (when the stable has evidence)
    error_margin: float = 0.01  # canary error rate <= stable's + margin
    min_requests: int = 20  # requests of a version in the window before it is judged


def policy_errors(policy: CanaryPolicy) -> list[str]:
    """Every problem with a policy, as 'field: message' lines (empty: valid)."""
    errors = []
    steps = policy.steps
    if not steps or any(not 1 <= s <= 100 for s in steps):
        errors.append(f"steps: must be percentages in 1..100, got {list(steps)}")
    elif any(b <= a for a, b in itertools.pairwise(steps)) or steps[-1] != 100:
        errors.append(f"steps: must rise and end at 100, got {list(steps)}")
    if policy.dwell_s < 0:
        errors.append(f"dwell_s: must be >= 0, got {policy.dwell_s}")
    if not 0 <= policy.max_error_rate <= 1:
        errors.append(f"max_error_rate: must be in 0..1, got {policy.max_error_rate}")
    if policy.p99_margin < 1:
        errors.append(f"p99_margin: must be >= 1, got {policy.p99_margin}")
    if not 0 <= policy.error_margin <= 1:
        errors.append(f"error_margin: must be in 0..1, got {policy.error_margin}")
    if policy.min_requests < 1:
        errors.append(f"min_requests: must be >= 1, got {policy.min_requests}")
    return errors


POLICY_FIELDS = ("steps", "dwell_s", "max_error_rate", "p99_margin", "error_margin", "min_requests")


def parse_policy(
    body: Mapping[str, object], base: CanaryPolicy, path: str = ""
) -> tuple[CanaryPolicy, list[str]]:
    """``base`` with the fields of ``body`` (topology YAML or an admin request) applied, and
    every error found, each prefixed with ``path`` (e.g. "models[0].canary.")."""
    errors: list[str] = []
    values: dict[str, Any] = {}
    for key, value in body.items():
        if key not in POLICY_FIELDS:
            errors.append(f"{path}{key}: unknown key (expected one of: {', '.join(POLICY_FIELDS)})")
        elif key == "steps":
            if isinstance(value, list) and value and all(_is_int(v) for v in value):
                values[key] = tuple(value)
            else:
                errors.append(f"{path}steps: must be a list of integer percentages, got {value!r}")
        elif key == "min_requests":
            if _is_int(value):
                values[key] = value
            else:
                errors.append(f"{path}min_requests: must be an integer, got {value!r}")
        elif (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        ):
            values[key] = float(value)
        else:
            errors.append(f"{path}{key}: must be a number, got {value!r}")
    policy = dataclasses.replace(base, **values)
    errors += [f"{path}{e}" for e in policy_errors(policy) if e.split(":")[0] in values]
    return policy, errors


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class VersionStats:
    """One model version across every endpoint, over the telemetry window."""

    requests: float = 0.0
    p99_ms: float | None = None
    error_rate: float | None = None

    def describe(self) -> str:
        p99 = "n/a" if self.p99_ms is None else f"{self.p99_ms:.0f} ms"
        errors = "n/a" if self.error_rate is None else f"{self.error_rate:.1%}"
        return f"p99 {p99}, errors {errors}, {self.requests:.0f} requests"


@dataclass(frozen=True)
class CanaryRun:
    model: str
    stable: str
    canary: str
    policy: CanaryPolicy
    sla_p99_ms: float
    started_at: float  # monotonic
    status: str = RUNNING
    step: int = 0  # index into policy.steps
    step_started_at: float = 0.0  # monotonic
    reason: str = "started"
    history: tuple[dict[str, Any], ...] = ()

    @property
    def percent(self) -> int:
        """The canary's share of the model's traffic now."""
        if self.status == RUNNING:
            return self.policy.steps[self.step]
        return 100 if self.status == PROMOTED else 0

    @property
    def finished(self) -> bool:
        return self.status != RUNNING

    def split(self) -> tuple[tuple[str, int], ...]:
        """The version split to push: (version, weight) pairs in version order."""
        pairs = ((self.stable, 100 - self.percent), (self.canary, self.percent))
        return tuple(sorted(pairs, key=lambda p: int(p[0])))

    def as_json(self, now: float) -> dict[str, Any]:
        return {
            "model": self.model,
            "stable": self.stable,
            "canary": self.canary,
            "status": self.status,
            "percent": self.percent,
            "step": f"{self.step + 1}/{len(self.policy.steps)}",
            "on_step_s": round(now - self.step_started_at, 1) if not self.finished else None,
            "reason": self.reason,
            "policy": {**dataclasses.asdict(self.policy), "steps": list(self.policy.steps)},
            "history": list(self.history),
        }


def start(
    model: str, stable: str, canary: str, policy: CanaryPolicy, sla_p99_ms: float, now: float,
    wall: float,
) -> CanaryRun:  # fmt: skip
    run = CanaryRun(model, stable, canary, policy, sla_p99_ms, now, step_started_at=now)
    reason = f"canary v{canary} against stable v{stable}: {policy.steps[0]}% first"
    return _record(run, wall, reason)


def abort(run: CanaryRun, wall: float, reason: str) -> CanaryRun:
    """Stops a running canary and sends every request to the stable version."""
    if run.finished:
        return run
    return _record(dataclasses.replace(run, status=ABORTED), wall, reason)


def over_sla(run: CanaryRun, stats: VersionStats) -> dict[str, str]:
    """The limits ``stats`` is over ("errors", "p99"), each in words."""
    policy, over = run.policy, {}
    if stats.error_rate is not None and stats.error_rate > policy.max_error_rate:
        over["errors"] = f"error rate {stats.error_rate:.1%} > SLA {policy.max_error_rate:.1%}"
    if stats.p99_ms is not None and stats.p99_ms > run.sla_p99_ms:
        over["p99"] = f"p99 {stats.p99_ms:.0f} ms > SLA {run.sla_p99_ms:g} ms"
    return over


def shared_breach(run: CanaryRun, canary: VersionStats, stable: VersionStats) -> str | None:
    """Why the canary holds where it is: every limit it is over, the stable version (with
    evidence) is over too. A host-wide slowdown, or clients sending bad requests to both, is
    not the canary's doing; the relative margins still judge it against the stable version."""
    if canary.requests < run.policy.min_requests or stable.requests < run.policy.min_requests:
        return None
    mine, theirs = over_sla(run, canary), over_sla(run, stable)
    if not mine or mine.keys() - theirs.keys():
        return None
    kind = next(iter(mine))
    return f"{mine[kind]}, as is stable v{run.stable}'s ({theirs[kind]}): not the canary's doing"


def breach(run: CanaryRun, canary: VersionStats, stable: VersionStats) -> str | None:
    """Why the canary must roll back now, in words; None while it behaves."""
    policy = run.policy
    if canary.requests < policy.min_requests:
        return None  # too little evidence either way
    over = over_sla(run, canary)
    if over:  # a limit the stable version (with evidence) is over too holds instead (judge)
        theirs = over_sla(run, stable) if stable.requests >= policy.min_requests else {}
        own = [text for kind, text in over.items() if kind not in theirs]
        if own:
            return own[0]
    if stable.requests < policy.min_requests:
        return None
    if (
        canary.p99_ms is not None
        and stable.p99_ms is not None
        and canary.p99_ms > policy.p99_margin * stable.p99_ms
    ):
        return (
            f"p99 {canary.p99_ms:.0f} ms > {policy.p99_margin:g} x stable v{run.stable}'s "
            f"{stable.p99_ms:.0f} ms"
        )
    if (
        canary.error_rate is not None
        and stable.error_rate is not None
        and canary.error_rate > stable.error_rate + policy.error_margin
    ):
        return (
            f"error rate {canary.error_rate:.1%} > stable v{run.stable}'s "
            f"{stable.error_rate:.1%} + {policy.error_margin:.1%}"
        )
    return None


def judge(
    run: CanaryRun,
    canary: VersionStats,
    stable: VersionStats,
    canary_ready: bool,
    now: float,
    wall: float,
) -> CanaryRun:
    """The run after looking at the versions now (the same object when nothing changed)."""
    if run.finished:
        return run
    reason = breach(run, canary, stable)
    if not canary_ready:
        reason = f"v{run.canary} is READY on no endpoint"
    if reason is not None:
        rolled_back = dataclasses.replace(run, status=ROLLED_BACK)
        return _record(rolled_back, wall, f"rolled back at {run.percent}%: {reason}", canary)
    policy = run.policy
    shared = shared_breach(run, canary, stable)
    if shared is not None:  # the step's dwell starts again once the breach clears
        holding = f"holding at {run.percent}%: {shared}"
        held = dataclasses.replace(run, reason=holding, step_started_at=now)
        if run.reason.startswith(f"holding at {run.percent}%: ") and run.reason.endswith(
            "not the canary's doing"
        ):
            return held  # still held: the history has it once
        return _record(held, wall, holding, canary)
    if now - run.step_started_at < policy.dwell_s:
        return run
    if canary.requests < policy.min_requests:
        waiting = (
            f"holding at {run.percent}%: {canary.requests:.0f} of {policy.min_requests} "
            "canary requests in the window"
        )
        return run if run.reason == waiting else dataclasses.replace(run, reason=waiting)
    if run.step + 1 >= len(policy.steps):
        promoted = dataclasses.replace(run, status=PROMOTED)
        return _record(promoted, wall, f"promoted after {run.percent}%: {canary.describe()}")
    advanced = dataclasses.replace(run, step=run.step + 1, step_started_at=now)
    reason = f"{run.percent}% -> {advanced.percent}%: {canary.describe()}"
    return _record(advanced, wall, reason, canary)


def _record(
    run: CanaryRun, wall: float, reason: str, stats: VersionStats | None = None
) -> CanaryRun:
    entry: dict[str, Any] = {
        "at": round(wall, 3),
        "status": run.status,
        "percent": run.percent,
        "reason": reason,
    }
    if stats is not None:
        entry["canary"] = dataclasses.asdict(stats)
    history = (*run.history, entry)[-MAX_HISTORY:]
    return dataclasses.replace(run, reason=reason, history=history)
