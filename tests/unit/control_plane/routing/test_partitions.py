"""A server this control plane cannot reach but Envoy can stays on its last placement."""

from __future__ import annotations

from collections.abc import Callable, Collection

from control_plane.discovery.placement import EndpointReport
from control_plane.model.mesh import EndpointAddress
from control_plane.routing import partitions

A = EndpointAddress("10.0.0.11", 8001)
B = EndpointAddress("10.0.0.12", 8001)
C = EndpointAddress("10.0.0.13", 8001)
READY = frozenset({("classifier", "1")})


def reached(address: EndpointAddress) -> EndpointReport:
    return EndpointReport(address, True, READY, True)


def lost(address: EndpointAddress) -> EndpointReport:
    """Every probe timed out: the network said nothing."""
    return EndpointReport(address, False, error="DEADLINE_EXCEEDED", silent=True)


def refused(address: EndpointAddress) -> EndpointReport:
    """The host answered no: nothing listens there any more."""
    return EndpointReport(address, False, error="UNAVAILABLE: Connection refused")


def passing(
    *addresses: EndpointAddress, age_s: float = 0.0
) -> tuple[Callable[[Collection[str], float], set[str]], list[set[str]]]:
    """Envoy's checks passing for ``addresses`` in reports ``age_s`` old, and a record of
    what was asked."""
    asked: list[set[str]] = []

    def checks_pass(keys: Collection[str], max_age_s: float) -> set[str]:
        asked.append(set(keys))
        return {a.key for a in addresses} & set(keys) if age_s <= max_age_s else set()

    return checks_pass, asked


def test_an_unreachable_server_envoy_finds_healthy_is_held_on_its_last_report() -> None:
    reports = {A: lost(A), B: reached(B), C: lost(C)}
    last = {A: reached(A), B: reached(B), C: reached(C)}
    checks, asked = passing(A, B)
    held = partitions.held_endpoints(reports, last, checks)
    assert held == {A: last[A]}  # C: Envoy's checks fail too
    assert asked == [{A.key, C.key}]  # only the unreachable ones are looked up
    effective = partitions.with_held(reports, held)
    assert list(effective) == [A, B, C] and effective[A].reachable and not effective[C].reachable


def test_a_hold_rests_on_an_older_word_from_envoy_than_it_starts_on() -> None:
    """Envoy's stat flushes arriving late on a busy host must not end a hold: the server
    would leave its clusters for the rest of the partition."""
    late, _ = passing(A, age_s=partitions.START_MAX_AGE_S + 2)
    reports, last = {A: lost(A)}, {A: reached(A)}
    assert partitions.held_endpoints(reports, last, late) == {}  # too old to start on
    assert partitions.held_endpoints(reports, last, late, already_held={A}) == {A: last[A]}
    gone, _ = passing(A, age_s=partitions.KEEP_MAX_AGE_S + 1)
    assert partitions.held_endpoints(reports, last, gone, already_held={A}) == {}
    failing, _ = passing()  # Envoy's checks fail: the hold ends at once
    assert partitions.held_endpoints(reports, last, failing, already_held={A}) == {}


def test_a_server_that_refuses_connections_is_not_held() -> None:
    """Gone or stopped, not cut off: Envoy's checks may still pass for a few seconds."""
    checks, asked = passing(A)
    assert partitions.held_endpoints({A: refused(A)}, {A: reached(A)}, checks) == {}
    assert asked == []


def test_a_server_never_reached_is_never_held() -> None:
    checks, asked = passing(A)
    assert partitions.held_endpoints({A: lost(A)}, {}, checks) == {}
    assert asked == []  # nothing to ask Envoy about


def test_nothing_held_leaves_the_reports_as_they_are() -> None:
    reports = {A: reached(A)}
    assert partitions.with_held(reports, {}) is reports


def test_every_change_is_explained() -> None:
    words = partitions.changes({}, {A: reached(A)})
    assert [w for _, w in words] == [
        "10.0.0.11:8001 unreachable from the control plane, but Envoy's health checks pass: "
        "kept on its last placement (telemetry stale: routed at the pool's median score)"
    ]
    ended = partitions.changes({A: reached(A)}, {})
    assert ended[0][0] == reached(A) and "no longer held" in ended[0][1]
    assert partitions.changes({A: reached(A)}, {A: reached(A)}) == []
