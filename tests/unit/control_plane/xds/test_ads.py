"""The ADS server's protocol logic, driven over real gRPC by a client that speaks like Envoy."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.rpc import status_pb2

from control_plane.metrics import ControlPlaneMetrics
from control_plane.xds.ads import AdsServicer
from control_plane.xds.nodes import NodeRegistry
from control_plane.xds.snapshot import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    InconsistentSnapshot,
    Snapshot,
    SnapshotCache,
    build_snapshot,
)

RECEIVE_DEADLINE_S = 5.0
NODE = {"id": "envoy-test", "cluster": "infermesh"}


def mesh(*clusters: tuple[str, int]) -> Snapshot:
    """A snapshot with EDS clusters named as given, each with one endpoint of the given port."""
    resources: dict[str, dict[str, Any]] = {CLUSTER_TYPE: {}, ENDPOINT_TYPE: {}}
    for name, port in clusters:
        cluster = cluster_pb2.Cluster(name=name, type=cluster_pb2.Cluster.EDS)
        cluster.connect_timeout.seconds = port  # so a new port changes the cluster too
        cluster.eds_cluster_config.service_name = name
        cluster.eds_cluster_config.eds_config.ads.SetInParent()
        resources[CLUSTER_TYPE][name] = cluster
        assignment = endpoint_pb2.ClusterLoadAssignment(cluster_name=name)
        address = assignment.endpoints.add().lb_endpoints.add().endpoint.address.socket_address
        address.address, address.port_value = "127.0.0.1", port
        resources[ENDPOINT_TYPE][name] = assignment
    return build_snapshot(resources)


class Harness:
    def __init__(self) -> None:
        self.cache = SnapshotCache()
        self.nodes = NodeRegistry()
        self.metrics = ControlPlaneMetrics()

    async def __aenter__(self) -> Harness:
        self.server = grpc.aio.server()
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(
            AdsServicer(self.cache, self.nodes, self.metrics), self.server
        )
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self.channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close()
        await self.server.stop(0)

    def stream(self, delta: bool = False) -> Stream:
        return Stream(self.stub, delta)


class Stream:
    """One ADS stream: send requests; responses are collected as they arrive."""

    def __init__(self, stub: Any, delta: bool) -> None:
        self.requests: asyncio.Queue[Any] = asyncio.Queue()
        self.responses: asyncio.Queue[Any] = asyncio.Queue()
        method = stub.DeltaAggregatedResources if delta else stub.StreamAggregatedResources
        self.call = method(self._iterate())
        self.delta = delta
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _iterate(self) -> AsyncIterator[Any]:
        while True:
            request = await self.requests.get()
            if request is None:
                return
            yield request

    async def _read(self) -> None:
        async for response in self.call:
            await self.responses.put(response)

    def send(self, **fields: Any) -> None:
        kind = discovery_pb2.DeltaDiscoveryRequest if self.delta else discovery_pb2.DiscoveryRequest
        self.requests.put_nowait(kind(node=NODE, **fields))

    async def receive(self) -> Any:
        return await asyncio.wait_for(self.responses.get(), RECEIVE_DEADLINE_S)

    async def quiet_for(self, seconds: float) -> bool:
        """True when no response arrives within ``seconds`` (absence needs a bounded wait)."""
        await asyncio.sleep(seconds)
        return self.responses.empty()

    def close(self) -> None:
        self.requests.put_nowait(None)
        self.call.cancel()
        self.reader.cancel()


def names(response: Any) -> list[str]:
    """Names of the resources in a state-of-the-world response."""
    found = []
    for resource in response.resources:
        if resource.type_url == CLUSTER_TYPE:
            cluster = cluster_pb2.Cluster()
            resource.Unpack(cluster)
            found.append(cluster.name)
        else:
            assignment = endpoint_pb2.ClusterLoadAssignment()
            resource.Unpack(assignment)
            found.append(assignment.cluster_name)
    return sorted(found)


async def test_sotw_ack_push_nack_and_reconnect() -> None:
    async with Harness() as h:
        h.cache.set_snapshot(mesh(("a", 1), ("b", 2)))
        stream = h.stream()
        stream.send(type_url=CLUSTER_TYPE)
        first = await stream.receive()
        assert names(first) == ["a", "b"] and first.version_info and first.nonce
        # ACK: no new response until the snapshot changes.
        stream.send(
            type_url=CLUSTER_TYPE, version_info=first.version_info, response_nonce=first.nonce
        )
        assert await stream.quiet_for(0.3)
        h.cache.set_snapshot(mesh(("a", 1), ("c", 3)))
        second = await stream.receive()
        assert names(second) == ["a", "c"] and second.version_info != first.version_info
        # NACK: recorded with its reason, counted, never re-sent.
        error = status_pb2.Status(code=3, message="bad cluster c")
        stream.send(
            type_url=CLUSTER_TYPE, version_info=first.version_info,
            response_nonce=second.nonce, error_detail=error,
        )  # fmt: skip
        assert await stream.quiet_for(0.3)
        status = h.nodes.as_json()[0]
        assert status["node_id"] == "envoy-test"
        assert status["types"]["CDS"]["acked_version"] == first.version_info
        assert status["types"]["CDS"]["last_nack"]["error"] == "bad cluster c"
        assert status["types"]["CDS"]["last_nack"]["version"] == second.version_info
        assert h.metrics.nacks.labels("CDS")._value.get() == 1
        # A fixed snapshot is sent.
        h.cache.set_snapshot(mesh(("a", 1), ("d", 4)))
        third = await stream.receive()
        assert names(third) == ["a", "d"]
        stream.close()
        # A reconnecting Envoy sends its old version and no nonce: it is answered at once.
        again = h.stream()
        again.send(type_url=CLUSTER_TYPE, version_info=first.version_info)
        assert names(await again.receive()) == ["a", "d"]
        again.close()


async def test_sotw_answers_the_eds_re_request_after_an_ack() -> None:
    async with Harness() as h:
        h.cache.set_snapshot(mesh(("a", 1)))
        stream = h.stream()
        stream.send(type_url=ENDPOINT_TYPE, resource_names=["a"])
        first = await stream.receive()
        stream.send(
            type_url=ENDPOINT_TYPE, resource_names=["a"],
            version_info=first.version_info, response_nonce=first.nonce,
        )  # fmt: skip
        assert await stream.quiet_for(0.3)
        # Envoy re-requests with the nonce it already ACKed (after a CDS update): answer.
        stream.send(
            type_url=ENDPOINT_TYPE, resource_names=["a"],
            version_info=first.version_info, response_nonce=first.nonce,
        )  # fmt: skip
        assert names(await stream.receive()) == ["a"]
        stream.close()


async def test_sotw_eds_subscription_sees_only_its_names() -> None:
    async with Harness() as h:
        h.cache.set_snapshot(mesh(("a", 1), ("b", 2)))
        stream = h.stream()
        stream.send(type_url=ENDPOINT_TYPE, resource_names=["a"])
        first = await stream.receive()
        assert names(first) == ["a"]
        stream.send(
            type_url=ENDPOINT_TYPE, resource_names=["a"],
            version_info=first.version_info, response_nonce=first.nonce,
        )  # fmt: skip
        h.cache.set_snapshot(mesh(("a", 1), ("b", 5)))  # only b changed
        assert await stream.quiet_for(0.3)
        stream.close()


async def test_delta_sends_only_changes_and_removals() -> None:
    async with Harness() as h:
        h.cache.set_snapshot(mesh(("a", 1), ("b", 2)))
        stream = h.stream(delta=True)
        stream.send(type_url=CLUSTER_TYPE)
        first = await stream.receive()
        assert [r.name for r in first.resources] == ["a", "b"]
        stream.send(type_url=CLUSTER_TYPE, response_nonce=first.nonce)
        assert await stream.quiet_for(0.3)
        h.cache.set_snapshot(mesh(("a", 1), ("b", 2), ("c", 3)))
        added = await stream.receive()
        assert [r.name for r in added.resources] == ["c"] and not added.removed_resources
        stream.send(type_url=CLUSTER_TYPE, response_nonce=added.nonce)
        h.cache.set_snapshot(mesh(("a", 1), ("c", 3)))
        removed = await stream.receive()
        assert list(removed.removed_resources) == ["b"] and not removed.resources
        # NACK of a change: not re-sent while the resource stays the same.
        stream.send(type_url=CLUSTER_TYPE, response_nonce=removed.nonce)
        h.cache.set_snapshot(mesh(("a", 9), ("c", 3)))
        changed = await stream.receive()
        assert [r.name for r in changed.resources] == ["a"]
        stream.send(
            type_url=CLUSTER_TYPE, response_nonce=changed.nonce,
            error_detail=status_pb2.Status(code=3, message="no"),
        )  # fmt: skip
        assert await stream.quiet_for(0.3)
        assert h.nodes.as_json()[0]["types"]["CDS"]["nacks"] == 1
        stream.close()


async def test_a_node_that_stops_acking_delays_nobody_and_then_gets_only_the_newest() -> None:
    """Back-pressure: an Envoy that does not acknowledge holds up only its own stream, and
    the changes it missed coalesce into one response with the newest snapshot."""
    async with Harness() as h:
        h.cache.set_snapshot(mesh(("a", 1)))
        stuck, healthy = h.stream(), h.stream()
        for stream in (stuck, healthy):
            stream.send(type_url=CLUSTER_TYPE)
        held = await stuck.receive()  # never acknowledged while the snapshot moves on
        last = await healthy.receive()
        for port in range(2, 12):
            healthy.send(
                type_url=CLUSTER_TYPE, version_info=last.version_info, response_nonce=last.nonce
            )
            h.cache.set_snapshot(mesh(("a", port)))
            last = await healthy.receive()  # each change reaches the healthy node at once
        assert await stuck.quiet_for(0.3)  # nothing queued up behind the missing ACK
        stuck.send(type_url=CLUSTER_TYPE, version_info=held.version_info, response_nonce=held.nonce)
        newest = await stuck.receive()
        assert newest.version_info == last.version_info  # one response: the tenth change
        assert await stuck.quiet_for(0.3)
        for stream in (stuck, healthy):
            stream.close()


def test_inconsistent_snapshot_is_refused_with_every_reason() -> None:
    resources: dict[str, dict[str, Any]] = {
        CLUSTER_TYPE: {"a": cluster_pb2.Cluster(name="a", type=cluster_pb2.Cluster.EDS)},
        ENDPOINT_TYPE: {"zombie": endpoint_pb2.ClusterLoadAssignment(cluster_name="zombie")},
    }
    resources[CLUSTER_TYPE]["a"].eds_cluster_config.eds_config.ads.SetInParent()
    with pytest.raises(InconsistentSnapshot) as caught:
        build_snapshot(resources)
    assert "'zombie' is not the service of any EDS cluster" in str(caught.value)
    assert "EDS cluster 'a' has no ClusterLoadAssignment" in str(caught.value)


def test_versions_are_content_hashes() -> None:
    assert mesh(("a", 1)).versions() == mesh(("a", 1)).versions()
    assert mesh(("a", 1)).versions()["EDS"] != mesh(("a", 2)).versions()["EDS"]
    assert mesh(("a", 1)).versions()["LDS"] == mesh(("a", 2)).versions()["LDS"]
    cache = SnapshotCache()
    assert cache.set_snapshot(mesh(("a", 1)))
    assert not cache.set_snapshot(mesh(("a", 1)))  # unchanged: nobody is woken
