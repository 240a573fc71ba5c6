"""listener.health_checks: model: what Envoy's own checks find reaches the unchecked clusters."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.metrics.v1 import metrics_pb2

from control_plane.model.lanes import sla_cluster
from control_plane.model.mesh import (
    SERVERS_CLUSTER,
    EndpointAddress,
    EndpointAssignment,
    model_cluster,
    rest_cluster,
)
from control_plane.routing.envoy_checks import changes, checked_down_by_model
from control_plane.telemetry.envoy import ENVOY_NODE_TAG, EnvoyStats, stat_name, used_stats
from control_plane.telemetry.identity import refusal
from infermesh import pki
from tests.envoy_support import free_port
from tests.mesh_support import start_plane_and_envoy, write_topology
from tests.otlp_support import gauge, request
from tests.support import start_server, wait_for

A = EndpointAddress("127.0.0.1", 9001)
B = EndpointAddress("127.0.0.1", 9002)


def envoy_report(
    node: str | None, cluster: str, healthy: dict[str, int], requests: dict[str, int] | None = None
) -> metrics_pb2.ResourceMetrics:
    """One Envoy's stat-sink report: per-endpoint ``healthy`` gauges (and request counters)
    in ``cluster``, tagged with its node id (``None``: an Envoy without the tag)."""
    resource = metrics_pb2.ResourceMetrics()
    resource.resource.attributes.add(key="telemetry.sdk.name").value.string_value = "envoy"
    scope = resource.scope_metrics.add()
    gauge = scope.metrics.add(name="cluster.endpoint.healthy").gauge
    counter = scope.metrics.add(name="cluster.endpoint.rq_total").sum
    for points, values in ((gauge.data_points, healthy), (counter.data_points, requests or {})):
        for address, value in values.items():
            point = points.add(as_int=value)
            tags = {"envoy.cluster_name": stat_name(cluster), "envoy.endpoint_address": address}
            if node is not None:
                tags[ENVOY_NODE_TAG] = node
            for key, text in tags.items():
                point.attributes.add(key=key).value.string_value = text
    return resource


MODEL = model_cluster("classifier")


@pytest.mark.parametrize(
    ("reports", "now", "down"),
    [
        ([("e1", {A.key: 0, B.key: 1})], 1.5, {A.key}),
        # Every Envoy that reports it must call it unhealthy: one Envoy's own network
        # trouble does not take a server away from the others.
        ([("e1", {A.key: 0}), ("e2", {A.key: 1})], 1.5, set()),
        ([("e1", {A.key: 0}), ("e2", {A.key: 0})], 1.5, {A.key}),
        # Reports older than three stats flushes are not evidence any more.
        ([("e1", {A.key: 0})], 4.5, set()),
        # Envoys without the node tag read as one Envoy: the newest report wins.
        ([(None, {A.key: 1}), (None, {A.key: 0})], 1.5, {A.key}),
    ],
)
def test_envoy_stats_checked_down(
    reports: list[tuple[str | None, dict[str, int]]], now: float, down: set[str]
) -> None:
    stats = EnvoyStats()
    for node, healthy in reports:
        stats.ingest([envoy_report(node, MODEL, healthy)], now=1.0)
    found = stats.checked_down(now)
    assert found == ({stat_name(MODEL): frozenset(down)} if down else {})


def test_each_envoys_counters_stay_a_series_of_their_own() -> None:
    """Two Envoys' cumulative counters, interleaved in one series, read as a restart at every
    report (the rate came out as garbage); kept apart, their rates add up."""
    stats = EnvoyStats(window_s=10)
    for t in range(1, 6):
        stats.ingest([envoy_report("e1", MODEL, {}, {A.key: 1000 + 10 * t})], now=float(t))
        stats.ingest([envoy_report("e2", MODEL, {}, {A.key: 50 + 30 * t})], now=float(t))
    assert stats.as_json(5.0)["endpoints"][A.key]["requests_per_s"] == pytest.approx(40.0)


def test_a_shard_forwards_only_the_stats_the_control_plane_reads() -> None:
    """Envoy reports every stat it has (a few hundred per cluster); a telemetry shard forwards
    the handful EnvoyStats reads, which then reads the same as from the whole report."""
    report = envoy_report("e1", MODEL, {A.key: 0, B.key: 1}, {A.key: 5})
    noise = report.scope_metrics[0].metrics.add(name="cluster.upstream_cx_total").sum
    noise.data_points.add(as_int=7).attributes.add(key="envoy.cluster_name")
    report.scope_metrics.add().metrics.add(name="server.uptime").gauge.data_points.add(as_int=1)
    forwarded = ExportMetricsServiceRequest.FromString(used_stats([report])).resource_metrics
    names = {m.name for r in forwarded for s in r.scope_metrics for m in s.metrics}
    assert names == {"cluster.endpoint.healthy", "cluster.endpoint.rq_total"}
    assert [r.resource for r in forwarded] == [report.resource]  # the node, the SDK name
    whole, kept = EnvoyStats(), EnvoyStats()
    for t in (1.0, 2.0):
        whole.ingest([report], now=t)
        kept.ingest(forwarded, now=t)
    assert kept.checked_down(2.5) == whole.checked_down(2.5) == {stat_name(MODEL): {A.key}}
    assert kept.as_json(2.5) == whole.as_json(2.5)


def assigned(*addresses: EndpointAddress) -> tuple[EndpointAssignment, ...]:
    return tuple(EndpointAssignment(a) for a in addresses)


def test_only_checked_grpc_clusters_count() -> None:
    """A model's own cluster and SLA lanes are checked; version clusters are not (there Envoy
    reports our own EDS health back), nor REST twins (their checks ask another port)."""
    gold = sla_cluster("classifier", "gold")
    clusters = {
        MODEL: assigned(A, B),
        gold: assigned(B),
        model_cluster("classifier", "1"): assigned(A, B),
        rest_cluster(MODEL): assigned(A, B),
        SERVERS_CLUSTER: assigned(A, B),
    }
    everywhere = frozenset({A.key, B.key})
    found = {stat_name(name): everywhere for name in clusters}
    assert checked_down_by_model(found, clusters) == {"classifier": frozenset({A, B})}
    only_unchecked = {stat_name(model_cluster("classifier", "1")): everywhere}
    assert checked_down_by_model(only_unchecked, clusters) == {}
    assert checked_down_by_model({stat_name(gold): everywhere}, clusters) == {
        "classifier": frozenset({B})  # A is not in the lane: Envoy's word on it is stale
    }


def test_changes_read_as_decisions() -> None:
    before = {"classifier": frozenset({A})}
    after = {"classifier": frozenset({B}), "detector": frozenset({A})}
    assert changes(before, after) == [
        ("classifier", "Envoy's health checks: 127.0.0.1:9002 down: leaves the model's "
         "unchecked clusters; 127.0.0.1:9001 passes again: back in them"),
        ("detector", "Envoy's health checks: 127.0.0.1:9001 down: leaves the model's "
         "unchecked clusters"),
    ]  # fmt: skip
    assert changes(after, after) == []


def host_flags(clusters_text: str, cluster: str, url: str) -> str:
    prefix = f"{cluster}::{url}::health_flags::"
    return next((line[len(prefix) :] for line in clusters_text.splitlines()
                 if line.startswith(prefix)), "absent")  # fmt: skip


@pytest.mark.integration
def test_a_dead_server_leaves_the_unchecked_clusters_on_envoys_checks(
    demo_repo: Path, tmp_path: Path
) -> None:
    """Real Envoy, real servers, ``health_checks: model``: a killed server fails Envoy's checks
    in model:classifier; Envoy's stat sink tells the control plane, which marks it UNHEALTHY
    in the version cluster and `servers` (unchecked) long before its placement probes could
    call it unreachable (10 failed probes, 5 s apart)."""
    listener = free_port()
    with contextlib.ExitStack() as stops:
        servers = []
        for k in range(2):
            server = start_server(demo_repo, tmp_path / f"s{k}", "--models", "classifier")
            stops.callback(server.stop)
            servers.append(server)
        top: dict[str, Any] = {
            "listener": {"host": "127.0.0.1", "port": listener, "health_check_interval_s": 0.5,
                         "health_checks": "model"},
            "placement": {"poll_interval_s": 5.0, "timeout_s": 1.0, "unreachable_after": 10},
        }  # fmt: skip
        path = write_topology(tmp_path / "t.yaml", listener, [s.url for s in servers], top=top)
        plane, envoy = start_plane_and_envoy(
            stops, tmp_path, path, listener, 6, otlp_port=free_port(), envoy_stats=True
        )
        version = model_cluster("classifier", "1")
        dead, alive = servers[0], servers[1]
        dead.proc.kill()  # by PID: no drain, no goodbye
        dead.proc.wait(10)

        def left_the_version_cluster() -> bool:
            text = envoy.admin("/clusters")
            return "failed_eds_health" in host_flags(text, version, dead.url)

        wait_for(left_the_version_cluster, 20, "the dead server UNHEALTHY in the version cluster")
        clusters = envoy.admin("/clusters")
        assert "failed_active_hc" in host_flags(clusters, MODEL, dead.url)  # Envoy's own check
        assert "failed_eds_health" in host_flags(clusters, SERVERS_CLUSTER, dead.url)
        assert host_flags(clusters, version, alive.url) == "healthy"
        # Each Envoy's stats carry its node id (a fixed tag in the bootstrap).
        assert plane.admin_get("/telemetry")["envoy"]["nodes"] == ["envoy-sotw"]
        status = plane.admin_get("/status")
        assert status["envoy_checked_down"] == {"classifier": [dead.url]}
        assert status["endpoints"][dead.url]["reachable"]  # placement has not noticed yet
        decisions = [d["decision"] for d in plane.admin_get("/decisions")["decisions"]]
        assert f"Envoy's health checks: {dead.url} down: leaves the model's unchecked clusters" in (
            decisions
        )


def test_an_envoy_gone_quiet_is_forgotten() -> None:
    """Envoys come back under new node ids (a pod's name): the old one's series must not fill
    the caps for good, nor keep a say in ``checked_down``."""
    stats = EnvoyStats()
    stats.ingest([envoy_report("old", MODEL, {A.key: 1}, {A.key: 5})], now=1.0)
    for t in range(2, 70, 5):
        stats.ingest([envoy_report("new", MODEL, {A.key: 0}, {A.key: t})], now=float(t))
    assert stats.as_json(67.0)["nodes"] == ["new"]
    assert stats.checked_down(67.5) == {stat_name(MODEL): frozenset({A.key})}


def test_an_envoy_certificate_may_send_only_its_own_nodes_stats() -> None:
    """telemetry.tls: Envoy's stats are filed under the node tag, so the tag must be the node
    the sender's certificate names (control_plane.telemetry.identity)."""
    sender = "spiffe://infermesh.local/envoy/e1"

    def refused(node: str | None) -> tuple[str, str] | None:
        body = ExportMetricsServiceRequest(resource_metrics=[envoy_report(node, MODEL, {A.key: 1})])
        return refusal(sender, "infermesh.local", body)

    assert refused("e1") is None
    assert refused("e2") == ("other_identity", f"{sender} sent stats for node 'e2'")
    assert refused(None) == ("other_identity", f"{sender} sent stats for node '(none)'")
    # Another trust domain's Envoy is no workload of this mesh.
    foreign = refusal(sender, "other.domain", ExportMetricsServiceRequest())
    assert foreign is not None and foreign[0] == "not_a_workload"


def test_a_server_certificate_may_not_send_stats_that_say_they_are_envoys() -> None:
    """A resource with its own instance id and telemetry.sdk.name=envoy passed on the code
    before, and the receiver filed it as Envoy's stats: a model server's certificate (any
    container of compose.private.yaml can get one for its own address) could mark another
    server checked down or trip a model's fallback."""
    address = "10.0.0.5:8001"
    sender = pki.model_server(address).spiffe_id
    forged = envoy_report("e1", MODEL, {"10.0.0.6:8001": 0})
    forged.resource.attributes.add(key="service.instance.id").value.string_value = address
    body = ExportMetricsServiceRequest(resource_metrics=[forged])
    assert refusal(sender, "infermesh.local", body) == (
        "not_envoy",
        f"{sender} may not send Envoy's stats",
    )


@pytest.mark.parametrize("address", ["127.0.0.1:8001", "[::1]:8001", "[2001:db8::7]:9000"])
def test_a_server_certificate_may_report_only_for_its_own_address(address: str) -> None:
    """IPv6 included: the claimed instance id and the certificate compare as identities."""
    sender = pki.model_server(address).spiffe_id
    own = request([gauge("server_draining", 1.0)], address)
    assert refusal(sender, "infermesh.local", own) is None
    host, _, port = address.rpartition(":")
    other = request([gauge("server_draining", 1.0)], f"{host}:{int(port) + 1}")
    refused = refusal(sender, "infermesh.local", other)
    assert refused is not None and refused[0] == "other_identity"
    nameless = refusal(sender, "infermesh.local", request([gauge("x", 1.0)], None))
    assert nameless == ("other_identity", f"{sender} reported for 'no instance id'")


@pytest.mark.parametrize(
    ("reports", "now", "passing"),
    [
        ([("e1", MODEL, {A.key: 1, B.key: 0})], 1.5, {A.key}),
        # Healthy in one cluster and down in another (a checked one) is not passing.
        ([("e1", MODEL, {A.key: 1}), ("e1", SERVERS_CLUSTER, {A.key: 0})], 1.5, set()),
        # Every Envoy that reported it must find it healthy.
        ([("e1", MODEL, {A.key: 1}), ("e2", MODEL, {A.key: 0})], 1.5, set()),
        # No recent word from any Envoy is no evidence.
        ([("e1", MODEL, {A.key: 1})], 4.5, set()),
    ],
)
def test_envoy_stats_checks_pass(
    reports: list[tuple[str, str, dict[str, int]]], now: float, passing: set[str]
) -> None:
    """What keeps an endpoint the control plane cannot reach (routing.partitions)."""
    stats = EnvoyStats()
    for node, cluster, healthy in reports:
        stats.ingest([envoy_report(node, cluster, healthy)], now=1.0)
    assert stats.checks_pass([A.key, B.key, "10.0.0.9:1"], now) == passing
    assert stats.checks_pass([], now) == frozenset()
