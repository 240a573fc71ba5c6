"""The SLO-gated canary: policy parsing, every transition of a run, and the admin requests."""

from __future__ import annotations

from collections import deque
from http import HTTPStatus
from typing import Any

import pytest

from control_plane.admin.api import REFUSAL_STATUS
from control_plane.config.topology import TopologyError, parse_topology
from control_plane.metrics import ControlPlaneMetrics
from control_plane.model import canary
from control_plane.model.canary import CanaryPolicy, CanaryRun, VersionStats, judge, parse_policy
from control_plane.routing.canary_runs import CanaryRejected, CanaryRuns
from control_plane.telemetry.values import Signal, VersionTelemetry

POLICY = CanaryPolicy(steps=(10, 50, 100), dwell_s=5, min_requests=20)
GOOD = VersionStats(requests=100, p99_ms=20, error_rate=0.0)
STABLE = VersionStats(requests=500, p99_ms=20, error_rate=0.0)


def started(policy: CanaryPolicy = POLICY) -> CanaryRun:
    return canary.start("classifier", "1", "2", policy, 50.0, now=0.0, wall=1000.0)


# -- policy -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"steps": [50, 10, 100]}, "steps: must rise and end at 100, got [50, 10, 100]"),
        ({"steps": [10, 50]}, "steps: must rise and end at 100, got [10, 50]"),
        ({"steps": [0, 100]}, "steps: must be percentages in 1..100, got [0, 100]"),
        ({"steps": []}, "steps: must be a list of integer percentages, got []"),
        ({"steps": ["10", 100]}, "steps: must be a list of integer percentages, got ['10', 100]"),
        ({"dwell_s": -1}, "dwell_s: must be >= 0, got -1.0"),
        ({"dwell_s": True}, "dwell_s: must be a number, got True"),
        ({"max_error_rate": 2}, "max_error_rate: must be in 0..1, got 2.0"),
        ({"p99_margin": 0.5}, "p99_margin: must be >= 1, got 0.5"),
        ({"error_margin": float("nan")}, "error_margin: must be a number, got nan"),
        ({"min_requests": 1.5}, "min_requests: must be an integer, got 1.5"),
        ({"min_requests": 0}, "min_requests: must be >= 1, got 0"),
        ({"dwel_s": 3}, "dwel_s: unknown key (expected one of: steps, dwell_s, max_error_rate"),
    ],
)
def test_bad_policy_fields_are_named(body: dict[str, Any], error: str) -> None:
    _, errors = parse_policy(body, CanaryPolicy(), "canary.")
    assert len(errors) == 1 and errors[0].startswith(f"canary.{error}"), errors


def test_policy_fields_override_the_base() -> None:
    policy, errors = parse_policy({"steps": [20, 100], "dwell_s": 2, "min_requests": 5}, POLICY)
    assert errors == []
    assert policy == CanaryPolicy(steps=(20, 100), dwell_s=2.0, min_requests=5)


def test_topology_canary_section() -> None:
    model = {"name": "classifier", "sla_p99_ms": 50, "capacity_qps": 100}
    topology = parse_topology({"models": [{**model, "canary": {"steps": [5, 100], "dwell_s": 1}}]})
    assert topology.canary_policy("classifier") == CanaryPolicy(steps=(5, 100), dwell_s=1.0)
    with pytest.raises(TopologyError) as raised:
        parse_topology({"models": [{**model, "canary": {"steps": [5], "p99_margin": 0}}]})
    assert raised.value.errors == (
        "models[0].canary.steps: must rise and end at 100, got [5]",
        "models[0].canary.p99_margin: must be >= 1, got 0.0",
    )


# -- judging ----------------------------------------------------------------------------------
def test_a_healthy_canary_climbs_each_step_after_its_dwell() -> None:
    run = started()
    assert (run.percent, run.split()) == (10, (("1", 90), ("2", 10)))
    assert judge(run, GOOD, STABLE, True, now=4.9, wall=1004.9) is run  # still dwelling
    run = judge(run, GOOD, STABLE, True, now=5.0, wall=1005.0)
    assert (run.percent, run.status, run.step_started_at) == (50, canary.RUNNING, 5.0)
    run = judge(run, GOOD, STABLE, True, now=10.0, wall=1010.0)
    assert run.percent == 100 and run.split() == (("1", 0), ("2", 100))
    run = judge(run, GOOD, STABLE, True, now=15.0, wall=1015.0)
    assert (run.status, run.percent, run.finished) == (canary.PROMOTED, 100, True)
    assert [h["percent"] for h in run.history] == [10, 50, 100, 100]
    assert run.history[1]["reason"] == "10% -> 50%: p99 20 ms, errors 0.0%, 100 requests"
    assert judge(run, VersionStats(100, 999, 1.0), STABLE, False, 99.0, 1099.0) is run


@pytest.mark.parametrize(
    ("canary_stats", "stable_stats", "reason"),
    [
        (VersionStats(100, 20, 0.2), STABLE, "error rate 20.0% > SLA 1.0%"),
        (VersionStats(100, 80, 0.0), STABLE, "p99 80 ms > SLA 50 ms"),
        (VersionStats(100, 30, 0.0), STABLE, "p99 30 ms > 1.25 x stable v1's 20 ms"),
        (
            VersionStats(100, 20, 0.009),
            VersionStats(500, 20, 0.0),
            None,  # within both the SLA and the margin
        ),
        (VersionStats(100, 30, 0.0), VersionStats(5, 10, 0.0), None),  # stable: no evidence
        (VersionStats(10, 999, 1.0), STABLE, None),  # canary: no evidence yet
    ],
)
def test_breaches_roll_back_at_once(
    canary_stats: VersionStats, stable_stats: VersionStats, reason: str | None
) -> None:
    run = started()
    after = judge(run, canary_stats, stable_stats, True, now=0.5, wall=1000.5)
    if reason is None:
        assert after is run
        return
    assert (after.status, after.percent) == (canary.ROLLED_BACK, 0)
    assert after.split() == (("1", 100), ("2", 0))
    assert after.reason == f"rolled back at 10%: {reason}"
    assert after.history[-1]["canary"]["p99_ms"] == canary_stats.p99_ms


def test_error_margin_against_the_stable_version() -> None:
    policy = CanaryPolicy(steps=(10, 100), max_error_rate=0.5, error_margin=0.02, min_requests=20)
    stable = VersionStats(500, 20, 0.10)
    assert (
        judge(started(policy), VersionStats(100, 20, 0.11), stable, True, 1, 1).status == "running"
    )
    after = judge(started(policy), VersionStats(100, 20, 0.13), stable, True, 1, 1)
    assert after.reason == "rolled back at 10%: error rate 13.0% > stable v1's 10.0% + 2.0%"


def test_a_breach_the_stable_version_shares_holds_the_step_instead_of_rolling_back() -> None:
    """A host-wide slowdown (both versions over the SLA, the canary within the margin) rolled
    the canary back on the code before: "p99 62 ms > SLA 50 ms"."""
    slow_host = VersionStats(500, 60, 0.0)
    run = judge(started(), VersionStats(100, 62, 0.0), slow_host, True, now=6, wall=1006)
    assert (run.status, run.percent, run.step_started_at) == (canary.RUNNING, 10, 6)
    assert run.reason == (
        "holding at 10%: p99 62 ms > SLA 50 ms, as is stable v1's (p99 60 ms > SLA 50 ms): "
        "not the canary's doing"
    )
    assert len(run.history) == 2  # the hold is recorded once ...
    run = judge(run, VersionStats(100, 64, 0.0), slow_host, True, now=7, wall=1007)
    assert len(run.history) == 2 and run.step_started_at == 7  # ... and its dwell restarts
    assert judge(run, GOOD, STABLE, True, now=11, wall=1011).percent == 10  # dwelling again
    assert judge(run, GOOD, STABLE, True, now=12, wall=1012).percent == 50
    # Worse than the stable version by more than the margin still rolls back.
    worse = judge(started(), VersionStats(100, 90, 0.0), slow_host, True, now=6, wall=1006)
    assert worse.reason == "rolled back at 10%: p99 90 ms > 1.25 x stable v1's 60 ms"
    # A breach the stable version does not share rolls back: errors here, slowness there.
    errors = judge(started(), VersionStats(100, 62, 0.05), slow_host, True, now=6, wall=1006)
    assert errors.reason == "rolled back at 10%: error rate 5.0% > SLA 1.0%"
    # Without evidence of the stable version's own, the absolute limits stand.
    alone = judge(started(), VersionStats(100, 62, 0.0), VersionStats(5, 60, 0.0), True, 6, 1006)
    assert alone.reason == "rolled back at 10%: p99 62 ms > SLA 50 ms"


def test_a_canary_that_disappears_rolls_back() -> None:
    after = judge(started(), VersionStats(), STABLE, False, now=0.5, wall=1000.5)
    assert after.status == canary.ROLLED_BACK
    assert after.reason == "rolled back at 10%: v2 is READY on no endpoint"


def test_without_evidence_it_holds_and_says_why() -> None:
    run = judge(started(), VersionStats(3, 20, 0.0), STABLE, True, now=6, wall=1006)
    assert (run.percent, run.status) == (10, canary.RUNNING)
    assert run.reason == "holding at 10%: 3 of 20 canary requests in the window"
    assert len(run.history) == 1  # holding is not a step
    assert judge(run, VersionStats(3, 20, 0.0), STABLE, True, now=7, wall=1007) is run


def test_abort_sends_everything_to_stable() -> None:
    run = canary.abort(started(), 1001.0, "aborted by an operator")
    assert (run.status, run.split()) == (canary.ABORTED, (("1", 100), ("2", 0)))
    assert canary.abort(run, 1002.0, "again") is run


# -- the admin requests -----------------------------------------------------------------------
def runs() -> tuple[CanaryRuns, deque[dict[str, Any]], ControlPlaneMetrics]:
    decisions: deque[dict[str, Any]] = deque()
    metrics = ControlPlaneMetrics()
    return CanaryRuns(decisions, metrics), decisions, metrics


TOPOLOGY = parse_topology(
    {
        "models": [
            {"name": "classifier", "sla_p99_ms": 50, "capacity_qps": 100,
             "canary": {"steps": [10, 100], "dwell_s": 1}},
        ]
    }
)  # fmt: skip


@pytest.mark.parametrize(
    ("model", "body", "status", "message"),
    [
        ("nope", {"version": "2"}, HTTPStatus.NOT_FOUND, "model 'nope' is not in the topology"),
        ("classifier", {}, HTTPStatus.BAD_REQUEST, "version: required"),
        ("classifier", {"version": "two"}, HTTPStatus.BAD_REQUEST, "version: expected a version"),
        ("classifier", {"version": True}, HTTPStatus.BAD_REQUEST, "version: expected a version"),
        ("classifier", {"version": "3"}, HTTPStatus.CONFLICT, "version: classifier v3 is READY"),
        ("classifier", {"version": "2", "stable": "2"}, HTTPStatus.BAD_REQUEST, "stable: must"),
        ("classifier", {"version": "2", "stable": 7}, HTTPStatus.CONFLICT, "stable: v7 is READY"),
        ("classifier", {"version": 2, "dwell_s": "x"}, HTTPStatus.BAD_REQUEST, "dwell_s: must"),
        ("classifier", {"abort": True}, HTTPStatus.CONFLICT, "no canary of classifier"),
        ("classifier", {"abort": "yes"}, HTTPStatus.BAD_REQUEST, "abort: expected"),
    ],
)
def test_bad_requests_get_a_clear_status(
    model: str, body: dict[str, Any], status: HTTPStatus, message: str
) -> None:
    canaries, decisions, _ = runs()
    with pytest.raises(CanaryRejected) as raised:
        canaries.request(TOPOLOGY, model, body, (), {"1", "2"}, 0.0, 1000.0)
    status_sent = REFUSAL_STATUS[raised.value.refusal]  # what the admin API answers
    assert status_sent == status and str(raised.value).startswith(message)
    assert canaries.runs == {} and not decisions


def test_start_tick_and_record() -> None:
    canaries, decisions, metrics = runs()
    run = canaries.request(TOPOLOGY, "classifier", {"version": "2"}, (), {"1", "2"}, 0.0, 1000.0)
    assert (run.stable, run.canary, run.percent, run.policy.steps) == ("1", "2", 10, (10, 100))
    with pytest.raises(CanaryRejected) as raised:
        canaries.request(TOPOLOGY, "classifier", {"version": "2"}, (), {"1", "2"}, 0.1, 1000.1)
    assert REFUSAL_STATUS[raised.value.refusal] == HTTPStatus.CONFLICT
    seen = {
        "2": VersionTelemetry(100, Signal(20, 0.1), Signal(0.0, 0.1)),
        "1": VersionTelemetry(900, Signal(20, 0.1), Signal(0.0, 0.1)),
    }
    assert canaries.tick({"classifier": seen}, lambda m, v: True, 0.5, 1000.5) == []
    assert canaries.tick({"classifier": seen}, lambda m, v: True, 1.0, 1001.0) == ["classifier"]
    assert canaries.runs["classifier"].percent == 100
    assert [d["decision"] for d in decisions] == [
        "canary: canary v2 against stable v1: 10% first (v1=90 v2=10)",
        "canary: 10% -> 100%: p99 20 ms, errors 0.0%, 100 requests (v1=0 v2=100)",
    ]
    assert metrics.canary_percent.labels("classifier")._value.get() == 100
    started_count = metrics.canary_transitions.labels("classifier", "started")._value.get()
    assert started_count == 1


def test_stable_defaults_to_the_version_with_the_most_traffic() -> None:
    canaries, _, _ = runs()
    split = (("1", 20), ("2", 80), ("3", 0))
    run = canaries.request(TOPOLOGY, "classifier", {"version": 3}, split, {"1", "2", "3"}, 0, 0)
    assert run.stable == "2"
    assert canaries.abort("classifier", "an operator set the version split", 1.0)
    assert canaries.runs["classifier"].status == canary.ABORTED
    run = canaries.request(TOPOLOGY, "classifier", {"version": "2"}, (), {"1", "2", "5"}, 2, 2)
    assert run.stable == "5"  # no split: the newest other READY version
