"""xDS: what Envoy is told, built from the model alone, and the ADS server that tells it.

``resources`` builds listeners, routes and clusters from a ``MeshState`` (with ``clusters``,
``edge`` for the public listener and REST, ``edge_limits``, ``edge_tls``, ``exposure``,
``identity`` for authentication and tenants, ``protection`` for rate limits and circuit
breakers, ``upstream_tls`` for mTLS and SDS secrets, ``lua_routing``); ``incremental`` rebuilds
only what changed; ``snapshot`` holds the immutable, versioned ``Snapshot`` set in one place;
``ads`` serves it (state of the world and delta) and ``nodes`` records what each Envoy acked.
``bootstrap`` writes an Envoy's bootstrap file. Nothing here reads telemetry or decides.
"""

from control_plane.lazy import exports

__getattr__, __all__ = exports(
    __name__,
    {
        "AdsServicer": "ads",
        "NodeRegistry": "nodes",
        "Snapshot": "snapshot",
        "SnapshotBuilder": "incremental",
        "SnapshotCache": "snapshot",
        "build_snapshot": "snapshot",
    },
)
