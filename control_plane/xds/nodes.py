"""What each Envoy node has been sent, has accepted and has rejected: the status view of xDS."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


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
    types: dict[str, TypeStatus] = field(default_factory=dict)

    def of(self, short_type: str) -> TypeStatus:
        return self.types.setdefault(short_type, TypeStatus())


class NodeRegistry:
    """Per node id; a reconnecting Envoy keeps its entry (and its NACK history)."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeStatus] = {}

    def connect(self, node_id: str, cluster: str, mode: str) -> NodeStatus:
        status = self.nodes.get(node_id)
        if status is None:
            status = self.nodes[node_id] = NodeStatus(node_id, cluster, mode)
        status.mode = mode
        status.cluster = cluster
        status.streams += 1
        status.connected_at = time.time()
        return status

    def disconnect(self, status: NodeStatus) -> None:
        status.streams = max(0, status.streams - 1)

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
