"""Mixed fleets, pure parts: labels, placement rules, SLA-class and large-input lanes, from the
topology file to the Envoy resources (clusters with priorities, routes with their policies)."""

from __future__ import annotations

from typing import Any

import pytest
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.route.v3 import route_components_pb2 as rc_pb2
from envoy.config.route.v3 import route_pb2

from control_plane.config.topology import Topology, TopologyError, parse_topology
from control_plane.discovery.placement import EndpointReport
from control_plane.model.lanes import (
    fleet_labels,
    lane_members,
    large_cluster,
    matches,
    sla_cluster,
)
from control_plane.model.mesh import (
    EndpointAddress,
    LargeInputs,
    SlaClass,
    base_cluster,
    model_cluster,
    rest_cluster,
)
from control_plane.routing.mesh_state import build_mesh_state
from control_plane.xds.resources import ENDPOINT_TYPE, ROUTE_TYPE, build_resources
from model_server.core.memory import device_class_name

A, B, C, D = (EndpointAddress("127.0.0.1", p) for p in (8001, 8002, 8003, 8004))
MODEL = {"name": "classifier", "sla_p99_ms": 50, "capacity_qps": 100}


def topology(**model: Any) -> Topology:
    return parse_topology({"models": [{**MODEL, **model}]})


def ready(*addresses: EndpointAddress) -> dict[EndpointAddress, EndpointReport]:
    models = frozenset({("classifier", "1")})
    return {a: EndpointReport(a, True, models, True, "") for a in addresses}


@pytest.mark.parametrize(
    ("labels", "rule", "expected"),
    [
        ((("device_class", "a100"),), (("device_class", ("a100", "h100")),), True),
        ((("device_class", "a10g"),), (("device_class", ("a100", "h100")),), False),
        ((), (("device_class", ("a100",)),), False),
        ((("device_class", "a100"), ("zone", "b")), (("device_class", ("a100",)),), True),
        ((("device_class", "a100"),), (("device_class", ("a100",)), ("zone", ("b",))), False),
        ((), (), True),
    ],
)
def test_matches(labels: Any, rule: Any, expected: bool) -> None:
    assert matches(labels, rule) is expected


def test_topology_labels_win_over_reported_ones() -> None:
    labels = fleet_labels(
        {"a": (("device_class", "a100"),)},
        {"a": (("device_class", "cpu"), ("zone", "b")), "b": (("device_class", "cpu"),)},
    )
    assert labels == {
        "a": (("device_class", "a100"), ("zone", "b")),
        "b": (("device_class", "cpu"),),
    }


INTERACTIVE = SlaClass("interactive", 1.0, 2)
BATCH = SlaClass("batch", 30.0, 0)


@pytest.mark.parametrize(
    ("reserved", "expected_shared", "expected_interactive", "expected_batch"),
    [
        # Nobody reserved: each class lane is the shared pool at priority 0.
        ({}, {"a", "b", "c"}, [("a", 0), ("b", 0), ("c", 0)], [("a", 0), ("b", 0), ("c", 0)]),
        # One reserved for interactive: it first, the shared ones as spill-over; batch never
        # reaches it, and neither do the model's other routes.
        (
            {"a": "interactive"},
            {"b", "c"},
            [("a", 0), ("b", 1), ("c", 1)],
            [("b", 0), ("c", 0)],
        ),
        # Reserved for a class this model does not declare: shared for this model.
        ({"a": "other"}, {"a", "b", "c"}, [("a", 0), ("b", 0), ("c", 0)], None),
    ],
)
def test_sla_lanes(
    reserved: dict[str, str],
    expected_shared: set[str],
    expected_interactive: list[tuple[str, int]],
    expected_batch: list[tuple[str, int]] | None,
) -> None:
    labels = {k: (("reserved_for", v),) for k, v in reserved.items()}
    lanes = lane_members("m", ["a", "b", "c"], labels, (INTERACTIVE, BATCH), None)
    assert lanes.shared == expected_shared
    assert list(lanes.lanes[sla_cluster("m", "interactive")]) == expected_interactive
    if expected_batch is not None:
        assert list(lanes.lanes[sla_cluster("m", "batch")]) == expected_batch


@pytest.mark.parametrize(
    ("classes", "expected"),
    [
        ({"a": "a100", "b": "cpu", "c": "cpu"}, [("a", 0), ("b", 1), ("c", 1)]),
        ({"a": "cpu", "b": "cpu"}, [("a", 0), ("b", 0)]),  # none preferred: the whole pool
        ({"a": "a100", "b": "a100"}, [("a", 0), ("b", 0)]),
    ],
)
def test_large_input_lane(classes: dict[str, str], expected: list[tuple[str, int]]) -> None:
    labels = {k: (("device_class", v),) for k, v in classes.items()}
    large = LargeInputs(1024, (("device_class", ("a100",)),))
    lanes = lane_members("m", list(classes), labels, (), large)
    assert list(lanes.lanes[large_cluster("m")]) == expected


@pytest.mark.parametrize(
    ("model", "error"),
    [
        ({"placement": {"require": {"device_class": []}}}, "placement.require.device_class"),
        ({"placement": {"prefer": {"Bad Name": "x"}}}, "placement.prefer.Bad Name"),
        ({"placement": {"prefer_weight": -1}}, "placement.prefer_weight: must be >= 0"),
        ({"placement": {"wanted": {}}}, "placement.wanted: unknown key"),
        ({"capacity_qps": {"a100": 10}}, "capacity_qps.default: required"),
        ({"capacity_qps": {"default": 10, "a100": -1}}, "capacity_qps.a100: must be > 0"),
        ({"memory_bytes": 0}, "memory_bytes: must be > 0"),
        ({"sla_classes": {"batch": {"timeout_s": 0}}}, "sla_classes.batch.timeout_s"),
        (
            {"sla_classes": {"fast": {"timeout_s": 1, "per_try_timeout_s": 2}}},
            "sla_classes.fast.per_try_timeout_s: must be <= timeout_s (1), got 2",
        ),
        ({"sla_classes": {"fast": {"retries": 1}}}, "sla_classes.fast.retries: unknown key"),
        ({"large_inputs": {"min_bytes": 0, "prefer": {"a": "b"}}}, "large_inputs.min_bytes"),
        ({"large_inputs": {"min_bytes": 10}}, "large_inputs.prefer: required"),
    ],
)
def test_model_rule_errors_name_the_field(model: dict[str, Any], error: str) -> None:
    with pytest.raises(TopologyError) as raised:
        topology(**model)
    assert any(error in e for e in raised.value.errors), raised.value.errors


@pytest.mark.parametrize(
    ("endpoint", "error"),
    [
        ({"address": "127.0.0.1:1", "labels": {"zone": 3}}, "endpoints[0].labels.zone"),
        ({"address": "127.0.0.1:1", "kind": "tgi"}, "endpoints[0].kind: must be one of"),
        (
            {"address": "127.0.0.1:1", "metrics_url": "http://x/metrics"},
            "metrics_url: only for kind triton",
        ),
        (
            {"address": "127.0.0.1:1", "kind": "triton", "metrics_url": "ftp://x"},
            "metrics_url: must be an http",
        ),
        ({"dns": "a.local:1", "labels": {"a": "b"}}, "only go with an 'address' endpoint"),
    ],
)
def test_endpoint_errors_name_the_field(endpoint: dict[str, Any], error: str) -> None:
    with pytest.raises(TopologyError) as raised:
        parse_topology({"models": [MODEL], "endpoints": [endpoint]})
    assert any(error in e for e in raised.value.errors), raised.value.errors


def test_the_topology_reads_rules_classes_and_endpoint_kinds() -> None:
    t = parse_topology(
        {
            "models": [
                {
                    **MODEL,
                    "capacity_qps": {"default": 100, "a100": 300},
                    "memory_bytes": 10 * 2**30,
                    "placement": {"require": {"device_class": ["a100", "cpu"]},
                                  "prefer": {"precision": "fp16"}},
                    "sla_classes": {"interactive": {"timeout_s": 1, "per_try_timeout_s": 0.3},
                                    "batch": {"timeout_s": 30, "max_retries": 0}},
                }
            ],
            "endpoints": [
                {"address": "127.0.0.1:8001", "labels": {"device_class": "a100"}},
                {"address": "127.0.0.1:8011", "kind": "triton"},
            ],
        }
    )  # fmt: skip
    policy = t.policy("classifier")
    assert policy.capacity_for("a100") == 300 and policy.capacity_for("cpu") == 100
    assert policy.memory_need_bytes == 10 * 2**30
    assert policy.require_labels == (("device_class", ("a100", "cpu")),)
    assert policy.score_weights.labels == 0.2  # a preference gets a default weight
    assert t.models[0].sla_classes == (
        SlaClass("interactive", 1.0, None, 0.3),
        SlaClass("batch", 30.0, 0, None),
    )
    assert t.endpoint_labels["127.0.0.1:8001"] == (("device_class", "a100"),)
    assert t.scrape_targets == {"127.0.0.1:8011": "http://127.0.0.1:8012/metrics"}


def test_a_required_label_keeps_an_endpoint_out_of_every_cluster_of_the_model() -> None:
    t = topology(placement={"require": {"device_class": "a100"}})
    labels = {A.key: (("device_class", "a100"),), B.key: (("device_class", "cpu"),)}
    state = build_mesh_state(t, ready(A, B, C), labels=labels)
    assert [a.address for a in state.clusters[model_cluster("classifier")]] == [A]
    assert [a.address for a in state.clusters[model_cluster("classifier", "1")]] == [A]


def test_reserved_endpoints_serve_only_their_class_and_lanes_carry_priorities() -> None:
    t = topology(sla_classes={"interactive": {"timeout_s": 1}, "batch": {"timeout_s": 30}})
    labels = {A.key: (("reserved_for", "interactive"),)}
    state = build_mesh_state(t, ready(A, B, C), labels=labels)
    assert [a.address for a in state.clusters[model_cluster("classifier")]] == [B, C]
    interactive = state.clusters[sla_cluster("classifier", "interactive")]
    assert [(a.address, a.priority) for a in interactive] == [(A, 0), (B, 1), (C, 1)]
    batch = state.clusters[sla_cluster("classifier", "batch")]
    assert [(a.address, a.priority) for a in batch] == [(B, 0), (C, 0)]
    load = build_resources(state)[ENDPOINT_TYPE][sla_cluster("classifier", "interactive")]
    assert isinstance(load, endpoint_pb2.ClusterLoadAssignment)
    levels = [(g.priority, [e.endpoint.address.socket_address.port_value for e in g.lb_endpoints])
              for g in load.endpoints]  # fmt: skip
    assert levels == [(0, [8001]), (1, [8002, 8003])]
    twin = build_resources(state)[ENDPOINT_TYPE][
        rest_cluster(sla_cluster("classifier", "interactive"))
    ]
    assert isinstance(twin, endpoint_pb2.ClusterLoadAssignment)
    levels = [(g.priority, [e.endpoint.address.socket_address.port_value for e in g.lb_endpoints])
              for g in twin.endpoints]  # fmt: skip
    assert levels == [(0, [10001]), (1, [10002, 10003])]  # the REST twin keeps the priorities


def _routes(t: Topology, labels: dict[str, Any] | None = None) -> list[rc_pb2.Route]:
    state = build_mesh_state(t, ready(A, B), labels=labels or {})
    config = build_resources(state)[ROUTE_TYPE]["infermesh-routes"]
    assert isinstance(config, route_pb2.RouteConfiguration)
    return list(config.virtual_hosts[0].routes)


def _headers(route: rc_pb2.Route) -> dict[str, str]:
    out = {}
    for h in route.match.headers:
        if h.HasField("range_match"):
            out[h.name] = f">={h.range_match.start}"
        elif h.present_match:
            out[h.name] = "present"
        else:
            out[h.name] = h.string_match.exact
    return out


def test_class_routes_carry_their_own_timeout_and_retries_before_the_model_route() -> None:
    t = topology(
        timeout_s=5,
        sla_classes={
            "interactive": {"timeout_s": 1, "per_try_timeout_s": 0.25, "max_retries": 2},
            "batch": {"timeout_s": 30, "max_retries": 0},
        },
    )
    grpc_routes = [r for r in _routes(t) if not r.name.startswith("rest:")]
    names = [r.name for r in grpc_routes]
    interactive = names.index(sla_cluster("classifier", "interactive"))
    unknown = names.index("model:classifier:sla-unknown")
    default = names.index("model:classifier")
    assert interactive < unknown < default
    route = grpc_routes[interactive]
    assert _headers(route) == {"x-model-name": "classifier", "x-sla-class": "interactive"}
    assert route.route.cluster == sla_cluster("classifier", "interactive")
    assert route.route.timeout.seconds == 1
    assert route.route.retry_policy.num_retries.value == 2
    assert route.route.retry_policy.per_try_timeout.ToMilliseconds() == 250
    batch = grpc_routes[names.index(sla_cluster("classifier", "batch"))]
    assert batch.route.timeout.seconds == 30 and batch.route.retry_policy.num_retries.value == 0
    error = grpc_routes[unknown]
    sent = {h.header.key: h.header.value for h in error.response_headers_to_add}
    assert sent["grpc-status"] == "3"
    assert "x-sla-class" in sent["grpc-message"] and "interactive, batch" in sent["grpc-message"]
    assert grpc_routes[default].route.timeout.seconds == 5


def test_large_inputs_route_by_declared_size_or_content_length_over_grpc_and_rest() -> None:
    t = topology(large_inputs={"min_bytes": 65536, "prefer": {"device_class": "a100"}})
    routes = _routes(t, {A.key: (("device_class", "a100"),)})
    large = [r for r in routes if base_cluster(r.route.cluster) == large_cluster("classifier")]
    by_header = sorted(
        (r.name.startswith("rest:"), _headers(r).get("x-input-bytes", ""),
         _headers(r).get("content-length", "")) for r in large if not r.match.path
    )  # fmt: skip
    assert by_header == [
        (False, "", ">=65536"),
        (False, ">=65536", ""),
        (True, "", ">=65536"),
        (True, ">=65536", ""),
    ]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("Tesla T4", "t4"),
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("NVIDIA L40S", "l40s"),
        ("", "unknown"),
    ],
)
def test_device_class_from_the_nvml_name(name: str, expected: str) -> None:
    assert device_class_name(name) == expected


def test_an_endpoint_of_its_own_rest_port_keeps_it_in_every_rest_twin() -> None:
    """A Triton member serves REST next to gRPC (8000 by 8001), not at the offset."""
    t = parse_topology(
        {
            "models": [MODEL],
            "endpoints": [
                {"address": A.key},
                {"address": "127.0.0.1:8011", "kind": "triton"},  # Triton's layout: 8010
                {"address": C.key, "rest_port": 9999},
            ],
        }
    )
    triton = EndpointAddress("127.0.0.1", 8011)
    state = build_mesh_state(t, ready(A, triton, C))
    assert state.rest_ports == ((C, 9999), (triton, 8010))
    twin = build_resources(state)[ENDPOINT_TYPE][rest_cluster(model_cluster("classifier"))]
    assert isinstance(twin, endpoint_pb2.ClusterLoadAssignment)
    ports = sorted(e.endpoint.address.socket_address.port_value for g in twin.endpoints
                   for e in g.lb_endpoints)  # fmt: skip
    assert ports == [8010, 9999, 10001]
