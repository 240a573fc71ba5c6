"""Snapshots built incrementally: a resource is made and packed again only when its inputs
changed.

``build_resources`` makes every resource through a ``Make`` callback with a key of what the
resource reads (``control_plane.xds.resources``). ``SnapshotBuilder`` remembers, per resource, the
key, the message and its packed form from the last build, and hands them back while the key is
equal. So a weight change in one pool re-makes and re-serialises that pool's two or three
ClusterLoadAssignments, not the fleet's; the routes are re-made only when a model or a
cluster name changes. Resources that are gone are forgotten at each build (memory stays
bounded by the current snapshot).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

from google.protobuf.message import Message

from control_plane.model.mesh import MeshState
from control_plane.xds.resources import build_resources
from control_plane.xds.snapshot import PackedResource, Snapshot, build_snapshot, pack
from control_plane.xds.upstream_tls import node_secrets


@dataclass(frozen=True)
class _Made:
    key: Hashable
    message: Message
    packed: PackedResource


class SnapshotBuilder:
    """Builds a checked snapshot from a mesh state, reusing what did not change."""

    def __init__(self) -> None:
        self._made: dict[tuple[str, str], _Made] = {}
        self.made = 0  # resources made (and packed) by the last build
        self.reused = 0  # resources handed back unchanged by the last build

    def build(self, state: MeshState) -> Snapshot:
        """Raises InconsistentSnapshot (and remembers nothing) if the result is inconsistent."""
        previous = self._made
        current: dict[tuple[str, str], _Made] = {}
        made = reused = 0

        def make(type_url: str, name: str, key: Hashable, fn: Callable[[], Message]) -> Message:
            nonlocal made, reused
            entry = previous.get((type_url, name))
            if entry is not None and entry.key == key:
                reused += 1
            else:
                message = fn()
                entry = _Made(key, message, pack(name, message, type_url))
                made += 1
            current[(type_url, name)] = entry
            return entry.message

        resources = build_resources(state, make)
        packed = {
            type_url: {name: current[(type_url, name)].packed for name in by_name}
            for type_url, by_name in resources.items()
        }
        # Each Envoy's own identity: a few small secrets, packed again at every build.
        snapshot = build_snapshot(resources, packed, node_secrets(state.listener.upstream_tls))
        self._made, self.made, self.reused = current, made, reused
        return snapshot
