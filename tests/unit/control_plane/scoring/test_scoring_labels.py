"""Table tests for device classes and labels: the required-labels filter, the labels scorer,
capacity per device class, memory normalised by what the model needs, and decide_pool."""

from __future__ import annotations

from typing import Any

import pytest

from control_plane.scoring.filters import filter_pool
from control_plane.scoring.pipeline import decide_pool
from control_plane.scoring.scorers import SCORERS, LabelScorer, MemoryScorer, QpsScorer, combine
from control_plane.scoring.types import (
    DEVICE_CLASS,
    EndpointSignals,
    LabelRule,
    Labels,
    PoolPolicy,
    ScoreWeights,
)

GB = 1e9
POLICY = PoolPolicy(capacity_qps=100.0, sla_p99_ms=100.0)
A100_ONLY: LabelRule = ((DEVICE_CLASS, ("a100",)),)
A100_OR_H100: LabelRule = ((DEVICE_CLASS, ("a100", "h100")),)
A100_IN_EAST: LabelRule = ((DEVICE_CLASS, ("a100",)), ("zone", ("us-east-1a",)))


def sig(endpoint: str = "a:1", labels: Labels = (), **kw: Any) -> EndpointSignals:
    return EndpointSignals(endpoint=endpoint, labels=labels, **kw)


def dc(device_class: str) -> Labels:
    return ((DEVICE_CLASS, device_class),)


# --- the required-labels filter ----------------------------------------------------------


@pytest.mark.parametrize(
    ("rule", "endpoint", "excluded_because"),
    [
        pytest.param((), sig(), None, id="no-requirement-keeps-unlabelled"),
        pytest.param(A100_OR_H100, sig(labels=dc("a100")), None, id="accepted"),
        pytest.param(A100_OR_H100, sig(labels=dc("h100")), None, id="accepted-second-value"),
        pytest.param(
            A100_OR_H100,
            sig(labels=dc("a10g")),
            "labels: device_class is a10g, needs one of a100, h100",
            id="wrong-value",
        ),
        pytest.param(
            A100_ONLY,
            sig(labels=(("zone", "us-east-1a"),)),
            "labels: device_class missing, needs one of a100",
            id="missing-label",
        ),
        pytest.param(
            A100_IN_EAST,
            sig(labels=(("device_class", "a100"), ("zone", "us-east-1a"))),
            None,
            id="several-all-met",
        ),
        pytest.param(
            A100_IN_EAST,
            sig(labels=(("device_class", "a100"), ("zone", "us-west-2b"))),
            "labels: zone is us-west-2b, needs one of us-east-1a",
            id="several-one-wrong",
        ),
        pytest.param(
            A100_IN_EAST,
            sig(labels=dc("cpu")),
            "labels: device_class is cpu, needs one of a100; zone missing, needs one of us-east-1a",
            id="several-all-wrong",
        ),
        pytest.param(
            A100_ONLY, sig(labels=dc("a10g"), ready=False), "model not READY", id="not-ready-wins"
        ),
        pytest.param(
            A100_ONLY,
            sig(labels=dc("a10g"), draining=True),
            "server reports draining",
            id="draining-wins",
        ),
        pytest.param(
            A100_ONLY,
            sig(labels=dc("a10g"), stale=True),
            "labels: device_class is a10g, needs one of a100",
            id="exclusion-wins-over-stale",
        ),
    ],
)
def test_required_labels_filter(
    rule: LabelRule, endpoint: EndpointSignals, excluded_because: str | None
) -> None:
    result = filter_pool([endpoint], PoolPolicy(100.0, 100.0, require_labels=rule))
    if excluded_because is None:
        assert result.excluded == {}
        assert [s.endpoint for s in result.scored] + result.neutral == [endpoint.endpoint]
    else:
        assert result.excluded == {endpoint.endpoint: excluded_because}
        assert result.scored == [] and result.neutral == []


def test_required_labels_can_exclude_the_whole_pool() -> None:
    policy = PoolPolicy(100.0, 100.0, require_labels=A100_ONLY)
    result = filter_pool([sig("a", labels=dc("cpu")), sig("b")], policy)
    assert result.scored == [] and result.neutral == []
    assert set(result.excluded) == {"a", "b"}


# --- the labels scorer -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefer", "labels", "expected"),
    [
        ((), dc("a100"), None),  # no preference: no opinion
        (A100_ONLY, dc("a100"), 1.0),
        (A100_ONLY, dc("a10g"), 0.0),
        (A100_ONLY, (), 0.0),  # missing label: not matched
        (A100_IN_EAST, (("device_class", "a100"), ("zone", "us-west-2b")), 0.5),
        (A100_IN_EAST, (("device_class", "a100"), ("zone", "us-east-1a")), 1.0),
        (A100_IN_EAST, (("zone", "us-east-1a"),), 0.5),
        (A100_IN_EAST, dc("cpu"), 0.0),
        (A100_OR_H100, dc("h100"), 1.0),  # any accepted value matches
    ],
)
def test_label_scorer_is_the_share_of_preferred_labels(
    prefer: LabelRule, labels: Labels, expected: float | None
) -> None:
    endpoint = sig(labels=labels)
    got = LabelScorer().score(endpoint, [endpoint], PoolPolicy(100.0, 100.0, prefer_labels=prefer))
    assert got == (None if expected is None else pytest.approx(expected))


def test_labels_count_only_with_a_weight() -> None:
    """Weight 0 by default: preferences do not change the score of an existing pool."""
    ep = sig(
        labels=dc("a10g"), qps=50.0, p99_ms=20.0, memory_used_bytes=1.0, memory_total_bytes=2.0
    )
    plain = combine(ep, [ep], POLICY)
    preferring = combine(ep, [ep], PoolPolicy(100.0, 100.0, prefer_labels=A100_ONLY))
    assert "labels" in [s.name for s in SCORERS]
    assert "labels" not in preferring.parts
    assert preferring.score == pytest.approx(plain.score)


def test_labels_weighted_without_preferences_drop_out() -> None:
    ep = sig(
        labels=dc("a100"), qps=50.0, p99_ms=20.0, memory_used_bytes=1.0, memory_total_bytes=2.0
    )
    got = combine(ep, [ep], PoolPolicy(100.0, 100.0, ScoreWeights(labels=0.5)))
    assert got.parts["labels"] is None
    assert got.score == pytest.approx(combine(ep, [ep], POLICY).score)


def test_labels_weighted_with_preferences_join_the_mean() -> None:
    ep = sig(
        labels=dc("a100"), qps=50.0, p99_ms=20.0, memory_used_bytes=1.0, memory_total_bytes=2.0
    )
    policy = PoolPolicy(100.0, 100.0, ScoreWeights(labels=0.2), prefer_labels=A100_ONLY)
    got = combine(ep, [ep], policy)
    assert got.parts["labels"] == 1.0
    assert got.score == pytest.approx((0.4 * 0.5 + 0.4 * 0.8 + 0.2 * 0.5 + 0.2 * 1.0) / 1.2)


# --- capacity per device class -----------------------------------------------------------

BY_CLASS = PoolPolicy(100.0, 100.0, capacity_by_class=(("a100", 3000.0), ("cpu", 200.0)))


@pytest.mark.parametrize(
    ("labels", "qps", "expected"),
    [
        (dc("a100"), 1500.0, 0.5),
        (dc("cpu"), 150.0, 0.25),
        (dc("a100"), 150.0, 0.95),  # same qps, different classes: different headroom
        (dc("cpu"), 150.0, 0.25),
        (dc("tpu"), 50.0, 0.5),  # a class the pool does not list: capacity_qps
        ((), 50.0, 0.5),  # no device class: capacity_qps
        (dc("cpu"), 400.0, 0.0),  # over its class's capacity: clamped
        (dc("a100"), None, None),
    ],
)
def test_qps_headroom_is_against_the_device_class_capacity(
    labels: Labels, qps: float | None, expected: float | None
) -> None:
    endpoint = sig(labels=labels, qps=qps)
    got = QpsScorer().score(endpoint, [endpoint], BY_CLASS)
    assert got == (None if expected is None else pytest.approx(expected))


# --- memory normalised by what the model needs -------------------------------------------


@pytest.mark.parametrize(
    ("need", "used", "total", "expected"),
    [
        pytest.param(10 * GB, 0.8 * 24 * GB, 24 * GB, 0.0, id="24GB-at-80%-below-need"),
        pytest.param(10 * GB, 0.8 * 80 * GB, 80 * GB, 6 / 70, id="80GB-at-80%"),
        pytest.param(10 * GB, 0.5 * 80 * GB, 80 * GB, 30 / 70, id="80GB-at-50%"),
        pytest.param(10 * GB, 0.5 * 24 * GB, 24 * GB, 2 / 14, id="24GB-at-50%"),
        pytest.param(10 * GB, 0.0, 80 * GB, 1.0, id="empty-card"),
        pytest.param(10 * GB, 0.0, 8 * GB, 0.0, id="card-smaller-than-need"),
        pytest.param(10 * GB, 0.0, 10 * GB, 0.0, id="card-exactly-the-need"),
        pytest.param(10 * GB, 90 * GB, 80 * GB, 0.0, id="over-full-clamped"),
        pytest.param(10 * GB, None, 80 * GB, None, id="used-missing"),
        pytest.param(10 * GB, 1 * GB, None, None, id="total-missing"),
        pytest.param(None, 0.8 * 24 * GB, 24 * GB, 0.2, id="no-need-24GB-at-80%"),
        pytest.param(None, 0.8 * 80 * GB, 80 * GB, 0.2, id="no-need-80GB-at-80%"),
        pytest.param(None, 3 * GB, 4 * GB, 0.25, id="no-need-used-share"),
    ],
)
def test_memory_headroom_beyond_the_model_need(
    need: float | None, used: float | None, total: float | None, expected: float | None
) -> None:
    endpoint = sig(memory_used_bytes=used, memory_total_bytes=total)
    got = MemoryScorer().score(
        endpoint, [endpoint], PoolPolicy(100.0, 100.0, memory_need_bytes=need)
    )
    assert got == (None if expected is None else pytest.approx(expected))


# --- decide_pool -------------------------------------------------------------------------


def healthy(endpoint: str, labels: Labels, qps: float = 50.0, **kw: Any) -> EndpointSignals:
    return sig(
        endpoint,
        labels=labels,
        qps=qps,
        p99_ms=20.0,
        memory_used_bytes=1.0,
        memory_total_bytes=2.0,
        **kw,
    )


def test_preferred_label_gets_more_weight_and_required_miss_none() -> None:
    policy = PoolPolicy(
        100.0,
        100.0,
        ScoreWeights(labels=0.2),
        require_labels=((DEVICE_CLASS, ("a100", "a10g")),),
        prefer_labels=A100_ONLY,
    )
    pool = [
        healthy("a100", dc("a100")),
        healthy("a10g", dc("a10g")),  # identical telemetry, not preferred
        healthy("cpu", dc("cpu")),  # not allowed at all
    ]
    decision, _ = decide_pool(pool, policy, None)
    # (0.4 x 0.5 + 0.4 x 0.8 + 0.2 x 0.5 + 0.2 x labels) / 1.2: 0.683 vs 0.517 -> 100 : 76
    assert decision.weights == {"a100": 100, "a10g": 76}
    assert "labels 1.00" in decision.reasons["a100"]
    assert "labels 0.00" in decision.reasons["a10g"]
    assert (
        decision.reasons["cpu"] == "excluded: labels: device_class is cpu, needs one of a100, a10g"
    )


def test_same_qps_weighs_more_on_the_bigger_device_class() -> None:
    policy = PoolPolicy(
        100.0,
        100.0,
        ScoreWeights(qps=1.0, latency=0.0, memory=0.0),
        capacity_by_class=BY_CLASS.capacity_by_class,
    )
    decision, _ = decide_pool(
        [healthy("a100", dc("a100"), qps=150.0), healthy("cpu", dc("cpu"), qps=150.0)], policy, None
    )
    # qps headroom 0.95 vs 0.25
    assert decision.weights == {"a100": 100, "cpu": 26}
