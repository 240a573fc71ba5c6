"""What each Envoy node has been sent, has accepted and has rejected: the status view of xDS."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

# A node with no stream for this long is forgotten, and past MAX_NODES the longest gone go
# first: Envoys come and go under new ids (a Kubernetes pod's name), and every id ever seen
# otherwise stayed in memory and in /status for good.
FORGET_DISCONNECTED_S = 3600.0
MAX_NODES = 10_000


@dataclass
class TypeStatus:
    sent_version: str = ""
    acked_version: str = ""
    last_nack: dict[str, Any] | None = None  # version, error, at
    nacks: int = 0
    responses: int = 0


@dataclass
class NodeStatus:
    node_id: str
    cluster: str
    mode: str  # "sotw" or "delta"
    streams: int = 0
    connected_at: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.time)
    disconnected_at: float | None = None  # when its last stream ended (None: one is open)
    types: dict[str, TypeStatus] = field(default_factory=dict)

    def of(self, short_type: str) -> TypeStatus:
        return self.types.setdefault(short_type, TypeStatus())


class NodeRegistry:
    """Per node id; a reconnecting Envoy keeps its entry (and its NACK history)."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeStatus] = {}

    def connect(self, node_id: str, cluster: str, mode: str) -> NodeStatus:
        self._forget(time.time())
        status = self.nodes.get(node_id)
        if status is None:
            status = self.nodes[node_id] = NodeStatus(node_id, cluster, mode)
        status.mode = mode
        status.cluster = cluster
        status.streams += 1
        status.connected_at = time.time()
        status.disconnected_at = None
        return status

    def disconnect(self, status: NodeStatus) -> None:
        status.streams = max(0, status.streams - 1)
        if status.streams == 0:
            status.disconnected_at = time.time()

    def _forget(self, now: float) -> None:
        gone = sorted(
            (s.disconnected_at, s.node_id)
            for s in self.nodes.values()
            if s.disconnected_at is not None
        )
        excess = len(self.nodes) + 1 - MAX_NODES  # room for the one connecting
        for index, (at, node_id) in enumerate(gone):
            if at > now - FORGET_DISCONNECTED_S and index >= excess:
                break
            del self.nodes[node_id]

    def as_json(self) -> list[dict[str, Any]]:
        return [
            {
                "node_id": s.node_id,
                "cluster": s.cluster,
                "mode": s.mode,
                "connected": s.streams > 0,
                "last_seen": round(s.last_seen, 3),
                "types": {
                    name: {
                        "sent_version": t.sent_version,
                        "acked_version": t.acked_version,
                        "in_sync": t.sent_version == t.acked_version,
                        "responses": t.responses,
                        "nacks": t.nacks,
                        "last_nack": t.last_nack,
                    }
                    for name, t in sorted(s.types.items())
                },
            }
            for s in sorted(self.nodes.values(), key=lambda s: s.node_id)
        ]
