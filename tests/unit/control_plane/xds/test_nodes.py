"""The xDS node registry: what /status shows of each Envoy, and what it forgets."""

from __future__ import annotations

import pytest

from control_plane.xds import nodes
from control_plane.xds.nodes import NodeRegistry


def test_a_node_gone_for_an_hour_is_forgotten_and_a_connected_one_never(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(nodes.time, "time", lambda: clock[0])
    registry = NodeRegistry()
    old = registry.connect("envoy-old-pod", "edge", "sotw")
    kept = registry.connect("envoy-live", "edge", "sotw")
    registry.disconnect(old)
    back = registry.connect("envoy-back", "edge", "delta")
    registry.disconnect(back)
    clock[0] += nodes.FORGET_DISCONNECTED_S - 1
    back = registry.connect("envoy-back", "edge", "delta")  # reconnected in time: kept
    assert set(registry.nodes) == {"envoy-old-pod", "envoy-live", "envoy-back"}
    clock[0] += 2  # envoy-old-pod's hour is up
    registry.connect("envoy-new-pod", "edge", "sotw")
    assert set(registry.nodes) == {"envoy-live", "envoy-back", "envoy-new-pod"}
    assert registry.nodes["envoy-live"] is kept  # its stream never ended


def test_past_the_cap_the_longest_gone_go_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nodes, "MAX_NODES", 3)
    clock = [0.0]
    monkeypatch.setattr(nodes.time, "time", lambda: clock[0])
    registry = NodeRegistry()
    live = registry.connect("live", "edge", "sotw")
    for name in ("first-gone", "second-gone"):
        clock[0] += 1
        registry.disconnect(registry.connect(name, "edge", "sotw"))
    clock[0] += 1
    registry.connect("new", "edge", "sotw")
    assert set(registry.nodes) == {"live", "second-gone", "new"}
    assert live.streams == 1
