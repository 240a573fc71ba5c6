"""Synthetic Envoy nodes: many ADS streams (SotW or delta) in one asyncio process.

Each node has its own grpc.aio channel (its own connection, as separate Envoys would), a node
id ``{prefix}-{i}`` and node.cluster ``--group``, and speaks ADS as Envoy does: subscribes to
CDS and LDS (wildcard), then to EDS for the EDS clusters' service names and RDS for the
listeners' route config names, re-subscribing when those change; it ACKs every response (SotW:
version_info + response_nonce + the names; delta: response_nonce). Responses are read as raw
bytes, so ``len`` is exactly what crossed the stream. EDS resources are kept per node as bytes;
only the watched cluster's ClusterLoadAssignment is decoded, for the watched endpoint's
``load_balancing_weight`` and ``health_status``.

Commands on stdin (JSON, one line), one JSON answer line each on stdout:
``{"cmd": "status"}``: streams up, nodes holding every EDS resource they subscribed, distinct
EDS versions held, last EDS arrival; ``{"cmd": "watch", "cluster": C, "endpoint": "H:P"}``:
watch that endpoint from now on and answer each node's current (weight, health);
``{"cmd": "report"}``: per node, since the watch: the changes of the watched value
``[wall time, weight, health, bytes of that response]``, and bytes / responses per type.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.service.discovery.v3 import discovery_pb2

PREFIX = "type.googleapis.com/envoy.config."
CDS, EDS = PREFIX + "cluster.v3.Cluster", PREFIX + "endpoint.v3.ClusterLoadAssignment"
LDS, RDS = PREFIX + "listener.v3.Listener", PREFIX + "route.v3.RouteConfiguration"
SHORT = {CDS: "CDS", EDS: "EDS", LDS: "LDS", RDS: "RDS"}
ADS = "/envoy.service.discovery.v3.AggregatedDiscoveryService/"
HEALTH = {v: k for k, v in health_check_pb2.HealthStatus.items()}
Value = tuple[int, str] | None


def cla_name(value: bytes) -> str:
    """ClusterLoadAssignment.cluster_name (field 1, written first) without decoding the rest."""
    if not value or value[0] != 0x0A:
        return endpoint_pb2.ClusterLoadAssignment.FromString(value).cluster_name
    length, shift, i = 0, 0, 1
    while True:
        byte = value[i]
        length |= (byte & 0x7F) << shift
        i += 1
        if byte < 0x80:
            break
        shift += 7
    return value[i : i + length].decode()


def endpoint_value(value: bytes, endpoint: str) -> Value:
    host, _, port = endpoint.rpartition(":")
    load = endpoint_pb2.ClusterLoadAssignment.FromString(value)
    for locality in load.endpoints:
        for lb in locality.lb_endpoints:
            address = lb.endpoint.address.socket_address
            if address.address == host and address.port_value == int(port):
                weight = (
                    lb.load_balancing_weight.value if lb.HasField("load_balancing_weight") else 1
                )
                return weight, HEALTH.get(lb.health_status, str(lb.health_status))
    return None


def serialize(message: Any) -> bytes:
    return bytes(message.SerializeToString())


def eds_names(clusters: list[bytes]) -> list[str]:
    names = set()
    for raw in clusters:
        cluster = cluster_pb2.Cluster.FromString(raw)
        if cluster.type == cluster_pb2.Cluster.EDS:
            names.add(cluster.eds_cluster_config.service_name or cluster.name)
    return sorted(names)


def route_names(listeners: list[bytes]) -> list[str]:
    names = set()
    for raw in listeners:
        for chain in listener_pb2.Listener.FromString(raw).filter_chains:
            for item in chain.filters:
                manager = hcm_pb2.HttpConnectionManager()
                if item.typed_config.Unpack(manager) and manager.HasField("rds"):
                    names.add(manager.rds.route_config_name)
    return sorted(names)


@dataclass
class Watch:
    cluster: str = ""
    endpoint: str = ""


@dataclass
class Node:
    node_id: str
    group: str
    delta: bool
    watch: Watch
    up: bool = False
    sent_node: bool = False  # the node goes on the first request of a stream only
    resources: dict[str, dict[str, bytes]] = field(default_factory=dict)  # type -> name -> Any
    subscribed: dict[str, list[str]] = field(default_factory=dict)  # EDS / RDS names
    versions: dict[str, str] = field(default_factory=dict)
    last: dict[str, tuple[str, str]] = field(default_factory=dict)  # type -> (version, nonce)
    bytes_in: dict[str, int] = field(default_factory=dict)
    responses: dict[str, int] = field(default_factory=dict)
    value: Value = None
    changes: list[tuple[float, int, str, int]] = field(default_factory=list)
    last_eds_at: float = 0.0
    error: str = ""

    def request(self, type_url: str, **kw: Any) -> Any:
        node = {} if self.sent_node else {"node": {"id": self.node_id, "cluster": self.group}}
        self.sent_node = True
        kind = discovery_pb2.DeltaDiscoveryRequest if self.delta else discovery_pb2.DiscoveryRequest
        return kind(type_url=type_url, **node, **kw)

    def synced(self) -> bool:
        names = self.subscribed.get(EDS) or []
        held = self.resources.get(EDS, {})
        return self.up and bool(names) and all(n in held for n in names)

    def update_value(self, at: float, size: int) -> None:
        raw = self.resources.get(EDS, {}).get(self.watch.cluster)
        value = None if raw is None else endpoint_value(raw, self.watch.endpoint)
        if value != self.value:
            self.value = value
            if value is not None:
                self.changes.append((at, value[0], value[1], size))

    def apply(self, response: Any, size: int, at: float) -> list[Any]:
        """Takes one response; returns the requests to send (the ACK first)."""
        type_url = response.type_url
        short = SHORT.get(type_url, type_url)
        self.bytes_in[short] = self.bytes_in.get(short, 0) + size
        self.responses[short] = self.responses.get(short, 0) + 1
        held = self.resources.setdefault(type_url, {})
        if self.delta:
            for r in response.resources:
                held[r.name] = r.resource.value
            for name in response.removed_resources:
                held.pop(name, None)
            self.versions[type_url] = response.system_version_info
            out = [self.request(type_url, response_nonce=response.nonce)]
        else:
            values = [r.value for r in response.resources]
            if type_url == EDS:
                held.clear()
                held.update((cla_name(v), v) for v in values)
            else:
                held.clear()
                held.update((str(i), v) for i, v in enumerate(values))
            self.versions[type_url] = response.version_info
            self.last[type_url] = (response.version_info, response.nonce)
            names = self.subscribed.get(type_url, [])
            out = [self.request(type_url, version_info=response.version_info,
                                response_nonce=response.nonce, resource_names=names)]  # fmt: skip
        if type_url == EDS:
            self.last_eds_at = at
            if self.watch.cluster:
                self.update_value(at, size)
        elif type_url in (CDS, LDS):
            child = EDS if type_url == CDS else RDS
            wanted = (eds_names if type_url == CDS else route_names)(list(held.values()))
            out.extend(self.resubscribe(child, wanted))
        return out

    def resubscribe(self, type_url: str, wanted: list[str]) -> list[Any]:
        before = self.subscribed.get(type_url)
        if before == wanted:
            return []
        self.subscribed[type_url] = wanted
        if self.delta:
            old = set(before or [])
            return [self.request(type_url, resource_names_subscribe=sorted(set(wanted) - old),
                                 resource_names_unsubscribe=sorted(old - set(wanted)))]  # fmt: skip
        version, nonce = self.last.get(type_url, ("", ""))
        return [self.request(type_url, version_info=version, response_nonce=nonce,
                             resource_names=wanted)]  # fmt: skip


async def run_node(node: Node, target: str) -> None:
    options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", -1)]
    method = ADS + ("DeltaAggregatedResources" if node.delta else "StreamAggregatedResources")
    kind = discovery_pb2.DeltaDiscoveryResponse if node.delta else discovery_pb2.DiscoveryResponse
    while True:
        async with grpc.aio.insecure_channel(target, options=options) as channel:
            call = channel.stream_stream(
                method, request_serializer=serialize, response_deserializer=None
            )()
            try:
                node.sent_node = False
                node.subscribed.clear()  # a new stream subscribes afresh
                for type_url in (CDS, LDS):
                    await call.write(node.request(type_url))
                node.up = True
                while True:
                    raw = await call.read()
                    if raw is grpc.aio.EOF:
                        break
                    at = time.time()
                    response = kind.FromString(raw)
                    for request in node.apply(response, len(raw), at):
                        await call.write(request)
            except grpc.aio.AioRpcError as exc:
                node.error = f"{exc.code().name}: {exc.details()}"
            finally:
                node.up = False
        await asyncio.sleep(0.5)  # reconnect, as Envoy does


def status(nodes: list[Node]) -> dict[str, Any]:
    return {
        "nodes": len(nodes),
        "up": sum(n.up for n in nodes),
        "synced": sum(n.synced() for n in nodes),
        "eds_versions": sorted({n.versions.get(EDS, "") for n in nodes}),
        "cds_versions": sorted({n.versions.get(CDS, "") for n in nodes}),
        "last_eds_at": max((n.last_eds_at for n in nodes), default=0.0),
        "eds_clusters": max((len(n.subscribed.get(EDS, [])) for n in nodes), default=0),
        "errors": sorted({n.error for n in nodes if n.error})[:5],
    }


def command(nodes: list[Node], watch: Watch, line: str) -> dict[str, Any]:
    request = json.loads(line)
    cmd = request.get("cmd")
    if cmd == "status":
        return status(nodes)
    if cmd == "watch":
        watch.cluster, watch.endpoint = request["cluster"], request["endpoint"]
        for n in nodes:
            n.value, n.changes = None, []
            n.bytes_in, n.responses = {}, {}
            n.update_value(time.time(), 0)
            n.changes = []
        return {"values": {n.node_id: n.value for n in nodes}, "at": time.time()}
    if cmd == "report":
        return {
            "nodes": {
                n.node_id: {
                    "changes": n.changes,
                    "bytes": n.bytes_in,
                    "responses": n.responses,
                    "value": n.value,
                }
                for n in nodes
            },
            "at": time.time(),
        }
    return {"error": f"unknown command {line!r}"}


async def main_async(args: argparse.Namespace) -> None:
    watch = Watch()
    delta = args.mode == "delta"
    nodes = [Node(f"{args.prefix}-{i}", args.group, delta, watch) for i in range(args.nodes)]
    tasks = [asyncio.get_running_loop().create_task(run_node(n, args.xds)) for n in nodes]
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := (await reader.readline()).decode().strip():
            print(json.dumps(command(nodes, watch, line)), flush=True)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--xds", required=True, help="the control plane's ADS HOST:PORT")
    p.add_argument("--nodes", type=int, default=10)
    p.add_argument("--mode", choices=("sotw", "delta"), default="sotw")
    p.add_argument("--prefix", default="synthetic", help="node ids are PREFIX-i")
    p.add_argument("--group", default="infermesh", help="node.cluster")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
