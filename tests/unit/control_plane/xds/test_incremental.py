"""Incremental snapshots: the builder gives exactly what a full build gives, and re-makes only
what changed (a weight change in one pool re-makes that pool's assignments, nothing else)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from control_plane.model.mesh import (
    SERVERS_CLUSTER,
    CircuitBreaker,
    EndpointAddress,
    EndpointAssignment,
    EndpointHealth,
    ListenerOptions,
    MeshState,
    ModelRoute,
    RestOptions,
    model_cluster,
)
from control_plane.xds.incremental import SnapshotBuilder
from control_plane.xds.resources import build_resources
from control_plane.xds.snapshot import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    ROUTE_TYPE,
    InconsistentSnapshot,
    Snapshot,
    build_snapshot,
)

ADDRESSES = [EndpointAddress(f"10.0.0.{i}", 8001) for i in range(1, 7)]
MODELS = ("a", "b", "c")


def fleet() -> MeshState:
    """Three models on two servers each; every server in the servers cluster."""
    clusters: dict[str, tuple[EndpointAssignment, ...]] = {
        SERVERS_CLUSTER: tuple(EndpointAssignment(a) for a in ADDRESSES)
    }
    for index, model in enumerate(MODELS):
        members = tuple(EndpointAssignment(a) for a in ADDRESSES[2 * index : 2 * index + 2])
        clusters[model_cluster(model)] = members
        clusters[model_cluster(model, "1")] = members
    return MeshState(
        # gRPC only: the REST twins' reuse is tested in tests/unit/control_plane/xds/test_edge.py.
        listener=ListenerOptions(rest=RestOptions(enabled=False)),
        models=tuple(ModelRoute(m, 50, timeout_s=2) for m in MODELS),
        clusters=dict(sorted(clusters.items())),
    )


def reweigh(state: MeshState, model: str, weight: int) -> MeshState:
    clusters = dict(state.clusters)
    for name in (model_cluster(model), model_cluster(model, "1")):
        clusters[name] = tuple(dataclasses.replace(a, weight=weight) for a in clusters[name])
    return dataclasses.replace(state, clusters=clusters)


def eject(state: MeshState, address: EndpointAddress) -> MeshState:
    clusters = {
        name: tuple(
            dataclasses.replace(a, health=EndpointHealth.UNHEALTHY) if a.address == address else a
            for a in members
        )
        for name, members in state.clusters.items()
    }
    return dataclasses.replace(state, clusters=clusters)


def with_models(state: MeshState, change: Callable[[ModelRoute], ModelRoute]) -> MeshState:
    return dataclasses.replace(state, models=tuple(change(m) for m in state.models))


def drop_model(state: MeshState, model: str) -> MeshState:
    clusters = {n: m for n, m in state.clusters.items() if not n.startswith(model_cluster(model))}
    models = tuple(m for m in state.models if m.name != model)
    return dataclasses.replace(state, models=models, clusters=clusters)


def same(built: Snapshot, full: Snapshot) -> None:
    assert built.versions() == full.versions()
    for type_url in (LISTENER_TYPE, ROUTE_TYPE, CLUSTER_TYPE, ENDPOINT_TYPE):
        mine, theirs = built.of(type_url).items, full.of(type_url).items
        assert mine.keys() == theirs.keys()
        assert all(mine[n].packed.value == theirs[n].packed.value for n in mine), type_url


# (description, the change, how many resources must be re-made)
CHANGES: list[tuple[str, Callable[[MeshState], MeshState], int]] = [
    ("nothing", lambda s: s, 0),
    ("one pool's weights", lambda s: reweigh(s, "b", 7), 2),  # model:b and model:b:v1
    ("one endpoint ejected", lambda s: eject(s, ADDRESSES[0]), 3),  # its two pools + servers
    ("a version split", lambda s: with_models(
        s, lambda m: dataclasses.replace(m, version_split=(("1", 100),)) if m.name == "a" else m
    ), 1),  # the routes only
    ("a circuit breaker", lambda s: with_models(
        s, lambda m: dataclasses.replace(m, circuit_breaker=CircuitBreaker(32)) if m.name == "c"
        else m,
    ), 3),  # model:c's two clusters, and the routes (the model changed)
    ("listener options", lambda s: dataclasses.replace(
        s, listener=ListenerOptions(health_check_interval_s=2, rest=RestOptions(enabled=False))
    ), 1 + 1 + 7),  # listener, routes, every cluster (their health checks); no assignment
    ("a model removed", lambda s: drop_model(s, "c"), 1),  # the routes; c's resources go
]  # fmt: skip


@pytest.mark.parametrize(("change", "made"), [(c, m) for _, c, m in CHANGES],
                         ids=[d for d, _, _ in CHANGES])  # fmt: skip
def test_each_change_remakes_only_what_it_touches(
    change: Callable[[MeshState], MeshState], made: int
) -> None:
    builder = SnapshotBuilder()
    before = fleet()
    builder.build(before)
    assert builder.made == 16 and builder.reused == 0  # listener, routes, 7 + 7
    after = change(before)
    same(builder.build(after), build_snapshot(build_resources(after)))
    assert builder.made == made


def test_a_long_run_of_changes_stays_identical_to_full_builds() -> None:
    builder, state = SnapshotBuilder(), fleet()
    for step in range(30):
        _, change, _ = CHANGES[step % len(CHANGES)]
        state = reweigh(change(state), MODELS[step % 2], 1 + step)
        same(builder.build(state), build_snapshot(build_resources(state)))


def test_resources_that_are_gone_are_forgotten() -> None:
    builder = SnapshotBuilder()
    builder.build(fleet())
    builder.build(drop_model(fleet(), "c"))
    assert not [key for key in builder._made if key[1].startswith(model_cluster("c"))]


def test_an_inconsistent_state_raises_and_the_next_build_is_still_right(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    builder = SnapshotBuilder()
    builder.build(fleet())

    def broken(*args: object) -> list[str]:
        return ["EDS cluster 'x' has no ClusterLoadAssignment"]

    with monkeypatch.context() as patch:
        patch.setattr(Snapshot, "consistency_errors", broken)
        with pytest.raises(InconsistentSnapshot):
            builder.build(reweigh(fleet(), "a", 5))
    state = reweigh(fleet(), "a", 5)
    same(builder.build(state), build_snapshot(build_resources(state)))
    assert builder.made == 2  # measured against the last good build


def test_addresses_hash_once_and_stay_value_objects() -> None:
    a, b = EndpointAddress("10.0.0.1", 1), EndpointAddress("10.0.0.1", 1)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    moved = dataclasses.replace(a, port=2)
    assert moved != a and hash(moved) == hash(("10.0.0.1", 2))
    assert (
        sorted([moved, a]) == [a, moved] and repr(a) == "EndpointAddress(host='10.0.0.1', port=1)"
    )
