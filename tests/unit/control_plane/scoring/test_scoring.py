"""Table tests for the scoring pipeline: filters, scorers, combine, weights, decide_pool."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from control_plane.scoring.filters import DRAINING, NOT_READY, STALE, filter_pool
from control_plane.scoring.pipeline import PoolState, decide_pool
from control_plane.scoring.scorers import (
    SCORERS,
    KvCacheScorer,
    LatencyScorer,
    MemoryScorer,
    QpsScorer,
    QueueScorer,
    Scorer,
    combine,
    errors_factor,
    kv_full_factor,
    over_sla_factor,
)
from control_plane.scoring.types import EndpointSignals, PoolPolicy, ScoreWeights
from control_plane.scoring.weights import limit_step, needs_push, proportional_weights, smooth

POLICY = PoolPolicy(capacity_qps=100.0, sla_p99_ms=100.0)
GiB = 1024.0**3


def sig(endpoint: str = "a:1", **kw: Any) -> EndpointSignals:
    return EndpointSignals(endpoint=endpoint, **kw)


# --- filters -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flt", "signals", "kept", "dropped"),
    [
        (NOT_READY, [sig("a", ready=True), sig("b", ready=False)], ["a"], {"b": "model not READY"}),
        (DRAINING, [sig("a"), sig("b", draining=True)], ["a"], {"b": "server reports draining"}),
        (STALE, [sig("a", stale=True), sig("b")], ["b"], {"a": "telemetry stale"}),
        (STALE, [], [], {}),
    ],
)
def test_filter_table(
    flt: Any, signals: list[EndpointSignals], kept: list[str], dropped: dict[str, str]
) -> None:
    got_kept, got_dropped = flt.apply(signals)
    assert [s.endpoint for s in got_kept] == kept
    assert got_dropped == dropped


def test_filters_declare_consumed_signals() -> None:
    assert NOT_READY.consumes == ("ready",)
    assert DRAINING.consumes == ("draining",)
    assert STALE.consumes == ("stale",)


def test_filter_pool_splits_scored_neutral_excluded() -> None:
    result = filter_pool(
        [
            sig("ok"),
            sig("stale", stale=True),
            sig("drain", draining=True),
            sig("notready", ready=False),
            sig("stale-drain", stale=True, draining=True),  # exclusion wins over staleness
        ],
        POLICY,
    )
    assert [s.endpoint for s in result.scored] == ["ok"]
    assert result.neutral == ["stale"]
    assert result.excluded == {
        "drain": "server reports draining",
        "notready": "model not READY",
        "stale-drain": "server reports draining",
    }


# --- scorers -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scorer", "endpoint", "expected"),
    [
        (QpsScorer(), sig(qps=25.0), 0.75),
        (QpsScorer(), sig(qps=0.0), 1.0),
        (QpsScorer(), sig(qps=250.0), 0.0),  # over capacity: clamped
        (QpsScorer(), sig(), None),
        (LatencyScorer(), sig(p99_ms=40.0), 0.6),
        (LatencyScorer(), sig(p99_ms=100.0), 0.0),
        (LatencyScorer(), sig(p99_ms=300.0), 0.0),  # p99 > SLA gives 0
        (LatencyScorer(), sig(), None),
        (MemoryScorer(), sig(memory_used_bytes=3 * GiB, memory_total_bytes=4 * GiB), 0.25),
        (MemoryScorer(), sig(memory_used_bytes=5 * GiB, memory_total_bytes=4 * GiB), 0.0),
        (MemoryScorer(), sig(memory_used_bytes=1 * GiB), None),
        (MemoryScorer(), sig(memory_total_bytes=4 * GiB), None),
        (KvCacheScorer(), sig(kv_blocks_used=10.0, kv_blocks_total=40.0), 0.75),
        (KvCacheScorer(), sig(kv_blocks_used=0.0, kv_blocks_total=0.0), None),
        (KvCacheScorer(), sig(kv_blocks_used=3.0), None),
    ],
)
def test_scorer_table(scorer: Scorer, endpoint: EndpointSignals, expected: float | None) -> None:
    got = scorer.score(endpoint, [endpoint], POLICY)
    if expected is None:
        assert got is None
    else:
        assert got == pytest.approx(expected)


@pytest.mark.parametrize(
    ("depths", "index", "expected"),
    [
        ([0.0, 4.0, 8.0], 0, 1.0),
        ([0.0, 4.0, 8.0], 1, 0.5),
        ([0.0, 4.0, 8.0], 2, 0.0),
        ([0.0, 0.0], 0, 1.0),  # all zero -> 1
        ([None, 4.0], 0, None),
        ([2.0, None], 0, 0.0),  # the deepest known queue is its own
    ],
)
def test_queue_scorer_is_relative_to_pool(
    depths: list[float | None], index: int, expected: float | None
) -> None:
    pool = [sig(f"e{i}", queue_depth=d) for i, d in enumerate(depths)]
    got = QueueScorer().score(pool[index], pool, POLICY)
    assert got == (None if expected is None else pytest.approx(expected))


def test_scorers_in_order_and_named_after_weights() -> None:
    assert [s.name for s in SCORERS] == ["qps", "latency", "memory", "kv_cache", "queue", "labels"]
    for s in SCORERS:
        assert hasattr(ScoreWeights(), s.name)
        assert all(hasattr(sig(), c) for c in s.consumes)


# --- combine -----------------------------------------------------------------------------


def test_combine_weighted_sum() -> None:
    ep = sig(qps=50.0, p99_ms=20.0, memory_used_bytes=1.0, memory_total_bytes=2.0)
    got = combine(ep, [ep], POLICY)
    assert got.parts == pytest.approx({"qps": 0.5, "latency": 0.8, "memory": 0.5})
    assert got.score == pytest.approx(0.4 * 0.5 + 0.4 * 0.8 + 0.2 * 0.5)


def test_combine_renormalises_when_memory_missing() -> None:
    ep = sig(qps=50.0, p99_ms=20.0)  # qps and latency weigh 0.4 each -> 0.5 / 0.5
    got = combine(ep, [ep], POLICY)
    assert got.parts["memory"] is None
    assert got.score == pytest.approx(0.5 * 0.5 + 0.5 * 0.8)


def test_combine_zero_weight_scorers_drop_out() -> None:
    policy = PoolPolicy(100.0, 100.0, ScoreWeights(qps=1.0, latency=0.0, memory=0.0))
    ep = sig(qps=10.0, p99_ms=1000.0)
    got = combine(ep, [ep], policy)
    assert got.parts == {"qps": pytest.approx(0.9)}
    assert got.score == pytest.approx(0.9)


@pytest.mark.parametrize(
    ("p99_ms", "exponent", "factor"),
    [
        (None, 2.0, 1.0),
        (50.0, 2.0, 1.0),
        (100.0, 2.0, 1.0),  # at the SLA: no penalty
        (150.0, 2.0, (100 / 150) ** 2),
        (200.0, 2.0, 0.25),
        (400.0, 1.0, 0.25),
        (400.0, 0.0, 1.0),  # off: the article's plain weighted sum
    ],
)
def test_over_sla_factor(p99_ms: float | None, exponent: float, factor: float) -> None:
    policy = PoolPolicy(100.0, 100.0, over_sla_exponent=exponent)
    assert over_sla_factor(p99_ms, policy) == pytest.approx(factor)


def test_a_slow_server_loses_most_of_its_score() -> None:
    """Without the factor a server at 2x its SLA keeps 60% of a healthy one's score."""
    fast = sig("f:1", qps=50.0, p99_ms=20.0, memory_used_bytes=1.0, memory_total_bytes=2.0)
    slow = sig("s:1", qps=50.0, p99_ms=200.0, memory_used_bytes=1.0, memory_total_bytes=2.0)
    policy = PoolPolicy(100.0, 100.0)
    got = combine(slow, [fast, slow], policy)
    assert got.parts["over_sla"] == pytest.approx(0.25)
    assert got.score == pytest.approx((0.4 * 0.5 + 0.2 * 0.5) * 0.25)
    gentle = combine(slow, [fast, slow], PoolPolicy(100.0, 100.0, over_sla_exponent=0.0))
    assert "over_sla" not in gentle.parts and gentle.score == pytest.approx(0.3)


@pytest.mark.parametrize(
    ("used", "full_at", "factor"),
    [
        (None, 0.8, 1.0),  # no KV signal: no factor
        (50.0, 0.8, 1.0),
        (80.0, 0.8, 1.0),  # at the threshold: none yet
        (90.0, 0.8, 0.5),
        (97.0, 0.8, 0.15),
        (100.0, 0.8, 0.0),
        (100.0, 1.0, 1.0),  # off
        (60.0, 0.0, 0.4),  # 0: the plain headroom from the first block
    ],
)
def test_kv_full_factor(used: float | None, full_at: float, factor: float) -> None:
    total = None if used is None else 100.0
    policy = PoolPolicy(100.0, 100.0, kv_full_at=full_at)
    headroom = KvCacheScorer().score(sig(kv_blocks_used=used, kv_blocks_total=total), [], policy)
    assert kv_full_factor(headroom, policy) == pytest.approx(factor)


def test_a_server_whose_kv_cache_is_nearly_full_loses_most_of_its_score() -> None:
    """Without the factor, 97% used kept about half an empty server's score from the rest."""
    weights = ScoreWeights(qps=0.15, latency=0.2, memory=0.1, kv_cache=0.35, queue=0.2)
    common = {"qps": 1.0, "p99_ms": 50.0, "queue_depth": 0.0}
    empty = sig("e:1", kv_blocks_used=0.0, kv_blocks_total=32.0, **common)
    full = sig("f:1", kv_blocks_used=31.0, kv_blocks_total=32.0, **common)
    policy = PoolPolicy(100.0, 100.0, score_weights=weights)
    best, worst = combine(empty, [empty, full], policy), combine(full, [empty, full], policy)
    assert best.score is not None and worst.score is not None
    assert "kv_full" not in best.parts
    assert worst.parts["kv_full"] == pytest.approx((1 / 32) / 0.2)
    assert worst.score < 0.1 * best.score
    off = PoolPolicy(100.0, 100.0, score_weights=weights, kv_full_at=1.0)
    gentle = combine(full, [empty, full], off).score
    assert gentle is not None and gentle > 0.5 * best.score  # what the test above guards
    # A pool that does not score the KV cache is not judged by it either.
    plain = combine(full, [empty, full], POLICY)
    assert "kv_full" not in plain.parts


@pytest.mark.parametrize(
    ("error_rate", "eject_at", "factor"),
    [
        (None, 0.5, 1.0),
        (0.0, 0.5, 1.0),
        (0.001, 0.5, 0.998),  # noise costs nothing
        (0.25, 0.5, 0.5),
        (0.4, 0.5, 0.2),
        (0.5, 0.5, 0.0),  # at the threshold (where ejection takes over, if allowed)
        (0.9, 0.5, 0.0),
        (0.4, 0.0, 1.0),  # ejection on errors off: so is this
    ],
)
def test_errors_factor(error_rate: float | None, eject_at: float, factor: float) -> None:
    assert errors_factor(error_rate, PoolPolicy(100.0, 100.0, error_rate_eject=eject_at)) == (
        pytest.approx(factor)
    )


def test_a_server_failing_requests_loses_weight_even_where_it_is_not_ejected() -> None:
    """Under the ejection threshold, held in by the cap, or in a pool failing open, a server
    failing 40% of its requests kept its whole score (failing fast even helped its latency)."""
    common = {"qps": 50.0, "p99_ms": 20.0}
    good, failing = sig("g:1", error_rate=0.0, **common), sig("f:1", error_rate=0.4, **common)
    best = combine(good, [good, failing], POLICY)
    worst = combine(failing, [good, failing], POLICY)
    assert best.score is not None and worst.score is not None
    assert "errors" not in best.parts and worst.parts["errors"] == pytest.approx(0.2)
    assert worst.score == pytest.approx(0.2 * best.score)


def test_combine_no_signal_is_neutral() -> None:
    got = combine(sig(), [sig()], POLICY)
    assert got.score is None


# --- weights -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scores", "max_weight", "expected"),
    [
        ({"a": 1.0, "b": 0.5, "c": 0.25}, 100, {"a": 100, "b": 50, "c": 25}),
        ({"a": 0.8, "b": 0.4}, 100, {"a": 100, "b": 50}),  # ratio, not absolute score
        ({"a": 1.0, "b": 0.001}, 100, {"a": 100, "b": 1}),  # never 0
        ({"a": 1.0, "b": 0.0}, 100, {"a": 100, "b": 1}),
        ({"a": 0.0, "b": 0.0}, 100, {"a": 50, "b": 50}),  # all zero: equal
        ({"a": 0.0}, 1, {"a": 1}),
        ({"a": 0.3}, 100, {"a": 100}),  # single endpoint
        ({"a": 1.0, "b": 0.335}, 10, {"a": 10, "b": 3}),
        ({"a": 1.0, "b": 0.35}, 10, {"a": 10, "b": 4}),  # half up, not banker's
        ({}, 100, {}),
    ],
)
def test_proportional_weights_table(
    scores: dict[str, float], max_weight: int, expected: dict[str, int]
) -> None:
    assert proportional_weights(scores, max_weight) == expected


def test_proportional_weights_deterministic() -> None:
    scores = {f"e{i}": (i * 37 % 11) / 10 for i in range(20)}
    first = proportional_weights(scores, 100)
    assert all(proportional_weights(dict(reversed(scores.items())), 100) == first for _ in range(5))


@given(
    st.dictionaries(
        st.text(min_size=1, max_size=4),
        st.floats(min_value=1e-6, max_value=1e6, allow_nan=False),
        min_size=1,
        max_size=12,
    ),
    st.integers(min_value=1, max_value=1000),
)
def test_proportional_weights_property(scores: dict[str, float], max_weight: int) -> None:
    got = proportional_weights(scores, max_weight)
    best = max(scores, key=lambda k: scores[k])
    assert got[best] == max_weight
    assert all(1 <= w <= max_weight for w in got.values())
    for a in scores:
        for b in scores:
            if scores[a] < scores[b]:
                assert got[a] <= got[b]


@pytest.mark.parametrize(
    ("previous", "current", "alpha", "expected"),
    [
        ({"a": 0.0}, {"a": 1.0}, 0.5, {"a": 0.5}),
        ({"a": 0.2}, {"a": 0.6}, 1.0, {"a": 0.6}),  # no smoothing
        ({"a": 0.2}, {"a": 0.6}, 0.25, {"a": 0.3}),
        ({}, {"a": 0.7}, 0.5, {"a": 0.7}),  # new endpoint takes current
        ({"gone": 0.9}, {"a": 0.7}, 0.5, {"a": 0.7}),  # vanished endpoint dropped
    ],
)
def test_smooth_table(
    previous: dict[str, float], current: dict[str, float], alpha: float, expected: dict[str, float]
) -> None:
    assert smooth(previous, current, alpha) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("previous", "target", "step", "expected"),
    [
        ({"a": 100}, {"a": 10}, 50, {"a": 50}),
        ({"a": 10}, {"a": 100}, 50, {"a": 60}),
        ({"a": 40}, {"a": 60}, 50, {"a": 60}),  # within the step: straight there
        ({}, {"a": 30}, 5, {"a": 30}),  # new endpoint goes to target
        ({"a": 10, "gone": 5}, {"a": 10}, 5, {"a": 10}),
        ({"a": 10}, {"a": 100}, 0, {"a": 10}),
    ],
)
def test_limit_step_table(
    previous: dict[str, int], target: dict[str, int], step: int, expected: dict[str, int]
) -> None:
    assert limit_step(previous, target, step) == expected


@pytest.mark.parametrize(
    ("previous", "new", "hysteresis", "expected"),
    [
        ({"a": 100, "b": 50}, {"a": 100, "b": 50}, 0.1, False),
        ({"a": 100, "b": 50}, {"a": 100, "b": 60}, 0.1, False),  # exactly 10: not more
        ({"a": 100, "b": 50}, {"a": 100, "b": 61}, 0.1, True),
        ({"a": 100, "b": 50}, {"a": 100, "b": 39}, 0.1, True),
        ({"a": 100}, {"a": 100, "b": 50}, 0.1, True),  # appears
        ({"a": 100, "b": 50}, {"a": 100}, 0.1, True),  # disappears
        ({"a": 100, "b": 50}, {"a": 100, "b": 51}, 0.0, True),
        ({}, {}, 0.1, False),
    ],
)
def test_needs_push_table(
    previous: dict[str, int], new: dict[str, int], hysteresis: float, expected: bool
) -> None:
    assert needs_push(previous, new, hysteresis, 100) is expected


# --- decide_pool -------------------------------------------------------------------------


def healthy(endpoint: str, p99_ms: float = 20.0, **kw: Any) -> EndpointSignals:
    return sig(
        endpoint, qps=50.0, p99_ms=p99_ms, memory_used_bytes=1.0, memory_total_bytes=2.0, **kw
    )


def test_slow_endpoint_loses_weight_over_a_few_decisions() -> None:
    state: PoolState | None = None
    decision, state = decide_pool([healthy("a"), healthy("b"), healthy("c")], POLICY, state)
    assert decision.push and decision.weights == {"a": 100, "b": 100, "c": 100}
    slow_pool = [healthy("a"), healthy("b"), healthy("c", p99_ms=3 * POLICY.sla_p99_ms)]
    history = []
    for _ in range(6):
        decision, state = decide_pool(slow_pool, POLICY, state)
        history.append(decision.weights["c"])
    assert decision.weights["a"] == decision.weights["b"] == 100
    # raw 0.30 vs 0.62 -> about half; smoothing makes the fall gradual, not a cliff.
    assert decision.weights["c"] < 0.6 * decision.weights["a"]
    assert history[0] > history[-1]
    assert history == sorted(history, reverse=True)
    assert "latency 0.00" in decision.reasons["c"]
    assert decision.reasons["c"].endswith(f"-> weight {decision.weights['c']}")


def test_draining_excluded_and_stale_gets_median() -> None:
    pool = [
        healthy("a", p99_ms=10.0),
        healthy("b", p99_ms=50.0),
        healthy("c", p99_ms=90.0),
        healthy("d", draining=True),
        sig("e", stale=True),
    ]
    decision, state = decide_pool(pool, POLICY, None)
    assert "d" not in decision.weights
    assert decision.reasons["d"] == "excluded: server reports draining"
    assert state.scores["e"] == pytest.approx(state.scores["b"])  # the median of a, b, c
    assert decision.weights["e"] == decision.weights["b"]
    assert decision.reasons["e"].startswith("neutral: telemetry stale")
    assert decision.scores["e"].score is None


def test_no_push_keeps_previous_weights() -> None:
    decision, state = decide_pool([healthy("a"), healthy("b", p99_ms=30.0)], POLICY, None)
    assert decision.push
    again, state2 = decide_pool([healthy("a"), healthy("b", p99_ms=32.0)], POLICY, state)
    assert not again.push
    assert again.weights == decision.weights
    assert state2.weights == decision.weights


def test_all_stale_pool_is_neutral() -> None:
    decision, _ = decide_pool([sig("a", stale=True), sig("b", stale=True)], POLICY, None)
    assert decision.weights == {"a": 100, "b": 100}
    assert decision.reasons["a"] == "neutral: telemetry stale (pool median 0.50) -> weight 100"


def test_empty_pool() -> None:
    decision, state = decide_pool([], POLICY, None)
    assert decision.weights == {} and state.weights == {}


QUEUED = PoolPolicy(
    capacity_qps=100.0, sla_p99_ms=100.0, score_weights=ScoreWeights(queue=0.3)
)  # the queue scorer reads the whole pool


@pytest.mark.parametrize("policy", [POLICY, QUEUED])
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from([10.0, 40.0, 150.0]), st.integers(0, 8)),
        min_size=1,
        max_size=12,
    )
)
def test_kept_scores_decide_as_scores_combined_afresh(
    policy: PoolPolicy, moves: list[tuple[int, float, int]]
) -> None:
    """A decision keeps the score of an endpoint whose signals did not change and combines the
    rest: every decision of a timeline is the one a decision without kept scores makes."""
    pool = [healthy(n, queue_depth=1.0) for n in "abcd"]
    state: PoolState | None = None
    for index, p99_ms, depth in moves:
        pool[index] = healthy("abcd"[index], p99_ms=p99_ms, queue_depth=float(depth))
        afresh = None if state is None else PoolState(state.scores, state.weights)
        expected, expected_state = decide_pool(list(pool), policy, afresh)
        decision, state = decide_pool(list(pool), policy, state)
        assert decision.scores == expected.scores and decision.weights == expected.weights
        assert decision.reasons == expected.reasons
        assert state.scores == expected_state.scores
