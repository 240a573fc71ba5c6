"""The model: the mesh's values and the pure rules over them, with no I/O.

``mesh`` holds what every stage passes around (``EndpointAddress``, ``ModelRoute``,
``MeshState``, ``UpstreamTls`` ...); ``schema`` checks configuration values and names the field
in each error; ``lanes`` are SLA classes and label rules; ``canary`` is a canary run's policy and
its pure state machine; ``operator_state`` keeps an operator's overrides and version splits.
Everything above reads these; they import only ``scoring``'s types.
"""

from control_plane.lazy import exports

__getattr__, __all__ = exports(
    __name__,
    {
        "CanaryPolicy": "canary",
        "Checker": "schema",
        "EndpointAddress": "mesh",
        "EndpointHealth": "mesh",
        "InvalidChange": "operator_state",
        "MeshState": "mesh",
        "ModelRoute": "mesh",
        "OperatorState": "operator_state",
        "UpstreamTls": "mesh",
    },
)
