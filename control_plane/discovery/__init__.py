"""Discovery: which servers exist and what they serve.

``resolver`` turns the topology's endpoint sources into addresses (static addresses, DNS
names re-resolved, Kubernetes Services through their EndpointSlices in ``kubernetes``, with
the pod at each address); ``endpoints`` keeps the current set and runs the loops that follow
the sources; and
``placement`` asks every server, over mTLS as the control plane where the mesh has it, which
model versions are READY (RepositoryIndex, ServerReady). Routing and the xDS builders read
what it found; nothing here decides weights.
"""

from control_plane.lazy import exports

__getattr__, __all__ = exports(
    __name__,
    {
        "DiscoveredEndpoints": "endpoints",
        "EndpointResolver": "resolver",
        "PlacementPoller": "placement",
    },
)
