"""The rebuilder: requests made in one turn of the event loop are served by one rebuild, an
operator's ``now`` serves the pending ones too, and a snapshot that fails its consistency
check leaves the last good one in place (real SnapshotBuilder, SnapshotCache and metrics)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from control_plane.app.rebuilder import Rebuilder
from control_plane.metrics import ControlPlaneMetrics
from control_plane.model.mesh import MeshState
from control_plane.xds.incremental import SnapshotBuilder
from control_plane.xds.snapshot import DEFAULT_GROUP, Snapshot, SnapshotCache
from tests.unit.control_plane.xds.meshes import V2, mesh_state


class Inputs:
    """The plane's inputs, as the rebuilder reads them: the mesh state, counted."""

    def __init__(self) -> None:
        self.state = mesh_state()
        self.reads = 0

    def __call__(self) -> MeshState:
        self.reads += 1
        return self.state


def rebuilder(inputs: Inputs) -> Rebuilder:
    return Rebuilder(inputs, SnapshotBuilder(), SnapshotCache(), ControlPlaneMetrics())


def requests_metric(r: Rebuilder) -> float | None:
    return r.metrics.registry.get_sample_value("xds_rebuild_requests_total")


async def test_requests_in_one_turn_are_served_by_one_rebuild() -> None:
    inputs = Inputs()
    r = rebuilder(inputs)
    for reason in ("placement changed", "canary of classifier: step 2", "placement changed"):
        r.request(reason)
    assert inputs.reads == 0  # nothing yet: the rebuild runs at the loop's next turn
    await asyncio.sleep(0)
    assert (inputs.reads, r.rebuilds, r.requests) == (1, 1, 3)
    assert r.last["reason"] == "placement changed; canary of classifier: step 2"
    assert r.last["requests"] == 3 and r.last["changed"] is True
    assert r.state is inputs.state and r.cache.snapshot_for(DEFAULT_GROUP) is not None
    assert requests_metric(r) == 3
    await asyncio.sleep(0)
    assert inputs.reads == 1  # served: no second rebuild


async def test_now_serves_the_pending_requests_and_says_whether_envoy_changed() -> None:
    inputs = Inputs()
    r = rebuilder(inputs)
    assert r.now("start") is True
    r.request("topology reloaded (SIGHUP)")
    assert r.now("operator override of 127.0.0.1:9001") is False  # nothing moved
    assert r.last["reason"] == "topology reloaded (SIGHUP); operator override of 127.0.0.1:9001"
    await asyncio.sleep(0)
    assert (inputs.reads, r.rebuilds) == (2, 2)  # the pending rebuild was cancelled
    version = r.cache.snapshot_for(DEFAULT_GROUP)
    inputs.state = dataclasses.replace(
        inputs.state, clusters={**inputs.state.clusters, V2: ()}
    )  # version 2 lost its only endpoint
    assert r.now("placement changed") is True
    assert r.cache.snapshot_for(DEFAULT_GROUP) is not version


async def test_an_inconsistent_snapshot_keeps_the_last_good_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The builder makes consistent snapshots; the check is there for a bug, so the bug is
    made here by the check."""
    inputs = Inputs()
    r = rebuilder(inputs)
    r.now("start")
    good = r.cache.snapshot_for(DEFAULT_GROUP)
    inputs.state = dataclasses.replace(inputs.state, clusters={**inputs.state.clusters, V2: ()})
    with monkeypatch.context() as patch:
        patch.setattr(Snapshot, "consistency_errors", lambda *a: ["EDS cluster 'x' is missing"])
        assert r.now("placement changed") is False
    assert r.cache.snapshot_for(DEFAULT_GROUP) is good
    assert r.last["reason"] == "placement changed" and "missing" in r.last["failed"]
    assert r.now("placement changed") is True  # the next rebuild is still made


async def test_a_build_that_raises_keeps_the_last_good_snapshot_and_says_so() -> None:
    """A value past what Envoy's protobufs hold raised ValueError out of the rebuild (an
    asyncio callback): the error went to the loop's handler and /status showed nothing."""
    inputs = Inputs()
    r = rebuilder(inputs)
    r.now("start")
    good = r.cache.snapshot_for(DEFAULT_GROUP)
    listener = dataclasses.replace(inputs.state.listener, max_retries=1 << 32)
    inputs.state = dataclasses.replace(inputs.state, listener=listener)
    r.request("topology reloaded (SIGHUP)")
    await asyncio.sleep(0)
    assert r.cache.snapshot_for(DEFAULT_GROUP) is good
    assert r.last["failed"].startswith("ValueError: Value out of range")
    assert r.last["reason"] == "topology reloaded (SIGHUP)"
