"""The wire contract (``infermesh.wire``) holds on both sides: what the model server exports is
what the control plane reads, with the same kinds; every header the edge sets is one the edge
strips from clients; Envoy's bootstrap tags its stats with the node tag the control plane
files them by."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from control_plane.telemetry import decode as otlp_decode
from control_plane.xds import exposure
from control_plane.xds.bootstrap import render_bootstrap
from infermesh import wire
from model_server.observability.metrics import ServerMetrics


def test_the_model_server_exports_every_metric_the_control_plane_reads_as_its_kind() -> None:
    exported = {
        family.name: family.type for family in ServerMetrics(CollectorRegistry()).registry.collect()
    }
    for name, kind in wire.TELEMETRY_KINDS.items():
        assert exported.get(name) == kind, (
            f"{name}: exported as {exported.get(name)}, read as {kind}"
        )
    assert otlp_decode.KINDS is wire.TELEMETRY_KINDS


def test_headers_the_edge_sets_are_headers_a_client_cannot_send() -> None:
    edge_set = (
        wire.TENANT_HEADER, wire.TENANT_LABEL_HEADER, wire.KEY_ID_HEADER, wire.JWT_TENANT_HEADER,
        wire.PRIORITY_PERMISSION_HEADER, wire.VERSION_PERMISSION_HEADER,
        wire.RATE_LIMITED_HEADER, wire.FALLBACK_HEADER,
    )  # fmt: skip
    assert wire.INTERNAL_PREFIX in exposure.STRIPPED_PREFIXES
    assert all(h.startswith(wire.INTERNAL_PREFIX) for h in edge_set)
    client_sent = (wire.MODEL_HEADER, wire.VERSION_HEADER, wire.PRIORITY_HEADER)
    assert not any(h.startswith(p) for h in client_sent for p in exposure.STRIPPED_PREFIXES)


def test_envoys_stats_carry_the_node_tag_the_control_plane_reads() -> None:
    config = render_bootstrap(
        node_id="e1", node_cluster="c", xds_host="127.0.0.1", xds_port=1, admin_port=2,
        delta=False, otlp_port=3,
    )  # fmt: skip
    tags = config["stats_config"]["stats_tags"]
    assert {"tag_name": wire.ENVOY_NODE_TAG, "fixed_value": "e1"} in tags
