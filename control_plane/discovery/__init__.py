"""Discovery: which servers exist and what they serve.

``resolver`` turns the topology's endpoint sources into addresses (static addresses, DNS
names re-resolved, Kubernetes Services through their EndpointSlices in ``kubernetes``), and
``placement`` asks every server, over mTLS as the control plane where the mesh has it, which
model versions are READY (RepositoryIndex, ServerReady). Routing and the xDS builders read
what it found; nothing here decides weights.
"""

from control_plane.lazy import exports

__getattr__, __all__ = exports(
    __name__, {"EndpointResolver": "resolver", "PlacementPoller": "placement"}
)
