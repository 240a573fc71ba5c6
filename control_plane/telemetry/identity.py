"""Telemetry bound to identity: with ``telemetry.tls`` the OTLP port speaks only mutual TLS,
and a report is taken only from the workload it reports for.

A model server's certificate names it (``spiffe://TD/model-server/HOST/PORT``); every resource
of its report must carry ``service.instance.id`` ``HOST:PORT``. On Kubernetes the certificate
names the server's pod (``/model-server/pod/NS/POD``) and its reports are taken for the address
the EndpointSlices say that pod has. An Envoy's certificate
(``/envoy/NODE``) may send Envoy's own stats only (its stat sink), tagged with its own node
id (the bootstrap's fixed ``infermesh.envoy_node`` tag, by which they are filed), and only an
Envoy's certificate may send a resource that says it is Envoy's: the receiver files such a
resource as Envoy's stats, which trip fallbacks and mark servers checked down. Anything
else is refused with PERMISSION_DENIED before a point is stored, counted in
``telemetry_reports_rejected_total{reason}``, and logged (at most once a minute per peer and
reason) with the peer and the identity it claimed. So a process that can reach the port can
neither fake another server's draining, memory or latency nor, without a mesh certificate,
connect at all.

The receiver presents the control plane's certificate (``upstream_tls.server_credentials``).
"""

from __future__ import annotations

import functools
import logging
import time

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)

from control_plane.config.topology import TelemetryOptions
from control_plane.model.mesh import NO_PODS, ServerPods
from control_plane.telemetry.envoy import is_envoy, node_of
from infermesh import pki
from infermesh.wire import INSTANCE_ID_ATTRIBUTE as INSTANCE_ID

log = logging.getLogger(__name__)
LOG_EVERY_S = 60.0


def refusal(
    spiffe_id: str | None,
    trust_domain: str,
    request: ExportMetricsServiceRequest,
    pods: ServerPods = NO_PODS,
) -> tuple[str, str] | None:
    """None when every resource is the peer's own, else (reason, message). ``pods``: on
    Kubernetes, the pod discovery says is at each address, whose certificate names the pod
    (``pki.model_server_pod``): a report for HOST:PORT is taken only from that pod."""
    who = pki.mesh_peer(spiffe_id, trust_domain)
    if who is None:
        return (
            "not_a_workload",
            f"{spiffe_id or 'a peer without a SPIFFE ID'} is not a mesh workload",
        )
    for resource in request.resource_metrics:
        if who.kind == "envoy":
            if not is_envoy(resource):
                return "not_envoy_stats", f"{spiffe_id} may send Envoy's stats only"
            node = node_of(resource)  # the key EnvoyStats files the whole resource under
            if node != "/".join(who.name):
                return "other_identity", f"{spiffe_id} sent stats for node {node or '(none)'!r}"
            continue
        if who.kind != "model-server":
            return "kind", f"{spiffe_id} may not send telemetry"
        if is_envoy(resource):  # filed as Envoy's stats, which steer fallback and health
            return "not_envoy", f"{spiffe_id} may not send Envoy's stats"
        claimed = next(
            (a.value.string_value for a in resource.resource.attributes if a.key == INSTANCE_ID),
            "",
        )
        if _server_identity(claimed, pods.get(claimed), who.trust_domain) != spiffe_id:
            return "other_identity", f"{spiffe_id} reported for {claimed or 'no instance id'!r}"
    return None


def plaintext_warnings(telemetry: TelemetryOptions) -> list[str]:
    """What /status and the live view say while telemetry is not bound to identity."""
    if telemetry.tls:
        return []
    where = f"{telemetry.host}:{telemetry.port}"
    if telemetry.insecure_plaintext:
        return [
            f"telemetry on {where} is plaintext and taken from the network "
            "(telemetry.insecure_plaintext): anyone who reaches it can report for any server; "
            "set telemetry.tls (docs/security.md)"
        ]
    return [
        f"telemetry on {where} is plaintext (development: loopback only): any local process "
        "can report for any server; set telemetry.tls (docs/security.md)"
    ]


@functools.lru_cache(maxsize=4096)  # every report asks; as pki.mesh_peer, bounded
def _server_identity(instance_id: str, pod: str, trust_domain: str) -> str | None:
    """The SPIFFE ID of the server an instance id (HOST:PORT, [V6]:PORT) names (its pod's
    when ``pod``), or None. Compared as identities, so an IPv6 address matches its
    certificate's form."""
    try:
        return pki.server_workload(instance_id, pod, trust_domain).spiffe_id
    except pki.CertificateError:
        return None


class RefusalLog:
    """One line per peer and reason a minute at most: a flood of refused reports does not
    flood the log."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], float] = {}

    def __call__(self, peer: str, reason: str, message: str) -> None:
        now = time.monotonic()
        key = (peer, reason)
        if now - self._last.get(key, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._last[key] = now
            log.warning("telemetry refused from %s (%s): %s", peer, reason, message)
