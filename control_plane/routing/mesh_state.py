"""The mesh state: the pure function from a topology and the latest placement reports to the
``MeshState`` the Envoy resources are built from (``build_mesh_state``), with the memo that
keeps a cluster's assignments when nothing they are made from changed. The reports come from
``discovery.placement``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from control_plane.config.topology import Topology
from control_plane.discovery.placement import Reports
from control_plane.model.lanes import lane_members, matches
from control_plane.model.mesh import (
    SERVERS_CLUSTER,
    EndpointAddress,
    EndpointAssignment,
    EndpointHealth,
    MeshState,
    cluster_model,
    is_checked_in_model_scope,
    model_cluster,
)
from control_plane.scoring.types import Labels

# cluster name -> (what its assignments were made from, the assignments): build_mesh_state's
ClusterMemo = dict[str, tuple[tuple[Any, ...], tuple[EndpointAssignment, ...]]]


def build_mesh_state(
    topology: Topology,
    reports: Reports,
    weights: Mapping[EndpointAddress, int] | None = None,
    health: Mapping[EndpointAddress, EndpointHealth] | None = None,
    pool_weights: Mapping[str, Mapping[EndpointAddress, int]] | None = None,
    pool_health: Mapping[str, Mapping[EndpointAddress, EndpointHealth]] | None = None,
    labels: Mapping[str, Labels] | None = None,
    checked_down: Mapping[str, frozenset[EndpointAddress]] | None = None,
    memo: ClusterMemo | None = None,
) -> MeshState:
    """The mesh for a topology and the latest placement (pure; equal inputs, equal output).

    Per topology model M: ``model_cluster(M)`` holds every reachable endpoint where M has a
    READY version; ``model_cluster(M, V)`` exists for each V of M's version_split and each V
    READY anywhere, holding the reachable endpoints where (M, V) is READY. ``SERVERS_CLUSTER``
    holds the reachable endpoints whose server is ready. Clusters may be empty; models not in
    the topology get none. Weights default to 1 (raised to 1 if lower: EDS needs >= 1),
    health to HEALTHY. ``pool_weights`` / ``pool_health`` (per model name: what telemetry-driven
    routing decided) apply to that model's clusters, except that routing never ejects every
    endpoint of a cluster; ``weights`` / ``health`` (operator overrides) win over them
    everywhere. Cluster names and endpoints are sorted.

    ``labels`` (endpoint key -> its labels) apply each model's placement requirement (an
    endpoint without the required labels is in none of the model's clusters) and its lanes
    (``control_plane.model.lanes``: SLA-class and large-input clusters with priorities; endpoints
    reserved for a class leave the model's other clusters).

    ``checked_down`` (model name -> endpoints Envoy's own health checks of the model's cluster
    find down; with ``listener.health_checks: model`` only that cluster and the model's SLA
    lanes are checked) makes those endpoints UNHEALTHY in the model's unchecked clusters
    (versions, large inputs; REST twins share them), and in ``SERVERS_CLUSTER`` when down in
    every model whose checked clusters hold them. Never in a checked cluster: Envoy counts EDS
    health in what it reports, so a server marked there could never be seen back up. An
    endpoint that routing or an operator already made unhealthy in the model is not Envoy's
    finding; an operator's health wins, and fail-open does not undo what Envoy found.

    ``memo`` (kept by the caller between builds) hands back a cluster's assignments while
    everything it is made from is equal: at 10,000 endpoints a routing change in one pool
    re-made 30,000 assignments of clusters that had not changed (84 -> 12 ms, in process).
    """
    weights = weights or {}
    health = health or {}
    names = {m.name for m in topology.models}
    members: dict[str, set[EndpointAddress]] = {SERVERS_CLUSTER: set()}
    for model in topology.models:
        members[model_cluster(model.name)] = set()
        for version, _ in model.version_split:
            members[model_cluster(model.name, version)] = set()
    for address, report in reports.items():
        if not report.reachable:
            continue
        if report.server_ready:
            members[SERVERS_CLUSTER].add(address)
        for name, version in report.ready_models:
            if name in names:
                members[model_cluster(name)].add(address)
                members.setdefault(model_cluster(name, version), set()).add(address)

    priorities = _apply_labels(topology, members, labels or {})
    pool_weights = pool_weights or {}
    pool_health = pool_health or {}

    def assigned(cluster: str) -> tuple[EndpointAssignment, ...]:
        model = cluster_model(cluster) or ""
        routed_weights = pool_weights.get(model, {})
        routed_health = pool_health.get(model, {})
        return tuple(
            _assignment(
                address,
                max(1, int(weights.get(address, routed_weights.get(address, 1)))),
                health.get(address, routed_health.get(address)) or EndpointHealth.HEALTHY,
                priorities.get(cluster, {}).get(address, 0),
            )
            for address in sorted(members[cluster], key=_address_order)
        )

    def fail_open(assigned: tuple[EndpointAssignment, ...]) -> tuple[EndpointAssignment, ...]:
        # The pool's ejection cap counts the whole model; a version cluster may hold only the
        # ejected ones. Routing never empties a cluster (an operator's UNHEALTHY still does).
        if any(a.health is EndpointHealth.HEALTHY for a in assigned):
            return assigned
        return tuple(
            dataclasses.replace(a, health=EndpointHealth.HEALTHY)
            if a.health is EndpointHealth.UNHEALTHY and a.address not in health
            else a
            for a in assigned
        )

    overrides = (dict(weights), dict(health))  # copies: the caller's may change in place

    def made(cluster: str) -> tuple[EndpointAssignment, ...]:
        if memo is None:
            return fail_open(assigned(cluster))
        model = cluster_model(cluster) or ""
        key = (
            frozenset(members[cluster]),
            pool_weights.get(model, {}),
            pool_health.get(model, {}),
            priorities.get(cluster, {}),
            overrides,
        )
        kept = memo.get(cluster)
        if kept is not None and kept[0] == key:
            return kept[1]
        result = fail_open(assigned(cluster))
        memo[cluster] = (key, result)
        return result

    clusters = {name: made(name) for name in sorted(members)}
    if memo is not None:
        for gone in memo.keys() - clusters.keys():
            del memo[gone]
    if checked_down:
        clusters = _follow_checks(clusters, checked_down, health)
    return MeshState(
        listener=topology.listener,
        models=topology.models,
        clusters=clusters,
        rest_ports=topology.rest_ports,
    )


def _apply_labels(
    topology: Topology, members: dict[str, set[EndpointAddress]], labels: Mapping[str, Labels]
) -> dict[str, dict[EndpointAddress, int]]:
    """Narrows each model's clusters in ``members`` to the endpoints its placement rule and
    lanes allow, adds its lane clusters, and returns each lane's endpoint priorities."""
    priorities: dict[str, dict[EndpointAddress, int]] = {}
    for model in topology.models:
        require = topology.policy(model.name).require_labels
        if not (require or model.sla_classes or model.large_inputs):
            continue
        own = model_cluster(model.name)
        by_key = {a.key: a for a in members[own] if matches(labels.get(a.key, ()), require)}
        split = lane_members(model.name, by_key, labels, model.sla_classes, model.large_inputs)
        for name in [n for n in members if n == own or n.startswith(f"{own}:v")]:
            members[name] = {a for a in members[name] if a.key in split.shared}
        for lane, pairs in split.lanes.items():
            members[lane] = {by_key[k] for k, _ in pairs}
            priorities[lane] = {by_key[k]: p for k, p in pairs}
    return priorities


def _follow_checks(
    clusters: dict[str, tuple[EndpointAssignment, ...]],
    checked_down: Mapping[str, frozenset[EndpointAddress]],
    overrides: Mapping[EndpointAddress, EndpointHealth],
) -> dict[str, tuple[EndpointAssignment, ...]]:
    """``build_mesh_state``'s ``checked_down``, applied (see there)."""
    checked_in: dict[EndpointAddress, set[str]] = {}  # endpoint -> models that check it
    down: dict[str, set[EndpointAddress]] = {}  # model -> found down where we said HEALTHY
    for name, assigned in clusters.items():
        model = cluster_model(name)
        if model is None or not is_checked_in_model_scope(name):
            continue
        found = checked_down.get(model, frozenset())
        for a in assigned:
            checked_in.setdefault(a.address, set()).add(model)
            if a.address in found and a.health is EndpointHealth.HEALTHY:
                down.setdefault(model, set()).add(a.address)
    server_down = {
        a for a, models in checked_in.items() if all(a in down.get(m, ()) for m in models)
    }
    out = {}
    for name, assigned in clusters.items():
        model = cluster_model(name)
        if model is None:
            gone: set[EndpointAddress] = server_down if name == SERVERS_CLUSTER else set()
        else:
            gone = set() if is_checked_in_model_scope(name) else down.get(model, set())
        if any(a.address in gone for a in assigned):
            assigned = tuple(
                _assignment(a.address, a.weight, EndpointHealth.UNHEALTHY, a.priority)
                if a.address in gone and a.address not in overrides
                and a.health is EndpointHealth.HEALTHY else a
                for a in assigned
            )  # fmt: skip
        out[name] = assigned
    return out


def _address_order(address: EndpointAddress) -> tuple[str, int]:
    return address.host, address.port  # EndpointAddress's own order, without its __lt__


@functools.lru_cache(maxsize=1 << 16)
def _assignment(
    address: EndpointAddress, weight: int, health: EndpointHealth, priority: int = 0
) -> EndpointAssignment:
    """One shared object per (address, weight, health, priority): an unchanged cluster's tuple
    of them compares equal by identity, which keeps the incremental builder's comparison cheap
    at fleet scale."""
    return EndpointAssignment(address, weight, health, priority)
