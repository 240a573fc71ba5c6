"""Affinity in /status and the live view: the mode and options per model, the prefix-cache
hit rate per endpoint of its pool."""

from __future__ import annotations

from control_plane.admin.affinity_view import affinity_status
from control_plane.admin.live_view import build_frame
from control_plane.model.mesh import (
    Affinity,
    EndpointAddress,
    EndpointAssignment,
    EndpointHealth,
    ListenerOptions,
    MeshState,
    ModelRoute,
    model_cluster,
)
from control_plane.telemetry.values import EndpointTelemetry, Signal

A, B = EndpointAddress("10.0.0.1", 1), EndpointAddress("10.0.0.2", 1)


def state() -> MeshState:
    members = (EndpointAssignment(A, 80), EndpointAssignment(B, 20, EndpointHealth.DRAINING))
    return MeshState(
        ListenerOptions(),
        (ModelRoute("lm", 100, 5, affinity=Affinity("prefix")), ModelRoute("cls", 100, 5)),
        {model_cluster("lm"): members, model_cluster("cls"): members[:1]},
    )


def test_status_shows_each_models_affinity_and_its_endpoints_hit_rates() -> None:
    readings = {A.key: EndpointTelemetry(A.key, 0.1, 1.0, False,
                                         prefix_cache_hit_rate=Signal(0.91234, 0.2))}  # fmt: skip
    found = affinity_status(state(), readings)
    assert found["lm"]["mode"] == "prefix" and found["lm"]["prefix_bytes"] == 128
    assert found["lm"]["hash_balance_factor"] == 125
    assert found["lm"]["endpoints"] == {
        A.key: {"weight": 80, "health": "HEALTHY", "prefix_cache_hit_rate": 0.9123},
        B.key: {"weight": 20, "health": "DRAINING", "prefix_cache_hit_rate": None},
    }
    assert found["cls"] == {
        "mode": "none",
        "endpoints": {A.key: {"weight": 80, "health": "HEALTHY", "prefix_cache_hit_rate": 0.9123}},
    }
    assert affinity_status(None, readings) == {}


def test_the_live_view_shows_the_mode_and_the_hit_rate() -> None:
    status = {
        "routing": {"lm": {"endpoints": {A.key: {"weight": 80}}}, "cls": {"endpoints": {}}},
        "affinity": affinity_status(state(), {}),
    }
    telemetry = {"endpoints": {A.key: {"prefix_cache_hit_rate": {"value": 0.5}}}}
    pools = {p["model"]: p for p in build_frame(status, telemetry, 1.0)["pools"]}
    assert pools["lm"]["affinity"] == {"mode": "prefix", "prefix_bytes": 128,
                                       "session_header": "x-session-id",
                                       "hash_balance_factor": 125}  # fmt: skip
    assert pools["cls"]["affinity"] is None
    assert pools["lm"]["endpoints"][0]["prefix_cache_hit_rate"] == 0.5
