"""The Kubernetes EndpointSlice endpoint source, against a small fake Kubernetes API.

The fake serves LIST and chunked WATCH streams from threads (``http.server``) on a free
127.0.0.1 port, pushes events, answers 410 Gone, cuts streams and checks the bearer token; the
real kube-apiserver cannot run here. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from control_plane.config import kubernetes_source
from control_plane.config.kubernetes_source import KubernetesEndpoint
from control_plane.config.topology import StaticEndpoint, TopologyError, parse_topology
from control_plane.discovery import kubernetes as endpointslices
from control_plane.discovery.kubernetes import (
    ApiConfig,
    Backoff,
    EndpointSlices,
    slice_addresses,
)
from control_plane.discovery.pod_addresses import api_on_loopback
from control_plane.discovery.resolver import EndpointResolver
from control_plane.model.mesh import EndpointAddress
from tests.envoy_support import free_port
from tests.kube_support import READY, FakeKubeApi
from tests.support import ROOT, wait_for

SOURCE = KubernetesEndpoint("model-server", "test", "grpc")
FAST = Backoff(0.05, 0.2)


def endpoint_slice(
    name: str,
    addresses: dict[str, dict[str, bool]],
    ports: list[dict[str, Any]] | None = None,
    address_type: str = "IPv4",
) -> dict[str, Any]:
    """An EndpointSlice object: ``addresses`` maps each pod IP to its conditions."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": "model-server"}},
        "addressType": address_type,
        "ports": [{"name": "grpc", "port": 8001, "protocol": "TCP"}] if ports is None else ports,
        "endpoints": [{"addresses": [ip], "conditions": c} for ip, c in addresses.items()],
    }


@pytest.fixture
def api() -> Iterator[FakeKubeApi]:
    with FakeKubeApi() as fake:
        yield fake


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("secret-token\n")
    return path


async def until(condition: Callable[[], object], what: str, within: float = 10) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.02)


class Watched:
    """An EndpointSlices manager on the fake, counting its change notifications."""

    def __init__(self, api: FakeKubeApi, token_file: Path | None) -> None:
        self.changes = 0
        self.slices = EndpointSlices(self._changed, ApiConfig(api.url, token_file), FAST)

    def _changed(self) -> None:
        self.changes += 1

    def keys(self, source: KubernetesEndpoint = SOURCE) -> set[str]:
        return {a.key for a in self.slices.addresses(source)}

    async def wait_keys(self, expected: set[str], what: str) -> None:
        await until(lambda: self.keys() == expected, f"{what}: {expected}, have {self.keys()}")


# -- the topology entry ---------------------------------------------------------------------
def topology(*endpoints: object) -> dict[str, Any]:
    model = {"name": "classifier", "sla_p99_ms": 50, "capacity_qps": 1000}
    return {"models": [model], "endpoints": list(endpoints)}


def test_topology_entries_parse(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(kubernetes_source, "SERVICE_ACCOUNT", tmp_path / "absent")
    parsed = parse_topology(
        topology(
            {"kubernetes": {"service": "model-server", "namespace": "ml", "port": "grpc"}},
            {"kubernetes": {"service": "model-server", "port": 8001}},
            {"address": "10.0.0.1:8001"},
        )
    )
    assert parsed.endpoints == (
        KubernetesEndpoint("model-server", "ml", "grpc"),
        KubernetesEndpoint("model-server", "default", 8001),  # not in a pod: "default"
        StaticEndpoint(EndpointAddress("10.0.0.1", 8001)),
    )
    (tmp_path / "sa").mkdir()
    (tmp_path / "sa" / "namespace").write_text("infermesh\n")
    monkeypatch.setattr(kubernetes_source, "SERVICE_ACCOUNT", tmp_path / "sa")
    entry = {"kubernetes": {"service": "model-server", "port": "grpc"}}
    assert parse_topology(topology(entry)).endpoints[0].namespace == "infermesh"  # type: ignore[union-attr]


def test_bad_entries_are_rejected_with_every_error() -> None:
    with pytest.raises(TopologyError) as info:
        parse_topology(
            topology(
                {"kubernetes": {"service": "Model_Server", "namespace": "-x", "port": 0}},
                {"kubernetes": {"namespace": "ml", "prot": "grpc"}},
                {"kubernetes": "model-server:8001"},
                {"kubernetes": {"service": "ms", "port": "grpc_port"}},
                {"kubernetes": {"service": "ms", "port": True}},
                {"kubernetes": {"service": "ms", "port": "grpc"}, "dns": "a:1"},
                {"kubernetes": {"service": "ms", "namespace": "ml", "port": "grpc"}},
                {"kubernetes": {"service": "ms", "namespace": "ml", "port": "grpc"}},
            )
        )
    errors = info.value.errors
    expected = [
        "endpoints[0].kubernetes.service: must be a Service name (a lower-case DNS-1035 label",
        "endpoints[0].kubernetes.namespace: must be a namespace (a lower-case DNS-1123 label",
        "endpoints[0].kubernetes.port: must be a port number in 1..65535 or a port name",
        "endpoints[1].kubernetes.prot: unknown key (expected one of: service, namespace, port)",
        "endpoints[1].kubernetes.service: required",
        "endpoints[1].kubernetes.port: required",
        'endpoints[2].kubernetes: must be a mapping with string keys, got "model-server:8001"',
        "endpoints[3].kubernetes.port: must be a port number in 1..65535 or a port name "
        "(a-z, 0-9, '-', at most 15), got \"grpc_port\"",
        "endpoints[4].kubernetes.port: must be a port number",
        "endpoints[5]: needs exactly one of 'address', 'dns' or 'kubernetes'",
        'endpoints[7].kubernetes: duplicate endpoint "kubernetes:ml/ms:grpc" '
        "(first at endpoints[6])",
    ]
    for fragment in expected:
        assert any(e.startswith(fragment) for e in errors), (fragment, errors)
    assert len(errors) == len(expected), errors
    assert 'got "Model_Server"' in errors[0] and "got 0" in errors[2]


# -- reading one slice ----------------------------------------------------------------------
def test_not_ready_and_terminating_endpoints_are_not_routed_to() -> None:
    item = endpoint_slice(
        "a",
        {
            "10.0.0.1": READY,
            "10.0.0.2": {"ready": False, "serving": False, "terminating": False},  # starting
            "10.0.0.3": {"ready": False, "serving": True, "terminating": True},  # draining
            "10.0.0.4": {"ready": True, "terminating": True},  # publishNotReadyAddresses
            "10.0.0.5": {},  # conditions unknown: ready
        },
    )
    assert {a.key for a in slice_addresses(item, "grpc")} == {"10.0.0.1:8001", "10.0.0.5:8001"}


def test_addresses_no_pod_serves_from_are_not_routed_to(caplog: pytest.LogCaptureFixture) -> None:
    """Whoever may write an EndpointSlice must not point the mesh at the control plane's own
    host or a cloud's metadata service."""
    special = ["127.0.0.1", "169.254.169.254", "0.0.0.0", "224.0.0.1"]
    item = endpoint_slice("evil", {ip: READY for ip in ["10.0.0.1", *special]})
    with caplog.at_level(logging.WARNING):
        assert {a.key for a in slice_addresses(item, "grpc")} == {"10.0.0.1:8001"}
        assert {a.key for a in slice_addresses(item, "grpc")} == {"10.0.0.1:8001"}
    assert sum("169.254.169.254" in r.getMessage() for r in caplog.records) == 1  # once
    special6 = ["::1", "fe80::1", "::", "::ffff:169.254.169.254", "::ffff:127.0.0.1"]
    item = endpoint_slice("evil6", {ip: READY for ip in ["fd00::1", *special6]}, None, "IPv6")
    assert {a.host for a in slice_addresses(item, "grpc")} == {"fd00::1"}
    # From a Kubernetes API on this host's loopback (a development cluster), loopback is a pod.
    item = endpoint_slice("dev", {ip: READY for ip in ["127.0.0.1", "169.254.169.254"]})
    dev = slice_addresses(item, "grpc", allow_loopback=True)
    assert {a.key for a in dev} == {"127.0.0.1:8001"}
    assert api_on_loopback("https://127.0.0.1:6443") and api_on_loopback("http://localhost:1")
    assert not api_on_loopback("https://kubernetes.default.svc")
    assert not api_on_loopback("https://10.96.0.1:443")


def test_each_address_keeps_the_pod_its_target_ref_names() -> None:
    """The pod's name is what its certificate carries (pki.model_server_pod)."""
    item = endpoint_slice("a", {"10.0.0.1": READY, "10.0.0.2": READY, "10.0.0.3": READY})
    item["metadata"]["namespace"] = "infermesh"
    item["endpoints"][0]["targetRef"] = {"kind": "Pod", "name": "ms-1", "namespace": "other"}
    item["endpoints"][1]["targetRef"] = {"kind": "Pod", "name": "ms-2"}  # the slice's namespace
    item["endpoints"][2]["targetRef"] = {"kind": "Node", "name": "n"}  # not a pod: no name
    found = {a.key: pod for a, pod in slice_addresses(item, "grpc").items()}
    assert found == {"10.0.0.1:8001": "other/ms-1", "10.0.0.2:8001": "infermesh/ms-2",
                     "10.0.0.3:8001": ""}  # fmt: skip
    item["endpoints"][0]["targetRef"] = {"kind": "Pod", "name": "Bad/../name"}
    assert slice_addresses(item, "grpc")[EndpointAddress("10.0.0.1", 8001)] == ""


def test_ports_by_name_or_number() -> None:
    ports = [{"name": "metrics", "port": 9001}, {"name": "grpc", "port": 8001, "protocol": "TCP"}]
    item = endpoint_slice("a", {"10.0.0.1": READY}, ports)
    assert set(slice_addresses(item, "grpc")) == {EndpointAddress("10.0.0.1", 8001)}
    assert set(slice_addresses(item, "metrics")) == {EndpointAddress("10.0.0.1", 9001)}
    assert set(slice_addresses(item, 9001)) == {EndpointAddress("10.0.0.1", 9001)}
    assert set(slice_addresses(item, "http")) == set()  # not a port of this slice
    assert set(slice_addresses(item, 7000)) == set()
    udp = endpoint_slice("a", {"10.0.0.1": READY}, [{"name": "grpc", "port": 1, "protocol": "UDP"}])
    assert set(slice_addresses(udp, "grpc")) == set()
    portless = endpoint_slice("a", {"10.0.0.1": READY}, [])  # headless Service without ports
    assert set(slice_addresses(portless, 8001)) == {EndpointAddress("10.0.0.1", 8001)}
    assert set(slice_addresses(portless, "grpc")) == set()
    v6 = endpoint_slice("a", {"fd00::0001": READY}, address_type="IPv6")
    assert set(slice_addresses(v6, "grpc")) == {EndpointAddress("fd00::1", 8001)}
    fqdn = endpoint_slice("a", {"pod.example": READY}, address_type="FQDN")
    assert set(slice_addresses(fqdn, "grpc")) == set()


# -- the watch ------------------------------------------------------------------------------
async def test_list_then_added_modified_deleted(api: FakeKubeApi, token_file: Path) -> None:
    api.apply(endpoint_slice("a", {"10.0.0.1": READY}))
    watched = Watched(api, token_file)
    try:
        await watched.slices.sync([SOURCE, StaticEndpoint(EndpointAddress("10.9.9.9", 1))])
        assert watched.keys() == {"10.0.0.1:8001"}  # sync waited for the first list
        assert watched.changes == 1
        await until(lambda: api.count("watch=1") == 1, "the watch")
        api.apply(endpoint_slice("b", {"10.0.0.2": READY}))
        await watched.wait_keys({"10.0.0.1:8001", "10.0.0.2:8001"}, "ADDED")
        api.apply(endpoint_slice("a", {"10.0.0.1": READY, "10.0.0.3": READY}))
        await watched.wait_keys({"10.0.0.1:8001", "10.0.0.2:8001", "10.0.0.3:8001"}, "MODIFIED")
        not_ready = {"ready": False, "serving": True, "terminating": True}
        api.apply(endpoint_slice("a", {"10.0.0.1": not_ready, "10.0.0.3": READY}))
        await watched.wait_keys({"10.0.0.2:8001", "10.0.0.3:8001"}, "a pod terminating")
        api.delete("b")
        await watched.wait_keys({"10.0.0.3:8001"}, "DELETED")
        changes = watched.changes
        api.send({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "999"}}})
        watcher = watched.slices.watchers[SOURCE]
        await until(lambda: watcher.resource_version == "999", "the bookmark's version")
        assert watched.changes == changes  # a bookmark changes no address
        assert api.lists() == 1  # everything above came over one watch
        # The resolver merges the watched addresses with the other sources.
        resolver = EndpointResolver(watched=watched.slices.addresses)
        static = StaticEndpoint(EndpointAddress("10.9.9.9", 1))
        merged = await resolver.resolve([static, SOURCE])
        assert [a.key for a in merged] == ["10.0.0.3:8001", "10.9.9.9:1"]
        await watched.slices.sync([])  # gone from the topology: no longer watched
        assert watched.keys() == set() and not watched.slices.watchers
    finally:
        await watched.slices.stop()


async def test_error_event_and_410_gone_list_again(api: FakeKubeApi, token_file: Path) -> None:
    api.apply(endpoint_slice("a", {"10.0.0.1": READY}))
    watched = Watched(api, token_file)
    try:
        await watched.slices.sync([SOURCE])
        await until(lambda: api.count("watch=1") == 1, "the watch")
        # The API server's "too old resource version" arrives as an ERROR event in the stream.
        api.slices["a"] = endpoint_slice("a", {"10.0.0.2": READY})  # missed by the watch
        api.send({"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}})
        await watched.wait_keys({"10.0.0.2:8001"}, "the re-list after an ERROR event")
        assert api.lists() == 2
        await until(lambda: api.count("watch=1") == 2, "the second watch")
        # A bookmark, so the watch is not one that ended at once with no event (backed off).
        mark = str(api.rv + 1)  # the version send() gives it
        api.send({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": mark}}})
        watcher = watched.slices.watchers[SOURCE]
        await until(lambda: watcher.resource_version == mark, "the bookmark")
        # The watch ends (its timeoutSeconds): resumed from its version, now compacted: 410.
        api.expire()
        api.slices["a"] = endpoint_slice("a", {"10.0.0.3": READY})
        api.drop_watches(clean=True)
        await watched.wait_keys({"10.0.0.3:8001"}, "the re-list after 410 Gone")
        assert api.lists() >= 3
        await until(lambda: api.count("watch=1") >= 4, "watching again")
    finally:
        await watched.slices.stop()


async def test_other_error_events_and_short_watches_back_off(
    api: FakeKubeApi, token_file: Path
) -> None:
    """Only an expired version lists again at once: an ERROR event of any other code (an
    overloaded API server's 429 or 500) and a watch that ends at once with no event are
    failures, retried with back-off, or each would cost the API server a LIST a turn."""
    api.apply(endpoint_slice("a", {"10.0.0.1": READY}))
    watched = Watched(api, token_file)
    try:
        await watched.slices.sync([SOURCE])
        watcher = watched.slices.watchers[SOURCE]
        await until(lambda: api.count("watch=1") == 1, "the watch")
        api.send({"type": "ERROR", "object": {"kind": "Status", "code": 500, "reason": "x"}})
        await until(lambda: watcher.failing, "a 500 ERROR event taken as a failure")
        await until(lambda: not watcher.failing, "recovered by the next LIST")
        await until(lambda: api.count("watch=1") == 2, "watching again")
        api.short_watches = True
        api.drop_watches(clean=True)
        await until(lambda: watcher.failing, "watches that end at once taken as failures")
        assert watched.keys() == {"10.0.0.1:8001"}  # the last known addresses are kept
        api.short_watches = False
        api.apply(endpoint_slice("b", {"10.0.0.2": READY}))
        await watched.wait_keys({"10.0.0.1:8001", "10.0.0.2:8001"}, "watching properly again")
    finally:
        await watched.slices.stop()


async def test_a_dropped_stream_reconnects_and_logs_once(
    api: FakeKubeApi, token_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="control_plane.discovery.kubernetes")
    api.apply(endpoint_slice("a", {"10.0.0.1": READY}))
    watched = Watched(api, token_file)
    try:
        await watched.slices.sync([SOURCE])
        await until(lambda: api.count("watch=1") == 1, "the watch")
        api.token = "rotated-token"  # reconnections fail (401) until the file is rotated too
        api.drop_watches()
        await until(lambda: api.lists() >= 4, "several failing reconnections")
        assert watched.keys() == {"10.0.0.1:8001"}  # the last known addresses are kept
        await asyncio.to_thread(token_file.write_text, "rotated-token")  # re-read each time
        api.apply(endpoint_slice("b", {"10.0.0.2": READY}))
        await watched.wait_keys({"10.0.0.1:8001", "10.0.0.2:8001"}, "after reconnecting")
    finally:
        await watched.slices.stop()
    tokens = {auth for _, auth in api.requests}
    assert tokens == {"Bearer secret-token", "Bearer rotated-token"}
    messages = [r.getMessage() for r in caplog.records]
    failing = [m for m in messages if "Kubernetes API failing" in m]
    assert (len(failing) == 1 and "HTTP 401" in failing[0]) or "Connection" in failing[0], messages
    assert sum("Kubernetes API reachable again" in m for m in messages) == 1


async def test_without_a_cluster_it_fails_softly(caplog: pytest.LogCaptureFixture) -> None:
    assert ApiConfig.from_environment({}) is None
    cluster = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    config = ApiConfig.from_environment(cluster)
    assert config is not None and config.url == "https://[fd00::1]:443"
    assert config.token_file == endpointslices.SERVICE_ACCOUNT / "token"
    override = {"INFERMESH_KUBERNETES_API": "https://k:6443/", "INFERMESH_KUBERNETES_INSECURE": "1"}
    assert ApiConfig.from_environment({**cluster, **override}) == ApiConfig(
        "https://k:6443", None, None, insecure=True
    )
    slices = EndpointSlices(lambda: None, None, FAST)
    slices.config = None  # outside a cluster, whatever this machine's environment says
    try:
        await slices.sync([SOURCE], wait_s=0.3)  # bounded: does not wait for a list forever
        assert slices.addresses(SOURCE) == frozenset()
    finally:
        await slices.stop()
    assert any("INFERMESH_KUBERNETES_API is not set" in r.getMessage() for r in caplog.records)


# -- the control plane process --------------------------------------------------------------
@pytest.mark.integration
def test_the_control_plane_follows_endpoint_slices(
    api: FakeKubeApi, token_file: Path, tmp_path: Path
) -> None:
    port = free_port()  # nothing listens there: the endpoint is listed, unreachable
    api.apply(endpoint_slice("a", {}, [{"name": "grpc", "port": port}]))
    topology = tmp_path / "topology.yaml"
    topology.write_text(
        "listener: {auth: {mode: 'off'}}\n"
        "models: [{name: classifier, sla_p99_ms: 50, capacity_qps: 100}]\n"
        "endpoints: [{kubernetes: {service: model-server, namespace: test, port: grpc}}]\n"
    )
    env = {
        **os.environ,
        "INFERMESH_KUBERNETES_API": api.url,
        "INFERMESH_KUBERNETES_TOKEN_FILE": str(token_file),
        "PYTHONUNBUFFERED": "1",
    }
    log = tmp_path / "cp.log"
    command = [
        sys.executable, "-m", "control_plane", "--topology", str(topology),
        "--xds-port", "0", "--admin-port", "0", "--otlp-port", "0", "--listener-port", "0",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:

        def listening() -> re.Match[str] | None:
            assert proc.poll() is None, log.read_text()
            return re.search(r"admin=[\d.]+:(\d+)", log.read_text())

        match = wait_for(listening, 60, "the control plane to listen")
        status_url = f"http://127.0.0.1:{match.group(1)}/status"

        def endpoints() -> set[str]:
            with urllib.request.urlopen(status_url, timeout=5) as response:
                return set(json.loads(response.read())["endpoints"])

        assert endpoints() == set()
        wait_for(lambda: api.count("watch=1") >= 1, 30, "the control plane's watch")
        api.apply(endpoint_slice("a", {"10.0.0.7": READY}, [{"name": "grpc", "port": port}]))
        wait_for(lambda: endpoints() == {f"10.0.0.7:{port}"}, 30, "the pod in /status")
        assert "endpoints changed (EndpointSlices changed)" in log.read_text()
        draining = {"ready": False, "serving": True, "terminating": True}
        api.apply(endpoint_slice("a", {"10.0.0.7": draining}, [{"name": "grpc", "port": port}]))
        wait_for(lambda: endpoints() == set(), 30, "the terminating pod gone from /status")
        assert all(auth == "Bearer secret-token" for _, auth in api.requests)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
