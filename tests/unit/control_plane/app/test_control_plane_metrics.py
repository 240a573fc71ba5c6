"""publish_assignments leaves exactly the series of the newest assignments, touching only the
endpoints whose assignment changed."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from control_plane.metrics import ControlPlaneMetrics
from control_plane.model.mesh import EndpointAddress, EndpointAssignment, EndpointHealth

A, B = EndpointAddress("10.0.0.1", 8001), EndpointAddress("10.0.0.2", 8001)
OK, DRAIN = EndpointHealth.HEALTHY, EndpointHealth.DRAINING


def series(metrics: ControlPlaneMetrics) -> set[str]:
    text = generate_latest(metrics.registry).decode()
    return {
        line
        for line in text.splitlines()
        if line.startswith(("xds_endpoint_weight{", "xds_endpoint_health{"))
    }


def expected(clusters: dict[str, tuple[EndpointAssignment, ...]]) -> set[str]:
    out = set()
    for cluster, assignments in clusters.items():
        for a in assignments:
            labels = f'cluster="{cluster}",endpoint="{a.address.key}"'
            out.add(f"xds_endpoint_weight{{{labels}}} {float(a.weight)}")
            out.add(f'xds_endpoint_health{{{labels},health="{a.health.value}"}} 1.0')
    return out


def test_each_publish_leaves_exactly_the_newest_series() -> None:
    steps: list[dict[str, tuple[EndpointAssignment, ...]]] = [
        {"model:m": (EndpointAssignment(A, 3, OK), EndpointAssignment(B, 1, OK)), "servers": ()},
        {"model:m": (EndpointAssignment(A, 5, OK), EndpointAssignment(B, 1, DRAIN))},
        {"model:m": (EndpointAssignment(A, 5, OK),), "model:n": (EndpointAssignment(B, 2, OK),)},
        {"model:n": (EndpointAssignment(B, 2, OK),)},  # model:m gone
        {},
    ]
    metrics = ControlPlaneMetrics()
    for clusters in steps:
        metrics.publish_assignments(clusters)
        assert series(metrics) == expected(clusters)


def test_unchanged_clusters_are_not_rewritten(monkeypatch: pytest.MonkeyPatch) -> None:
    metrics = ControlPlaneMetrics()
    big = tuple(EndpointAssignment(EndpointAddress("10.1.0.1", 9000 + i), 1, OK) for i in range(50))
    metrics.publish_assignments({"model:big": big, "model:m": (EndpointAssignment(A, 1, OK),)})
    calls: list[tuple[str, ...]] = []
    labels = metrics.endpoint_weight.labels

    def counted(*names: str) -> object:
        calls.append(names)
        return labels(*names)

    monkeypatch.setattr(metrics.endpoint_weight, "labels", counted)
    metrics.publish_assignments({"model:big": big, "model:m": (EndpointAssignment(A, 4, OK),)})
    assert calls == [("model:m", A.key)]


def test_one_endpoint_leaving_a_big_cluster_touches_its_series_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At 10,000 endpoints every server is in `servers`: one flapping server rewrote them all."""
    metrics = ControlPlaneMetrics()
    big = tuple(EndpointAssignment(EndpointAddress("10.1.0.1", 9000 + i), 1, OK) for i in range(50))
    metrics.publish_assignments({"servers": big})
    touched: list[tuple[str, ...]] = []
    for gauge in (metrics.endpoint_weight, metrics.endpoint_health):
        for method in ("labels", "remove"):
            original = getattr(gauge, method)

            def counted(*names: str, original: object = original, method: str = method) -> object:
                touched.append((method, *names))
                return original(*names)  # type: ignore[operator]

            monkeypatch.setattr(gauge, method, counted)
    moved = (EndpointAssignment(big[7].address, 1, DRAIN),)
    steps = [big[:7] + big[8:], big, big[:7] + moved + big[8:]]  # leaves, returns, drains
    for clusters in steps:
        touched.clear()
        metrics.publish_assignments({"servers": clusters})
        assert {t[2] for t in touched} == {big[7].address.key}
        assert series(metrics) == expected({"servers": clusters})
