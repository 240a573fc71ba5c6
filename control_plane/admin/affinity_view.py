"""Affinity in ``/status``: each model's mode and options, and per endpoint of its pool the
weight Envoy hashes over and the prefix cache's hit rate (prompt tokens the server's cache
held over the telemetry window), which says whether affinity is paying."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from control_plane.model.mesh import MeshState, model_cluster
from control_plane.telemetry.values import EndpointTelemetry


def affinity_status(
    state: MeshState | None, telemetry: Mapping[str, EndpointTelemetry]
) -> dict[str, dict[str, Any]]:
    """{model: {"mode", its options, "endpoints": {HOST:PORT: {weight, health,
    prefix_cache_hit_rate}}}}; the hit rate is null where the server admitted no sequence
    in the window (or reports no prefix cache)."""
    if state is None:
        return {}
    found: dict[str, dict[str, Any]] = {}
    for model in state.models:
        options: dict[str, Any] = {"mode": "none"}
        if model.affinity is not None:
            options = {**dataclasses.asdict(model.affinity),
                       "prefix_bytes": model.affinity.prefix_bytes}  # fmt: skip
        members = state.clusters.get(model_cluster(model.name), ())
        endpoints = {}
        for member in members:
            reading = telemetry.get(member.address.key)
            rate = reading.prefix_cache_hit_rate if reading else None
            endpoints[member.address.key] = {
                "weight": member.weight,
                "health": member.health.value,
                "prefix_cache_hit_rate": None if rate is None else round(rate.value, 4),
            }
        found[model.name] = {**options, "endpoints": endpoints}
    return found
