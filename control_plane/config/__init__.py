"""Configuration: the topology file, parsed and checked as a whole.

``topology`` loads the file and reports every error with the path of its field; ``models``
parses the ``models:`` list, ``tenants`` the listener's auth and tenants, and
``kubernetes_source`` an ``endpoints:`` item that names a Kubernetes Service. The listener's
policy sections (edge, limits, TLS, exposure, upstream TLS) are parsed by the ``xds`` modules
that build them, so one module owns a policy's syntax and its Envoy form.
"""

from control_plane.lazy import exports

__getattr__, __all__ = exports(
    __name__,
    {
        "Topology": "topology",
        "TopologyError": "topology",
        "load_topology": "topology",
        "parse_topology": "topology",
    },
)
