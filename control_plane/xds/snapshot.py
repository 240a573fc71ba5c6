"""Immutable, versioned xDS snapshots and the cache that holds the current one per node group.

State is kept apart from transport (as in go-control-plane): the control plane builds a
``Snapshot`` from the mesh and sets it in one place, ``SnapshotCache.set_snapshot``; the ADS
servicers only read. Each resource is packed into ``google.protobuf.Any`` once per snapshot and
shared by every node. Versions are content hashes, so a restarted control plane that builds the
same resources announces the same versions, and a changed resource always gets a new one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import any_pb2

LISTENER_TYPE = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE_TYPE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
SECRET_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
# Push order after a change: secrets before the clusters that use them, clusters before their
# endpoints, listeners before their routes.
TYPE_ORDER = (SECRET_TYPE, CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE)
SHORT_NAMES = {
    SECRET_TYPE: "SDS", CLUSTER_TYPE: "CDS", ENDPOINT_TYPE: "EDS", LISTENER_TYPE: "LDS",
    ROUTE_TYPE: "RDS",
}  # fmt: skip
DEFAULT_GROUP = "*"


class InconsistentSnapshot(ValueError):
    """A snapshot refers to resources it does not contain."""


@dataclass(frozen=True)
class PackedResource:
    name: str
    version: str  # hash of this resource's bytes (delta xDS resource version)
    packed: any_pb2.Any


@dataclass(frozen=True)
class TypeResources:
    """All resources of one type in a snapshot, with the type's version (a content hash)."""

    version: str
    items: Mapping[str, PackedResource]

    def subset(self, names: Iterable[str] | None) -> list[PackedResource]:
        """The resources a subscription asks for (None: all of them), in name order."""
        if names is None:
            return [self.items[n] for n in sorted(self.items)]
        return [self.items[n] for n in sorted(set(names)) if n in self.items]

    def subset_version(self, names: Iterable[str] | None) -> str:
        """Version of what a subscription sees: changes only when those resources change."""
        if names is None:
            return self.version
        return _digest(f"{r.name}={r.version}" for r in self.subset(names))


def _digest(parts: Iterable[str | bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def pack(name: str, message: Any, type_url: str) -> PackedResource:
    data = message.SerializeToString(deterministic=True)
    packed = any_pb2.Any(type_url=type_url, value=data)
    return PackedResource(name, _digest([data]), packed)


def _typed(items: Mapping[str, PackedResource]) -> TypeResources:
    """The type's version is a digest of its resources' names and versions (no re-hashing)."""
    return TypeResources(_digest(f"{n}={items[n].version}" for n in sorted(items)), dict(items))


@dataclass(frozen=True)
class Snapshot:
    """One consistent set of LDS, RDS, CDS, EDS and SDS resources. ``node_secrets``: the
    secrets that differ per node (each Envoy's own identity), node id -> name -> resource;
    a node sees them beside the shared ones, under the same names as every other node."""

    resources: Mapping[str, TypeResources] = field(default_factory=dict)
    node_secrets: Mapping[str, Mapping[str, PackedResource]] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        resources: Mapping[str, Mapping[str, Any]],
        node_secrets: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> Snapshot:
        """Packs messages (type URL -> name -> message) and versions each type by content."""
        return cls.from_packed(
            {
                type_url: {
                    name: pack(name, message, type_url)
                    for name, message in resources.get(type_url, {}).items()
                }
                for type_url in TYPE_ORDER
            },
            pack_node_secrets(node_secrets or {}),
        )

    @classmethod
    def from_packed(
        cls,
        packed: Mapping[str, Mapping[str, PackedResource]],
        node_secrets: Mapping[str, Mapping[str, PackedResource]] | None = None,
    ) -> Snapshot:
        """A snapshot of resources already packed (type URL -> name -> resource)."""
        typed = {type_url: _typed(packed.get(type_url, {})) for type_url in TYPE_ORDER}
        return cls(typed, dict(node_secrets or {}))

    def of(self, type_url: str, node_id: str = "") -> TypeResources:
        """A type's resources as ``node_id`` sees them (its own secrets included)."""
        shared = self.resources.get(type_url) or TypeResources(_digest([]), {})
        own = self.node_secrets.get(node_id) if type_url == SECRET_TYPE else None
        return _typed({**shared.items, **own}) if own else shared

    def versions(self) -> dict[str, str]:
        """Each type's version; SDS's covers every node's own secrets too, so a renewed
        identity is a change."""
        found = {SHORT_NAMES[t]: self.of(t).version for t in TYPE_ORDER}
        own = sorted(f"{node}/{n}={r.version}" for node, items in self.node_secrets.items()
                     for n, r in items.items())  # fmt: skip
        if own:
            found["SDS"] = _digest([found["SDS"], *own])
        return found

    def consistency_errors(self, messages: Mapping[str, Mapping[str, Any]]) -> list[str]:
        """Every EDS name is a CDS cluster's service; every RDS name a listener's route config."""
        errors = []
        clusters = messages.get(CLUSTER_TYPE, {})
        eds_names = {
            c.eds_cluster_config.service_name or c.name
            for c in clusters.values()
            if c.HasField("eds_cluster_config")
        }
        for name in sorted(set(messages.get(ENDPOINT_TYPE, {})) - eds_names):
            errors.append(f"EDS resource {name!r} is not the service of any EDS cluster")
        for name in sorted(eds_names - set(messages.get(ENDPOINT_TYPE, {}))):
            errors.append(f"EDS cluster {name!r} has no ClusterLoadAssignment")
        route_names = set(messages.get(ROUTE_TYPE, {}))
        for name in sorted(_listener_route_names(messages.get(LISTENER_TYPE, {})) - route_names):
            errors.append(f"a listener refers to route config {name!r}, which is missing")
        return errors


def _listener_route_names(listeners: Mapping[str, Any]) -> set[str]:
    from envoy.extensions.filters.network.http_connection_manager.v3 import (
        http_connection_manager_pb2 as hcm_pb2,
    )

    names = set()
    for listener in listeners.values():
        for chain in listener.filter_chains:
            for network_filter in chain.filters:
                manager = hcm_pb2.HttpConnectionManager()
                if network_filter.typed_config.Unpack(manager) and manager.HasField("rds"):
                    names.add(manager.rds.route_config_name)
    return names


def pack_node_secrets(
    secrets: Mapping[str, Mapping[str, Any]],
) -> dict[str, dict[str, PackedResource]]:
    return {
        node: {name: pack(name, message, SECRET_TYPE) for name, message in items.items()}
        for node, items in secrets.items()
    }


def build_snapshot(
    resources: Mapping[str, Mapping[str, Any]],
    packed: Mapping[str, Mapping[str, PackedResource]] | None = None,
    node_secrets: Mapping[str, Mapping[str, Any]] | None = None,
) -> Snapshot:
    """Builds a snapshot and checks it; raises InconsistentSnapshot listing every problem.
    ``packed``: the same resources already packed (the incremental builder's), used as is."""
    snapshot = (
        Snapshot.build(resources, node_secrets)
        if packed is None
        else Snapshot.from_packed(packed, pack_node_secrets(node_secrets or {}))
    )
    errors = snapshot.consistency_errors(resources)
    if errors:
        raise InconsistentSnapshot("; ".join(errors))
    return snapshot


class SnapshotCache:
    """The current snapshot per node group (node.cluster); servicers are told of changes."""

    def __init__(self) -> None:
        self._snapshots: dict[str, Snapshot] = {}
        self._subscribers: set[Callable[[], None]] = set()
        self.generation = 0

    def set_snapshot(self, snapshot: Snapshot, group: str = DEFAULT_GROUP) -> bool:
        """Sets the group's snapshot; returns False (and tells nobody) if nothing changed."""
        current = self._snapshots.get(group)
        if current is not None and current.versions() == snapshot.versions():
            return False
        self._snapshots[group] = snapshot
        self.generation += 1
        for notify in list(self._subscribers):
            notify()
        return True

    def snapshot_for(self, group: str) -> Snapshot | None:
        return self._snapshots.get(group) or self._snapshots.get(DEFAULT_GROUP)

    def groups(self) -> dict[str, Snapshot]:
        return dict(self._snapshots)

    def subscribe(self, notify: Callable[[], None]) -> None:
        """``notify`` is called (on the event loop) after every change."""
        self._subscribers.add(notify)

    def unsubscribe(self, notify: Callable[[], None]) -> None:
        self._subscribers.discard(notify)
