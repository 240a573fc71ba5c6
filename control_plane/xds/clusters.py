"""Envoy clusters and endpoint assignments for a ``MeshState`` (pure): EDS clusters over ADS
with HTTP/2 upstreams, gRPC health checks, outlier detection, no panic mode and the model's
circuit breakers (REST twins made by ``control_plane.xds.edge``), and ``ClusterLoadAssignment``s
with each endpoint's weight, health and priority."""

from __future__ import annotations

import functools
from collections.abc import Iterable

from envoy.config.cluster.v3 import cluster_pb2, outlier_detection_pb2
from envoy.config.core.v3 import address_pb2, protocol_pb2
from envoy.config.core.v3 import health_check_pb2 as hc_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2 as ep_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2 as http_pb2
from envoy.type.v3 import percent_pb2
from google.protobuf import any_pb2
from google.protobuf.wrappers_pb2 import BoolValue, UInt32Value

from control_plane.model.mesh import (
    NO_PODS,
    EndpointAssignment,
    EndpointHealth,
    ListenerOptions,
    MeshState,
    ModelRoute,
    ServerPods,
    checks_health,
    cluster_model,
    is_rest_cluster,
)
from control_plane.xds import affinity, edge, upstream_tls
from control_plane.xds.edge import HTTP_PROTOCOL_OPTIONS
from control_plane.xds.envoy_values import ads_source, duration, packed
from control_plane.xds.protection import NO_SPILL_OVERPROVISIONING, circuit_breakers
from infermesh.pki import server_name

_HEALTH = {
    EndpointHealth.HEALTHY: hc_pb2.HEALTHY,
    EndpointHealth.DRAINING: hc_pb2.DRAINING,
    EndpointHealth.UNHEALTHY: hc_pb2.UNHEALTHY,
}


def socket_address(host: str, port: int) -> address_pb2.Address:
    return address_pb2.Address(
        socket_address=address_pb2.SocketAddress(address=host, port_value=port)
    )


def http2_options() -> dict[str, any_pb2.Any]:
    explicit = http_pb2.HttpProtocolOptions.ExplicitHttpConfig(
        http2_protocol_options=protocol_pb2.Http2ProtocolOptions()
    )
    return {
        HTTP_PROTOCOL_OPTIONS: packed(http_pb2.HttpProtocolOptions(explicit_http_config=explicit))
    }


def health_check(interval_s: float) -> hc_pb2.HealthCheck:
    return hc_pb2.HealthCheck(
        timeout=duration(1.0),
        interval=duration(interval_s),
        # The default (60 s) applies until a cluster has traffic: new hosts would wait that long.
        no_traffic_interval=duration(interval_s),
        unhealthy_threshold=UInt32Value(value=2),
        healthy_threshold=UInt32Value(value=1),
        grpc_health_check=hc_pb2.HealthCheck.GrpcHealthCheck(service_name=""),
    )


def outlier_detection() -> outlier_detection_pb2.OutlierDetection:
    return outlier_detection_pb2.OutlierDetection(
        consecutive_5xx=UInt32Value(value=5),
        consecutive_gateway_failure=UInt32Value(value=3),
        # Gateway-failure ejection is only counted, not enforced, unless this is set.
        enforcing_consecutive_gateway_failure=UInt32Value(value=100),
        interval=duration(1.0),
        base_ejection_time=duration(5.0),
        max_ejection_percent=UInt32Value(value=50),
        # A passing gRPC health check proves the server answers Check, not that its inferences
        # are fast: by default it would return a host ejected for stalled tries (a hedge's per-try
        # timeout counts as a gateway failure) within one check interval, to stall three more.
        successful_active_health_check_uneject_host=BoolValue(value=False),
        max_ejection_time=duration(30.0),  # each ejection in a row adds 5 s, up to this
    )


_LB_POLICY = {
    "least_request": cluster_pb2.Cluster.LEAST_REQUEST,
    "round_robin": cluster_pb2.Cluster.ROUND_ROBIN,
}


def build_cluster(state: MeshState, name: str) -> cluster_pb2.Cluster:
    options = state.listener
    model = next((m for m in state.models if m.name == cluster_model(name)), None)
    result = cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.EDS,
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(
            eds_config=ads_source(), service_name=name
        ),
        connect_timeout=duration(options.connect_timeout_s),
        typed_extension_protocol_options=http2_options(),
        lb_policy=_LB_POLICY[options.lb_policy],
        common_lb_config=cluster_pb2.Cluster.CommonLbConfig(
            # The 1 s default delays health changes on the worker load balancers.
            update_merge_window=duration(0),
            # No panic mode: an ejected or failing server gets no traffic even when most of the
            # pool is out; the control plane caps ejections, and a fallback takes over at zero.
            healthy_panic_threshold=percent_pb2.Percent(value=0),
        ),
        health_checks=[health_check(options.health_check_interval_s)]
        if checks_health(options, name)
        else [],
        outlier_detection=outlier_detection(),
        circuit_breakers=circuit_breakers(
            retry_budget_percent(options, model), model.circuit_breaker if model else None
        ),
        # Per-endpoint stats reach the control plane through Envoy's stat sink every second:
        # where Envoy checks (every cluster, or with health_checks "model" the model's own
        # clusters, which checked_down reads). On every cluster, 10,000 servers in six
        # clusters each meant some 540,000 endpoint stats a second from every Envoy.
        track_cluster_stats=cluster_pb2.TrackClusterStats(
            per_endpoint_stats=checks_health(options, name)
        ),
        ignore_health_on_host_removal=True,
    )
    if model is not None and model.affinity is not None:
        affinity.balance(result, model.affinity)
    rest = is_rest_cluster(name)
    if options.upstream_tls is not None:
        alpn = "http/1.1" if rest else "h2"
        result.transport_socket.CopyFrom(upstream_tls.transport_socket(alpn))
        if options.upstream_tls.plaintext:  # members marked "tls: false" (lb_endpoint)
            result.transport_socket_matches.append(upstream_tls.plaintext_match())
    return edge.make_rest_cluster(result) if rest else result


@functools.lru_cache(maxsize=1 << 15)
def lb_endpoint(
    assignment: EndpointAssignment, trust_domain: str = "", plaintext: bool = False, pod: str = ""
) -> ep_pb2.LbEndpoint:
    """One endpoint's EDS entry, made once per assignment and copied into each assignment
    that holds it (never mutate one): `servers` at 10,000 endpoints took 66-75 ms to make and
    11-18 ms from made entries, side by side in one process. About 1 KB an entry (32 MiB at
    most). With ``trust_domain`` (upstream mTLS) the entry's hostname is the server's
    certificate name (its ``pod``'s on Kubernetes: ``pki.server_name``), which Envoy sends
    as SNI and checks the certificate against; a
    ``plaintext`` member instead carries the metadata that picks the cluster's plaintext
    transport socket (``upstream_tls.plaintext_match``)."""
    address = socket_address(assignment.address.host, assignment.address.port)
    checked = trust_domain and not plaintext
    hostname = server_name(assignment.server_address, pod, trust_domain) if checked else ""
    entry = ep_pb2.LbEndpoint(
        endpoint=ep_pb2.Endpoint(address=address, hostname=hostname),
        health_status=_HEALTH[assignment.health],
        load_balancing_weight=UInt32Value(value=max(1, assignment.weight)),
    )
    if trust_domain and plaintext:
        entry.metadata.filter_metadata[upstream_tls.MATCH_FILTER].update(upstream_tls.PLAINTEXT)
    return entry


def build_assignment(
    name: str,
    assignments: Iterable[EndpointAssignment],
    no_spill: bool = False,
    trust_domain: str = "",
    plaintext: frozenset[str] = frozenset(),
    pods: ServerPods = NO_PODS,
) -> endpoint_pb2.ClusterLoadAssignment:
    """``no_spill``: the cluster keeps all its traffic while any endpoint is healthy (it is the
    first of a fallback aggregate). ``pods``: the Kubernetes pod of each server address,
    whose name its certificate carries."""
    ordered = sorted(assignments, key=lambda a: (a.address.host, a.address.port))
    load = endpoint_pb2.ClusterLoadAssignment(cluster_name=name)
    if no_spill:
        load.policy.overprovisioning_factor.value = NO_SPILL_OVERPROVISIONING
    # Envoy needs priorities numbered 0, 1, ... without gaps.
    for level, priority in enumerate(sorted({a.priority for a in ordered})):
        # server_address builds a string: only asked for when some member is plaintext or
        # discovery named pods
        endpoints = [
            lb_endpoint(
                a, trust_domain, bool(plaintext) and a.server_address in plaintext,
                pods.get(a.server_address) if pods else "",
            )
            for a in ordered
            if a.priority == priority
        ]  # fmt: skip
        load.endpoints.add(lb_endpoints=endpoints, priority=level)
    return load


def retry_budget_percent(options: ListenerOptions, model: ModelRoute | None) -> float:
    """The share of a cluster's requests in flight that may be retries: the listener's, or a
    hedged model's hedging budget where that is lower (hedges count as retries in Envoy)."""
    if model is None or model.hedging is None:
        return options.retry_budget_percent
    return min(options.retry_budget_percent, model.hedging.budget_percent)
