"""Each model pool's endpoints as routing sees them: ``EndpointSignals`` made from the telemetry
store's view and the placement reports, once per recompute (``control_plane.routing.router``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from control_plane.discovery.placement import EndpointReport
from control_plane.model.mesh import EndpointAddress
from control_plane.scoring.types import EndpointSignals, Labels
from control_plane.telemetry.values import EndpointTelemetry, ModelTelemetry


def _value(signal: Any) -> float | None:
    return None if signal is None else float(signal.value)


Members = Mapping[str, list[EndpointAddress]]


def ready_members(
    reports: Mapping[EndpointAddress, EndpointReport],
) -> dict[str, list[EndpointAddress]]:
    """Per model, the reachable endpoints where it is READY, in address order: one pass over
    the fleet per recompute, so each pool then reads only its own endpoints."""
    members: dict[str, list[EndpointAddress]] = {}
    for address in sorted(reports, key=lambda a: (a.host, a.port)):
        report = reports[address]
        if report.reachable:
            for model in {m for m, _ in report.ready_models}:
                members.setdefault(model, []).append(address)
    return members


# model -> endpoint -> (the telemetry, labels and server readiness its signals were made
# from, the signals); readiness is (the server's, whether the model is its only one)
Made = tuple[EndpointTelemetry | None, Labels, tuple[bool, bool], EndpointSignals]
SignalsMade = dict[str, dict[str, Made]]


def pool_signals(
    model: str,
    telemetry: Mapping[str, EndpointTelemetry],
    reports: Mapping[EndpointAddress, EndpointReport],
    members: Members | None = None,
    labels: Mapping[str, Labels] | None = None,
    made: tuple[SignalsMade, SignalsMade] | None = None,
) -> list[EndpointSignals]:
    """The endpoints where ``model`` is READY, with their signals (None where missing).
    ``members``: ``ready_members(reports)``, computed once for every pool; ``labels``: each
    endpoint's (``lanes.fleet_labels``; default: what telemetry reports); ``made``: (the last
    recompute's signals, this one's): an endpoint whose telemetry is the same object as then
    (``TelemetryStore.snapshot(now, ages=False)`` with no new data) keeps its signals."""
    signals = []
    last, this = (made[0].get(model, {}), made[1].setdefault(model, {})) if made else ({}, {})
    for address in (members if members is not None else ready_members(reports)).get(model, []):
        key = address.key
        seen = telemetry.get(key)
        known = labels.get(key, ()) if labels is not None else ()
        report = reports.get(address)
        ready = (report is not None and report.server_ready, _alone(model, report))
        before = last.get(key)
        if before is not None and before[0] is seen and before[1] == known and before[2] == ready:
            this[key] = before
            signals.append(before[3])
            continue
        signal = _signals(model, address, seen, known, labels is not None, *ready)
        this[key] = (seen, known, ready, signal)
        signals.append(signal)
    return signals


def _alone(model: str, report: EndpointReport | None) -> bool:
    """Whether ``model`` is the only model READY on the server."""
    return report is not None and all(m == model for m, _ in report.ready_models)


def _signals(
    model: str,
    address: EndpointAddress,
    seen: EndpointTelemetry | None,
    known: Labels,
    labelled: bool,
    server_ready: bool = False,
    alone: bool = True,
) -> EndpointSignals:
    if seen is None:
        return EndpointSignals(address.key, stale=True, labels=known)
    per_model = next((m for m in seen.models if m.model == model), None)
    if per_model is None and not alone:
        # The server's figures are its other models' (this one has not served yet): none of
        # them is evidence about this model, and reading them ejected the server from every
        # other pool when one model failed there (then it got no traffic to prove otherwise).
        per_model = ModelTelemetry(model, None, None)
    return EndpointSignals(
        endpoint=address.key,
        stale=seen.stale,
        # Draining is taken from telemetry only once the server's own health agrees (its
        # ServerReady, asked by placement at once on the hint): a report alone, which anyone
        # who reaches the OTLP port can send, cannot take servers out of their pools.
        draining=bool(seen.draining and seen.draining.value) and not server_ready,
        qps=_value(per_model.qps if per_model else seen.qps),
        p99_ms=_value(per_model.p99_ms if per_model else seen.p99_ms),
        error_rate=_value(per_model.error_rate if per_model else seen.error_rate),
        abandoned_rate=_value(per_model.abandoned_rate if per_model else seen.abandoned_rate),
        memory_used_bytes=_value(seen.memory_used_bytes),
        memory_total_bytes=_value(seen.memory_total_bytes),
        kv_blocks_used=_value(seen.kv_blocks_used),
        kv_blocks_total=_value(seen.kv_blocks_total),
        queue_depth=_value(seen.queue_depth),
        labels=known if labelled else seen.labels,
    )
