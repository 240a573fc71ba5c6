"""Routing: the decisions, made from what discovery found and what telemetry says.

``loop`` is routing's own loop (every tick, or sooner when telemetry moved); ``router`` scores
every pool with the ``scoring`` plugins and returns a ``RecomputeResult``
(weights, ejections and their causes, with reasons for people); ``mesh_state`` turns the
topology and placement into the ``MeshState`` xDS is built from; ``canary_runs`` drives canary
runs; ``fallback`` opens and closes circuits to fallback models; ``envoy_checks`` reads Envoy's
own health checks. Decisions are recorded with their causes so each can be explained.
"""

from control_plane.lazy import exports

__getattr__, __all__ = exports(
    __name__,
    {
        "CanaryRuns": "canary_runs",
        "Fallbacks": "fallback",
        "RecomputeResult": "router",
        "Router": "router",
        "RoutingLoop": "loop",
        "build_mesh_state": "mesh_state",
    },
)
