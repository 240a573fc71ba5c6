"""Envoy resources built from a MeshState, checked as messages and by the real Envoy binary."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import health_check_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from google.protobuf import json_format
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from control_plane.model.lanes import sla_cluster
from control_plane.model.mesh import (
    LISTENER_NAME,
    ROUTE_CONFIG_NAME,
    SERVERS_CLUSTER,
    EndpointAddress,
    EndpointAssignment,
    EndpointHealth,
    ListenerOptions,
    MeshState,
    ModelRoute,
    RestOptions,
    model_cluster,
)
from control_plane.xds import bootstrap
from control_plane.xds.clusters import build_assignment
from control_plane.xds.exposure import RBAC_FILTER
from control_plane.xds.openai_edge import OPENAI_LUA_FILTER
from control_plane.xds.resources import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    LUA_FILTER,
    ROUTE_TYPE,
    SERVER_PATHS,
    build_resources,
    duration,
)
from infermesh.wire import MODEL_HEADER, VERSION_HEADER
from tests.envoy_support import Envoy, envoy_binary, free_port, start_envoy
from tests.support import ROOT, ServerProcess, infer_classifier, start_server
from tests.unit.control_plane.xds.meshes import GRPC_ONLY, V1, V2, A, B, mesh_state

Resources = dict[str, dict[str, Any]]  # type URL -> name -> message
# What envoy/bootstrap.yaml is rendered from.
DEFAULT_BOOTSTRAP: dict[str, Any] = dict(
    node_id="envoy-1",
    node_cluster="infermesh",
    xds_host="127.0.0.1",
    xds_port=18000,
    admin_port=9901,
)


@pytest.fixture(scope="module")
def resources() -> Resources:
    return build_resources(mesh_state())


def routes_of(resources: Resources) -> list[Any]:
    return list(resources[ROUTE_TYPE][ROUTE_CONFIG_NAME].virtual_hosts[0].routes)


def manager_of(listener: listener_pb2.Listener) -> hcm_pb2.HttpConnectionManager:
    manager = hcm_pb2.HttpConnectionManager()
    assert listener.filter_chains[0].filters[-1].typed_config.Unpack(manager)
    return manager


def test_resource_names_per_type(resources: Resources) -> None:
    clusters = {SERVERS_CLUSTER, V1, V2, model_cluster("classifier"), model_cluster("detector")}
    assert set(resources) == {LISTENER_TYPE, ROUTE_TYPE, CLUSTER_TYPE, ENDPOINT_TYPE}
    assert set(resources[LISTENER_TYPE]) == {LISTENER_NAME}
    assert set(resources[ROUTE_TYPE]) == {ROUTE_CONFIG_NAME}
    assert set(resources[CLUSTER_TYPE]) == clusters
    assert set(resources[ENDPOINT_TYPE]) == clusters
    for type_url, items in resources.items():
        for name, message in items.items():
            assert type_url.endswith(message.DESCRIPTOR.full_name)
            assert name == getattr(message, "name", None) or name == message.cluster_name


def test_every_eds_name_is_a_cds_cluster_and_every_routed_cluster_exists(
    resources: Resources,
) -> None:
    clusters = resources[CLUSTER_TYPE]
    services = {c.eds_cluster_config.service_name for c in clusters.values()}
    assert set(resources[ENDPOINT_TYPE]) == services == set(clusters)
    for name, cluster in clusters.items():
        assert cluster.type == cluster_pb2.Cluster.EDS
        assert cluster.eds_cluster_config.eds_config.HasField("ads")
        assert resources[ENDPOINT_TYPE][name].cluster_name == name
    routed = set()
    for route in routes_of(resources):
        routed.add(route.route.cluster)
        routed.update(c.name for c in route.route.weighted_clusters.clusters)
    assert routed - {""} <= set(clusters)


def test_a_routed_cluster_missing_from_the_state_is_added_empty() -> None:
    state = MeshState(ListenerOptions(), (ModelRoute("m", 10, 1, (("3", 1),)),), {})
    built: Resources = build_resources(state)
    assert model_cluster("m", "3") in built[CLUSTER_TYPE]
    assert list(built[ENDPOINT_TYPE][model_cluster("m", "3")].endpoints) == []


def test_listener_routes_over_ads_with_lua_before_the_router(resources: Resources) -> None:
    listener = resources[LISTENER_TYPE][LISTENER_NAME]
    assert listener.address.socket_address.address == "127.0.0.1"
    assert listener.address.socket_address.port_value == 8080
    manager = manager_of(listener)
    assert manager.codec_type == hcm_pb2.HttpConnectionManager.AUTO
    assert manager.rds.route_config_name == ROUTE_CONFIG_NAME
    assert manager.rds.config_source.HasField("ads")
    assert [f.name for f in manager.http_filters] == [
        RBAC_FILTER, OPENAI_LUA_FILTER, LUA_FILTER, "envoy.filters.http.router"
    ]  # fmt: skip
    lua = lua_pb2.Lua()
    assert manager.http_filters[2].typed_config.Unpack(lua)
    code = lua.default_source_code.inline_string
    assert f'"{MODEL_HEADER}"' in code and f'"{VERSION_HEADER}"' in code
    assert "clearRouteCache" in code and '"ModelInfer"' in code and "ModelStreamInfer" not in code


def test_body_routing_off_drops_the_lua_filter() -> None:
    state = mesh_state()
    state = MeshState(
        ListenerOptions(body_routing=False, **GRPC_ONLY), state.models, state.clusters
    )
    built: Resources = build_resources(state)
    manager = manager_of(built[LISTENER_TYPE][LISTENER_NAME])
    assert [f.name for f in manager.http_filters] == [RBAC_FILTER, "envoy.filters.http.router"]
    assert not any(r.typed_per_filter_config for r in routes_of(built))


def test_route_order(resources: Resources) -> None:
    routes = routes_of(resources)
    servers = ["server:health-watch", *(f"server:{path}" for path in SERVER_PATHS)]
    clusters = [V1, V2, model_cluster("classifier"), model_cluster("detector")]
    models = [name for c in clusters for name in (f"{c}:stream", c)]  # the stream route first
    errors = ["model-not-found", "stream-without-model", "no-model-name"]
    assert [r.name for r in routes] == [*servers, *models, *errors]
    assert [r.match.prefix for r in routes[1 : len(servers)]] == list(SERVER_PATHS)
    assert all(r.route.cluster == SERVERS_CLUSTER for r in routes[: len(servers)])
    v1, detector = routes[len(servers) + 1], routes[len(servers) + 7]
    assert matched_headers(v1) == [(MODEL_HEADER, "classifier"), (VERSION_HEADER, "1")]
    assert v1.route.cluster == V1
    assert matched_headers(detector) == [(MODEL_HEADER, "detector")]
    assert detector.route.cluster == model_cluster("detector")
    # The Lua filter runs only where no header chose the route.
    lua_on = [r.name for r in routes if LUA_FILTER not in r.typed_per_filter_config]
    assert lua_on == ["no-model-name"]


def test_stream_routes_have_no_overall_timeout_and_no_retries(resources: Resources) -> None:
    by_name = {r.name: r for r in routes_of(resources)}
    stream = by_name[f"{model_cluster('classifier')}:stream"]
    assert stream.match.path == "/inference.GRPCInferenceService/ModelStreamInfer"
    assert matched_headers(stream) == [(MODEL_HEADER, "classifier")]
    assert stream.route.timeout == duration(0)  # a generation may stream for a long time
    assert stream.route.idle_timeout == duration(2.5)  # but not go quiet longer than this
    assert not stream.route.HasField("retry_policy")
    weights = [(c.name, c.weight.value) for c in stream.route.weighted_clusters.clusters]
    assert weights == [(V1, 90), (V2, 10)]  # the same split as the unary route


def test_a_health_watch_is_a_stream_not_a_unary_call(resources: Resources) -> None:
    """Before, Watch took the servers' unary route: Envoy's default 15 s route timeout and the
    listener's 120 s unary duration cut every Watch stream."""
    watch = routes_of(resources)[0]
    assert watch.match.path == "/grpc.health.v1.Health/Watch"
    assert watch.route.timeout == duration(0)
    assert watch.route.max_stream_duration.max_stream_duration == duration(0)
    assert not watch.route.HasField("retry_policy")


def matched_headers(route: Any) -> list[tuple[str, str]]:
    return [(h.name, h.string_match.exact) for h in route.match.headers]


def grpc_headers(route: Any) -> dict[str, str]:
    return {h.header.key: h.header.value for h in route.response_headers_to_add}


def test_unknown_model_and_missing_name_are_trailers_only_grpc_errors(resources: Resources) -> None:
    not_found, stream, fallback = routes_of(resources)[-3:]
    assert not_found.match.headers[0].name == MODEL_HEADER
    assert not_found.match.headers[0].present_match
    for route, status in ((not_found, "5"), (stream, "3"), (fallback, "3")):
        assert route.direct_response.status == 200
        headers = grpc_headers(route)
        assert headers["content-type"] == "application/grpc"
        assert headers["grpc-status"] == status and headers["grpc-message"]
    assert stream.match.path == "/inference.GRPCInferenceService/ModelStreamInfer"
    assert fallback.match.prefix == "/" and not fallback.match.headers


def test_model_route_split_timeout_and_retries(resources: Resources) -> None:
    by_name = {r.name: r for r in routes_of(resources)}
    action = by_name[model_cluster("classifier")].route
    weights = [(c.name, c.weight.value) for c in action.weighted_clusters.clusters]
    assert weights == [(V1, 90), (V2, 10)]
    assert action.timeout == duration(2.5)
    retry = action.retry_policy
    assert retry.retry_on == "unavailable,reset,connect-failure,refused-stream"
    assert retry.num_retries.value == 3
    assert retry.per_try_timeout == duration(2.5)
    assert retry.host_selection_retry_max_attempts == 3
    (predicate,) = retry.retry_host_predicate
    assert predicate.name == "envoy.retry_host_predicates.previous_hosts"
    assert by_name[V2].route.cluster == V2 and by_name[V2].route.timeout == duration(2.5)


def test_round_robin_when_the_topology_asks() -> None:
    state = mesh_state()
    listener = dataclasses.replace(state.listener, lb_policy="round_robin")
    resources: Resources = build_resources(dataclasses.replace(state, listener=listener))
    policies = {c.lb_policy for c in resources[CLUSTER_TYPE].values()}
    assert policies == {cluster_pb2.Cluster.ROUND_ROBIN}


@pytest.mark.parametrize(
    ("scope", "checked"),
    [
        ("all", "every cluster, REST twins too"),
        (
            "model",
            "model:classifier model:classifier:sla:gold model:detector "
            "rest:model:classifier rest:model:classifier:sla:gold rest:model:detector",
        ),
    ],
)
def test_health_checks_in_every_cluster_or_once_per_model(scope: str, checked: str) -> None:
    """A server is in several clusters and Envoy checks it in each: scope "model" leaves the
    checks to each model's own gRPC cluster (versions, servers and REST twins rely on the
    control plane's EDS health and outlier detection), one connection per server and model
    (and one for REST). An SLA lane is checked too: an endpoint reserved for a class is in no
    other cluster."""
    state = mesh_state()
    gold = sla_cluster("classifier", "gold")
    state = dataclasses.replace(state, clusters={**state.clusters, gold: state.clusters[V2]})
    listener = dataclasses.replace(state.listener, rest=RestOptions(), health_checks=scope)
    resources: Resources = build_resources(dataclasses.replace(state, listener=listener))
    clusters = resources[CLUSTER_TYPE]
    assert any(name.startswith("rest:") for name in clusters)  # the twins are there
    with_checks = {name for name, c in clusters.items() if c.health_checks}
    if scope == "all":
        assert with_checks == set(clusters), checked
    else:
        assert with_checks == set(checked.split())
    # Per-endpoint stats (Envoy's stat sink, every second) only where the gRPC checks are:
    # what the control plane reads of them (checked_down) comes from there. REST twins have
    # none (their ports are not the endpoints telemetry knows).
    with_stats = {n for n, c in clusters.items() if c.track_cluster_stats.per_endpoint_stats}
    assert with_stats == {n for n in with_checks if not n.startswith("rest:")}
    for name in with_checks:  # the same check wherever there is one
        (check,) = clusters[name].health_checks
        assert check.interval == duration(0.5)
        assert check.HasField(
            "http_health_check" if name.startswith("rest:") else "grpc_health_check"
        )


def test_cluster_settings(resources: Resources) -> None:
    for cluster in resources[CLUSTER_TYPE].values():
        assert cluster.lb_policy == cluster_pb2.Cluster.LEAST_REQUEST
        assert cluster.connect_timeout == duration(1)
        assert cluster.common_lb_config.update_merge_window == duration(0)
        assert cluster.common_lb_config.HasField("update_merge_window")
        assert cluster.common_lb_config.healthy_panic_threshold.value == 0
        (check,) = cluster.health_checks
        assert check.HasField("grpc_health_check") and check.grpc_health_check.service_name == ""
        assert check.interval == check.no_traffic_interval == duration(0.5)
        assert check.timeout == duration(1)
        assert (check.unhealthy_threshold.value, check.healthy_threshold.value) == (2, 1)
        outliers = cluster.outlier_detection
        assert outliers.consecutive_5xx.value == 5
        assert outliers.consecutive_gateway_failure.value == 3
        assert outliers.base_ejection_time == duration(5)
        assert outliers.max_ejection_percent.value == 50
        # an ejection for stalled or failed requests is not undone by a passing health check
        assert outliers.HasField("successful_active_health_check_uneject_host")
        assert not outliers.successful_active_health_check_uneject_host.value
        assert outliers.max_ejection_time == duration(30)
        (limits,) = cluster.circuit_breakers.thresholds
        assert limits.retry_budget.budget_percent.value == 20
        assert limits.retry_budget.min_retry_concurrency.value == 10
        assert limits.max_requests.value >= 100_000 and limits.max_pending_requests.value >= 100_000
        options = http_protocol_options_pb2.HttpProtocolOptions()
        key = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
        assert cluster.typed_extension_protocol_options[key].Unpack(options)
        assert options.explicit_http_config.HasField("http2_protocol_options")
        assert cluster.track_cluster_stats.per_endpoint_stats
        assert cluster.ignore_health_on_host_removal


def test_endpoint_weights_and_health(resources: Resources) -> None:
    load = resources[ENDPOINT_TYPE][model_cluster("classifier")]
    (locality,) = load.endpoints
    seen = [
        (
            e.endpoint.address.socket_address.port_value,
            e.load_balancing_weight.value,
            e.health_status,
        )
        for e in locality.lb_endpoints
    ]
    assert seen == [(9001, 3, health_check_pb2.HEALTHY), (9002, 1, health_check_pb2.DRAINING)]
    assert list(resources[ENDPOINT_TYPE][model_cluster("detector")].endpoints) == []


def test_duration_is_exact() -> None:
    assert (duration(0.5).seconds, duration(0.5).nanos) == (0, 500_000_000)
    assert (duration(2.25).seconds, duration(2.25).nanos) == (2, 250_000_000)
    assert bootstrap.duration(0.5) == "0.5s" and bootstrap.duration(1) == "1s"


def test_bootstrap_uses_ads_and_only_a_static_xds_cluster() -> None:
    sotw = bootstrap.render_bootstrap(**DEFAULT_BOOTSTRAP, delta=False)
    delta = bootstrap.render_bootstrap(**DEFAULT_BOOTSTRAP, delta=True)
    assert sotw["dynamic_resources"]["ads_config"]["api_type"] == "GRPC"
    assert delta["dynamic_resources"]["ads_config"]["api_type"] == "DELTA_GRPC"
    assert sotw["dynamic_resources"]["lds_config"] == {"ads": {}, "resource_api_version": "V3"}
    assert sotw["dynamic_resources"]["cds_config"] == {"ads": {}, "resource_api_version": "V3"}
    xds, tokens = sotw["static_resources"]["clusters"]  # ADS, and the token limiter's calls
    assert xds["name"] == "xds_cluster" and xds["type"] == "STATIC"
    assert tokens["name"] == bootstrap.TOKEN_LIMITER_CLUSTER
    assert "listeners" not in sotw["static_resources"]
    admin = sotw["admin"]["address"]["socket_address"]
    assert admin == {"address": "127.0.0.1", "port_value": 9901}


def test_checked_in_bootstrap_is_current() -> None:
    path = ROOT / "envoy" / "bootstrap.yaml"
    text = path.read_text()
    assert text.startswith("# Generated by control_plane.xds.bootstrap")
    assert yaml.safe_load(text) == bootstrap.render_bootstrap(**DEFAULT_BOOTSTRAP, delta=False)


# What a process started with a low open-file limit has after raising it: a table of
# (soft, hard) it starts with -> the soft limit it must end with (hard as root may rise).
LIMIT_CHILD = """
import resource, sys
from control_plane.xds.bootstrap import raise_open_file_limit
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2])))
got = raise_open_file_limit(int(sys.argv[3]))
print(got, *resource.getrlimit(resource.RLIMIT_NOFILE))
"""


@pytest.mark.parametrize(
    ("soft", "hard", "wanted"),
    [(256, 1024, 4096), (256, 1024, 512), (1024, 1024, 1024), (900, 1000, 100)],
)
def test_envoy_starts_with_the_open_file_limit_raised(soft: int, hard: int, wanted: int) -> None:
    """Envoy holds a health-check connection per upstream host: --run raises the soft limit to
    what is wanted, as far as the hard limit allows (or raises it, where permitted: with
    CAP_SYS_RESOURCE), and never lowers it."""
    done = subprocess.run(
        [sys.executable, "-c", LIMIT_CHILD, str(soft), str(hard), str(wanted)],
        capture_output=True, text=True, timeout=60, check=True, cwd=ROOT,
    )  # fmt: skip
    got, now_soft, now_hard = (int(v) for v in done.stdout.split())
    assert got == now_soft and now_hard >= hard  # the hard limit rises only where permitted
    assert now_soft == max(soft, min(wanted, now_hard)), done.stdout


# --- the real Envoy -------------------------------------------------------------------------


def static_bootstrap(built: Resources, admin_port: int) -> dict[str, Any]:
    """A bootstrap serving ``built`` with no xDS server: routes and endpoints inlined."""
    route_config = built[ROUTE_TYPE][ROUTE_CONFIG_NAME]
    listeners = []
    for source in built[LISTENER_TYPE].values():
        listener = listener_pb2.Listener()
        listener.CopyFrom(source)
        manager = manager_of(listener)
        manager.ClearField("rds")
        manager.route_config.CopyFrom(route_config)
        listener.filter_chains[0].filters[-1].typed_config.Pack(manager)
        listeners.append(json_format.MessageToDict(listener, preserving_proto_field_name=True))
    clusters = []
    for name, source in built[CLUSTER_TYPE].items():
        cluster = cluster_pb2.Cluster()
        cluster.CopyFrom(source)
        cluster.ClearField("eds_cluster_config")
        cluster.type = cluster_pb2.Cluster.STATIC
        cluster.load_assignment.CopyFrom(built[ENDPOINT_TYPE][name])
        clusters.append(json_format.MessageToDict(cluster, preserving_proto_field_name=True))
    return {
        "node": {"id": "test-envoy", "cluster": "infermesh-test"},
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
        },
        "static_resources": {"listeners": listeners, "clusters": clusters},
    }


@dataclass
class Mesh:
    server: ServerProcess
    envoy: Envoy

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.envoy.port}"


@pytest.fixture(scope="module")
def mesh(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    workdir = tmp_path_factory.mktemp("envoy")
    server = start_server(demo_repo, workdir / "logs")
    try:
        # The server's port is known only now: the state is built around it.
        endpoint = (EndpointAssignment(EndpointAddress("127.0.0.1", server.port)),)
        port, admin_port = free_port(), free_port()
        state = MeshState(
            listener=ListenerOptions(port=port),
            models=(ModelRoute("classifier", sla_p99_ms=100, timeout_s=10),),
            clusters={
                name: endpoint for name in (SERVERS_CLUSTER, model_cluster("classifier"), V1, V2)
            },
        )
        config = static_bootstrap(build_resources(state), admin_port)
        envoy = start_envoy(config, workdir, admin_port, port)
    except BaseException:
        server.stop()
        raise
    try:
        yield Mesh(server, envoy)
    finally:
        envoy.stop()
        server.stop()


@pytest.fixture
def client(mesh: Mesh) -> Iterator[grpcclient.InferenceServerClient]:
    """A stock tritonclient pointed at Envoy's listener."""
    client = grpcclient.InferenceServerClient(mesh.url)
    yield client
    client.close()


def images(batch: int = 2) -> np.ndarray:
    return np.random.default_rng(7).random((batch, 3, 32, 32), dtype=np.float32)


def stat_name(cluster: str) -> str:
    return cluster.replace(":", "_")  # Envoy's stat names replace ':' with '_'


integration = pytest.mark.integration


@integration
def test_envoy_loads_the_listener_and_clusters(mesh: Mesh) -> None:
    dump = json.loads(mesh.envoy.admin("/config_dump"))
    by_type = {c["@type"].rsplit(".", 1)[-1]: c for c in dump["configs"]}
    listeners = [
        item["listener"]["name"] for item in by_type["ListenersConfigDump"]["static_listeners"]
    ]
    clusters = {
        item["cluster"]["name"] for item in by_type["ClustersConfigDump"]["static_clusters"]
    }
    assert listeners == [LISTENER_NAME]
    assert {SERVERS_CLUSTER, model_cluster("classifier"), V1, V2} <= clusters
    assert f"{V1}::127.0.0.1:{mesh.server.port}::health_flags::healthy" in mesh.envoy.admin(
        "/clusters"
    )


@integration
def test_infer_without_a_header_is_routed_by_the_body(
    mesh: Mesh, client: grpcclient.InferenceServerClient
) -> None:
    cluster = f"cluster.{stat_name(model_cluster('classifier'))}.upstream_rq_total"
    before = mesh.envoy.counter(cluster)
    through_envoy = infer_classifier(client, images())
    direct_client = mesh.server.client()
    direct = infer_classifier(direct_client, images())
    direct_client.close()
    assert through_envoy.get_response().model_version == direct.get_response().model_version
    np.testing.assert_allclose(through_envoy.as_numpy("probs"), direct.as_numpy("probs"), rtol=1e-6)
    assert mesh.envoy.counter(cluster) == before + 1


@integration
def test_version_header_routes_to_the_version_cluster(
    mesh: Mesh, client: grpcclient.InferenceServerClient
) -> None:
    counter = f"cluster.{stat_name(V1)}.upstream_rq_total"
    before = mesh.envoy.counter(counter)
    tensor = grpcclient.InferInput("input", [1, 3, 32, 32], "FP32")
    tensor.set_data_from_numpy(images(1))
    headers = {MODEL_HEADER: "classifier", VERSION_HEADER: "1"}
    result = client.infer("classifier", [tensor], model_version="1", headers=headers)
    assert result.get_response().model_version == "1"
    # Without headers, the body's model_version alone picks the version cluster too.
    assert infer_classifier(client, images(1), version="1").get_response().model_version == "1"
    assert mesh.envoy.counter(counter) == before + 2


@integration
@pytest.mark.parametrize("header", [False, True])
def test_unknown_model_is_not_found(client: grpcclient.InferenceServerClient, header: bool) -> None:
    tensor = grpcclient.InferInput("input", [1, 3, 32, 32], "FP32")
    tensor.set_data_from_numpy(images(1))
    with pytest.raises(InferenceServerException) as error:
        client.infer("nope", [tensor], headers={MODEL_HEADER: "nope"} if header else None)
    assert "NOT_FOUND" in str(error.value.status())
    assert "not found in the mesh" in str(error.value.message())
    with pytest.raises(InferenceServerException) as error:
        client.is_model_ready("nope")
    assert "NOT_FOUND" in str(error.value.status())


@integration
def test_server_calls_and_model_calls_work_through_envoy(
    client: grpcclient.InferenceServerClient,
) -> None:
    assert client.is_server_ready() and client.is_server_live()
    assert client.is_model_ready("classifier")
    assert client.get_model_metadata("classifier").name == "classifier"


def raw_infer(url: str, body: bytes) -> service_pb2.ModelInferResponse:
    with grpc.insecure_channel(url) as channel:
        call = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=None,
            response_deserializer=service_pb2.ModelInferResponse.FromString,
        )
        return call(body, timeout=30)


@integration
def test_body_routing_skips_fields_that_come_before_the_model_name(mesh: Mesh) -> None:
    request = service_pb2.ModelInferRequest(model_name="classifier", model_version="1")
    request.inputs.add(name="input", datatype="FP32", shape=[1, 3, 32, 32])
    request.raw_input_contents.append(images(1).tobytes())
    # Unknown fields of each wire type (varint, 64-bit, 32-bit), then a 3000-byte id (field 3):
    # model_name lies past the first 1 KiB the Lua filter reads, so it reads further.
    prefix = b"\x78\x96\x01" + b"\x71" + bytes(8) + b"\x6d" + bytes(4) + b"\x1a\xb8\x17"
    prefix += b"i" * 3000
    response = raw_infer(mesh.url, prefix + request.SerializeToString())
    assert response.model_name == "classifier" and response.model_version == "1"


@integration
def test_stream_without_header_and_nameless_request_are_invalid_argument(mesh: Mesh) -> None:
    with grpc.insecure_channel(mesh.url) as channel:
        stream = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=service_pb2.ModelInferRequest.SerializeToString,
            response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as error:
            list(stream(iter([service_pb2.ModelInferRequest(model_name="classifier")]), timeout=10))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert MODEL_HEADER in str(error.value.details())
    with pytest.raises(grpc.RpcError) as error:
        raw_infer(mesh.url, service_pb2.ModelInferRequest(id="x").SerializeToString())
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@integration
def test_large_header_less_request_is_not_cut_by_envoy_buffer_limits(
    client: grpcclient.InferenceServerClient,
) -> None:
    # 20 MiB is above Envoy's default 16 MiB HTTP/2 stream window, which bounds a buffered body.
    big = np.zeros((20 * 1024 * 1024 // (3 * 32 * 32 * 4), 3, 32, 32), dtype=np.float32)
    tensor = grpcclient.InferInput("input", list(big.shape), "FP32")
    tensor.set_data_from_numpy(big)
    with pytest.raises(InferenceServerException) as error:
        client.infer("nope", [tensor], client_timeout=30)
    assert "NOT_FOUND" in str(error.value.status())


@integration
@pytest.mark.parametrize("delta", [False, True])
def test_envoy_accepts_the_rendered_bootstrap(tmp_path: Path, delta: bool) -> None:
    options = {**DEFAULT_BOOTSTRAP, "xds_port": free_port(), "admin_port": free_port()}
    path = bootstrap.write_bootstrap(tmp_path / "bootstrap.yaml", **options, delta=delta)
    command = [envoy_binary(), "--mode", "validate", "-c", str(path), "-l", "warning"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@integration
def test_envoy_accepts_every_resource_of_the_two_model_state(tmp_path: Path) -> None:
    # The split, the draining and the empty cluster are accepted, not only the simple mesh.
    path = tmp_path / "static.json"
    path.write_text(json.dumps(static_bootstrap(build_resources(mesh_state()), free_port())))
    command = [envoy_binary(), "--mode", "validate", "-c", str(path), "-l", "warning"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_bootstrap_with_otlp_sends_envoy_stats_to_the_control_plane(tmp_path: Path) -> None:
    options = {**DEFAULT_BOOTSTRAP, "xds_port": free_port(), "admin_port": free_port()}
    config = bootstrap.render_bootstrap(**options, delta=False, otlp_port=14317)
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    assert set(clusters) == {
        bootstrap.XDS_CLUSTER,
        bootstrap.OTLP_CLUSTER,
        bootstrap.TOKEN_LIMITER_CLUSTER,
    }
    sink = config["stats_sinks"][0]
    assert sink["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] == "otlp_cluster"
    assert config["stats_flush_interval"] == "1s"
    assert 0.1 in config["stats_config"]["histogram_bucket_settings"][0]["buckets"]
    path = bootstrap.write_bootstrap(tmp_path / "b.yaml", **options, delta=False, otlp_port=14317)
    command = [envoy_binary(), "--mode", "validate", "-c", str(path), "-l", "warning"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_bootstrap_for_two_control_plane_replicas(tmp_path: Path) -> None:
    """One ADS cluster with an endpoint per replica (a broken stream moves to the other), and a
    stat sink per replica (whichever Envoy follows has seen its stats). Envoy accepts it."""
    options = {**DEFAULT_BOOTSTRAP, "xds_port": [18000, 18001], "admin_port": free_port()}
    config = bootstrap.render_bootstrap(**options, delta=False, otlp_port=[14317, 14318])
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    assert set(clusters) == {
        "xds_cluster",
        "otlp_cluster",
        "otlp_cluster_2",
        "token_limiter_cluster",
    }
    xds = clusters["xds_cluster"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [e["endpoint"]["address"]["socket_address"]["port_value"] for e in xds] == [18000, 18001]
    # The token limiter: one replica at a time (the second only behind the first), so a
    # tenant's budget is one ledger.
    groups = clusters["token_limiter_cluster"]["load_assignment"]["endpoints"]
    assert [(g["priority"], g["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
             ["port_value"]) for g in groups] == [(0, 18000), (1, 18001)]  # fmt: skip
    sinks = [s["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
             for s in config["stats_sinks"]]  # fmt: skip
    assert sinks == ["otlp_cluster", "otlp_cluster_2"]
    path = bootstrap.write_bootstrap(tmp_path / "b.yaml", **options, delta=False, otlp_port=[1, 2])
    command = [envoy_binary(), "--mode", "validate", "-c", str(path), "-l", "warning"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("host", "kind"), [("127.0.0.1", "STATIC"), ("::1", "STATIC"), ("infermesh-xds", "STRICT_DNS")]
)
def test_xds_cluster_resolves_names(host: str, kind: str) -> None:
    assert bootstrap.xds_cluster(host, [18000])["type"] == kind


def test_xds_replicas_on_hosts_of_their_own_are_one_cluster() -> None:
    """compose.private.yaml: each replica is a container with a name of its own."""
    options = {**DEFAULT_BOOTSTRAP, "xds_port": bootstrap.target_list("cp-1:18000,cp-2:18001")}
    xds, _ = bootstrap.render_bootstrap(**options, delta=False)["static_resources"]["clusters"]
    addresses = [
        e["endpoint"]["address"]["socket_address"]
        for e in xds["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]
    assert [(a["address"], a["port_value"]) for a in addresses] == [
        ("cp-1", 18000),
        ("cp-2", 18001),
    ]
    assert xds["type"] == "STRICT_DNS"


@pytest.mark.parametrize(
    ("text", "targets"),
    [
        ("18000", [18000]),
        ("18000,18001", [18000, 18001]),
        (" 1 , 2 ", [1, 2]),
        ("1,", [1]),
        ("cp-1:18000,18001", ["cp-1:18000", 18001]),
    ],
)
def test_target_lists(text: str, targets: list[int | str]) -> None:
    assert bootstrap.target_list(text) == targets


@pytest.mark.parametrize("text", ["", ",", "x", "0", "70000", "1,2,x", ":18000", "cp:0"])
def test_bad_target_lists_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        bootstrap.target_list(text)


def test_envoy_runs_without_hot_restart_unless_asked() -> None:
    """Two meshes on one host (a `make run` beside the tests) each start their Envoy."""
    plain = bootstrap.envoy_command(Path("b.yaml"), ["--concurrency", "1"])
    assert plain[1:3] == ["-c", "b.yaml"] and "--disable-hot-restart" in plain
    assert plain[-2:] == ["--concurrency", "1"]
    asked = bootstrap.envoy_command(Path("b.yaml"), ["--base-id", "7"])
    assert "--disable-hot-restart" not in asked


def test_run_hands_envoy_the_bootstrap_inline_and_leaves_no_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Every start of `--run` (each `infermesh up`, each restart by a supervisor) used to leave
    a temporary bootstrap file behind: exec'd Envoy cannot remove it."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    monkeypatch.setattr(bootstrap, "raise_open_file_limit", lambda: 0)
    ran: list[list[str]] = []

    def execv(path: str, command: list[str]) -> None:
        ran.append(command)

    monkeypatch.setattr(bootstrap.os, "execv", execv)
    bootstrap.main(["--run", "--admin-port", "9911", "--delta", "--", "--concurrency", "1"])
    command = ran[0]
    inline = json.loads(command[command.index("--config-yaml") + 1])
    assert inline == bootstrap.render_bootstrap(**{**DEFAULT_BOOTSTRAP, "admin_port": 9911},
                                                delta=True, otlp_port=None)  # fmt: skip
    assert "-c" not in command and command[-2:] == ["--concurrency", "1"]
    assert list(tmp_path.iterdir()) == []
    out = tmp_path / "b.yaml"  # asked for a file: Envoy runs on it
    bootstrap.main(["--run", "--out", str(out)])
    assert ran[1][1:3] == ["-c", str(out)] and out.exists()
    with pytest.raises(SystemExit):  # theirs would clash with ours: they are told to use --out
        bootstrap.main(["--run", "--", "--config-yaml", "{}"])


def test_stats_go_to_replicas_on_hosts_of_their_own() -> None:
    """Kubernetes: each control-plane replica by its StatefulSet DNS name."""
    targets = bootstrap.target_list("cp-0.cp:14317,cp-1.cp:14317")
    assert targets == ["cp-0.cp:14317", "cp-1.cp:14317"]
    options = {**DEFAULT_BOOTSTRAP, "xds_host": "cp", "admin_port": 9901}
    config = bootstrap.render_bootstrap(**options, delta=False, otlp_port=targets)
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    address = clusters["otlp_cluster_2"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    assert address["endpoint"]["address"]["socket_address"] == {
        "address": "cp-1.cp",
        "port_value": 14317,
    }
    assert clusters["otlp_cluster_2"]["type"] == clusters["xds_cluster"]["type"] == "STRICT_DNS"
    assert bootstrap.target_list("14317,127.0.0.2:14318") == [14317, "127.0.0.2:14318"]


@pytest.mark.parametrize("text", ["", ":1", "h:", "h:0", "h:x", "a:1,,:2"])
def test_bad_stat_targets_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        bootstrap.target_list(text)


def test_assignments_share_no_message_with_the_cache_of_made_endpoints() -> None:
    """EDS entries are made once per assignment and copied into each ClusterLoadAssignment: a
    change to one built assignment must not reach the next one built."""
    members = (EndpointAssignment(A, 3), EndpointAssignment(B, 1, EndpointHealth.DRAINING))
    first = build_assignment("model:classifier", members)
    first.endpoints[0].lb_endpoints[0].load_balancing_weight.value = 99
    second = build_assignment("model:classifier", members)
    assert [e.load_balancing_weight.value for e in second.endpoints[0].lb_endpoints] == [3, 1]
    assert second.endpoints[0].lb_endpoints[1].health_status == health_check_pb2.DRAINING
