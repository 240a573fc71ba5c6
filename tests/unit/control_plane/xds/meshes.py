"""The small mesh the xDS builder tests build resources from: two servers, two models."""

from __future__ import annotations

from typing import Any

from control_plane.model.mesh import (
    SERVERS_CLUSTER,
    EndpointAddress,
    EndpointAssignment,
    EndpointHealth,
    ListenerOptions,
    MeshState,
    ModelRoute,
    RestOptions,
    model_cluster,
)

A = EndpointAddress("127.0.0.1", 9001)
B = EndpointAddress("127.0.0.1", 9002)
V1, V2 = model_cluster("classifier", "1"), model_cluster("classifier", "2")
GRPC_ONLY: dict[str, Any] = {"rest": RestOptions(enabled=False), "grpc_web": False}


def mesh_state() -> MeshState:
    """Two models (the classifier split 90/10 across versions), two servers, one draining."""
    a = EndpointAssignment(A, weight=3)
    b = EndpointAssignment(B, weight=1, health=EndpointHealth.DRAINING)
    classifier = ModelRoute("classifier", 50, timeout_s=2.5, version_split=(("1", 90), ("2", 10)))
    return MeshState(
        # The gRPC-only mesh: REST and gRPC-Web are tested in test_edge.py.
        listener=ListenerOptions(
            port=8080, health_check_interval_s=0.5, retry_budget_percent=20, **GRPC_ONLY
        ),
        models=(classifier, ModelRoute("detector", sla_p99_ms=80, timeout_s=4)),
        clusters={
            SERVERS_CLUSTER: (a, b),
            V1: (a, b),
            V2: (a,),
            model_cluster("classifier"): (a, b),
            model_cluster("detector"): (),
        },
    )
