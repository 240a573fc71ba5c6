"""An ``endpoints:`` item that names a Kubernetes Service, checked as configuration.

Topology syntax::

    - kubernetes: {service: infermesh-model-server, namespace: infermesh, port: grpc}

``port`` is a port name or number as the Service's EndpointSlices list it (a number is the
pod's, target, port); ``namespace`` defaults to the pod's own (the service account's namespace
file), else ``default``. ``discovery.kubernetes`` watches what this names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from control_plane.model.schema import Checker

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
NAMESPACE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # DNS-1123 label
_SERVICE = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")  # DNS-1035 label
_PORT_NAME = re.compile(r"(?=.{1,15}$)(?=.*[a-z])[a-z0-9]+(-[a-z0-9]+)*")  # IANA_SVC_NAME


@dataclass(frozen=True)
class KubernetesEndpoint:
    service: str
    namespace: str
    port: str | int  # a port name, or a number

    @property
    def key(self) -> str:
        return f"kubernetes:{self.namespace}/{self.service}:{self.port}"


def default_namespace() -> str:
    """The pod's namespace (the service account's file), else "default" (blocking read)."""
    try:
        return (SERVICE_ACCOUNT / "namespace").read_text(encoding="utf-8").strip() or "default"
    except (OSError, UnicodeDecodeError):
        return "default"


def parse_source(c: Checker, value: object, path: str) -> KubernetesEndpoint | None:
    """An ``endpoints[i].kubernetes`` mapping, every error recorded in ``c``; None if invalid."""
    m = c.mapping(value, path)
    if m is None:
        return None
    before = len(c.errors)
    c.keys(m, path, ("service", "namespace", "port"), required=("service", "port"))
    service, namespace, port = m.get("service"), m.get("namespace"), m.get("port")
    if "service" in m and not (isinstance(service, str) and _SERVICE.fullmatch(service)):
        what = "a Service name (a lower-case DNS-1035 label: a-z, 0-9, '-', at most 63)"
        c.fail(f"{path}.service", f"must be {what}", service)
    if "namespace" in m and not (
        isinstance(namespace, str) and NAMESPACE_NAME.fullmatch(namespace)
    ):
        what = "a namespace (a lower-case DNS-1123 label: a-z, 0-9, '-', at most 63)"
        c.fail(f"{path}.namespace", f"must be {what}", namespace)
    is_number = isinstance(port, int) and not isinstance(port, bool)
    if "port" in m and not (
        (is_number and 1 <= port <= 65535)  # type: ignore[operator]
        or (isinstance(port, str) and _PORT_NAME.fullmatch(port))
    ):
        what = "a port number in 1..65535 or a port name (a-z, 0-9, '-', at most 15)"
        c.fail(f"{path}.port", f"must be {what}", port)
    if len(c.errors) > before:
        return None
    assert isinstance(service, str) and isinstance(port, str | int)
    return KubernetesEndpoint(
        service, namespace if isinstance(namespace, str) else default_namespace(), port
    )
