"""Endpoints this control plane cannot reach but Envoy can: kept on their last placement (pure).

A control plane cut off from a server (a network partition between the two, a firewall
change, its own network) sees every placement probe fail and no telemetry arrive. Taking the
server out of its clusters then would drain a server that serves Envoy perfectly well: the
control plane's view is not the data plane's. So an endpoint whose probes fail stays in its
clusters, with its last reachable report, while Envoy's own health checks (and outlier
detection) of it pass, as Envoy reports them through its stat sink
(``EnvoyStats.checks_pass``). Its telemetry goes stale meanwhile, so routing gives it the
pool's median score, never a judgement from old numbers.

Only a silent failure is held: every probe ran out of time, as through a partition. A host
that answers no (connection refused: the server is gone, or stopped after its drain) leaves
at once, as before: Envoy's stats can still call it healthy for the seconds its checks take
to notice, and holding it then sent calls to a closed port (found by a test of SLA lanes).
It leaves as before once Envoy's checks fail too, or once no Envoy has reported it for a few
seconds (an Envoy cut off from the control plane has no say: it serves on its last
configuration anyway). A server that was never reached is never held.

Holding starts on a recent word from Envoy (``START_MAX_AGE_S``) and goes on while Envoy's
last word, up to ``KEEP_MAX_AGE_S`` old, still says its checks pass: on a busy host Envoy's
one-second stat flushes can arrive a few seconds late, and letting a hold lapse then took the
server out of its clusters, and out of Envoy's rotation, for the rest of the partition (found
by the container tier's partition test in CI).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from control_plane.discovery.placement import EndpointReport
from control_plane.model.mesh import EndpointAddress

Held = Mapping[EndpointAddress, EndpointReport]
# Envoy's word on an endpoint (its stat sink's "healthy" gauge) counts this long (seconds):
START_MAX_AGE_S = 3.0  # to start holding it: three missed one-second flushes
KEEP_MAX_AGE_S = 10.0  # to go on holding it


def held_endpoints(
    reports: Mapping[EndpointAddress, EndpointReport],
    last_reachable: Mapping[EndpointAddress, EndpointReport],
    checks_pass: Callable[[Collection[str], float], Collection[str]],
    already_held: Collection[EndpointAddress] = (),
) -> dict[EndpointAddress, EndpointReport]:
    """The unreachable endpoints to keep, each with its last reachable report.

    ``checks_pass(keys, max_age_s)``: those of ``keys`` whose Envoy reports within
    ``max_age_s`` all pass. Endpoints in ``already_held`` may rest on an older report."""
    candidates = {
        address: last_reachable[address]
        for address, report in reports.items()
        if not report.reachable and report.silent and address in last_reachable
    }
    if not candidates:
        return {}
    kept = [a.key for a in candidates if a in already_held]
    new = [a.key for a in candidates if a not in already_held]
    passing = set(checks_pass(new, START_MAX_AGE_S)) if new else set()
    if kept:
        passing |= set(checks_pass(kept, KEEP_MAX_AGE_S))
    return {a: r for a, r in candidates.items() if a.key in passing}


def with_held(
    reports: Mapping[EndpointAddress, EndpointReport], held: Held
) -> Mapping[EndpointAddress, EndpointReport]:
    """``reports`` with each held endpoint's last reachable report in place (same order)."""
    if not held:
        return reports
    return {a: held.get(a, r) for a, r in reports.items()}


def changes(before: Held, after: Held) -> list[tuple[EndpointReport, str]]:
    """(the endpoint's last reachable report, the decision's words) for each endpoint that
    started or stopped being held."""
    started = [
        (after[a], f"{a.key} unreachable from the control plane, but Envoy's health checks "
                   "pass: kept on its last placement (telemetry stale: routed at the pool's "
                   "median score)")
        for a in sorted(after.keys() - before.keys(), key=lambda a: a.key)
    ]  # fmt: skip
    ended = [
        (before[a], f"{a.key} no longer held on Envoy's word (reached again, or Envoy's "
                    "checks fail)")
        for a in sorted(before.keys() - after.keys(), key=lambda a: a.key)
    ]  # fmt: skip
    return started + ended
