"""Placement: which models and versions are READY on which model server.

``probe_endpoint`` asks one server (KServe v2 RepositoryIndex with ready=true, and
ServerReady) over grpc.aio. ``PlacementPoller`` probes every endpoint concurrently each
interval over one kept channel per endpoint, and calls ``on_change`` only when the placement
(reachability, server readiness, READY (model, version) pairs) changed, so the control plane
rebuilds its snapshot only then. ``build_mesh_state`` is the pure function from a topology and
the latest reports to the ``MeshState`` the Envoy resources are built from.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from control_plane.mesh import (
    SERVERS_CLUSTER,
    EndpointAddress,
    EndpointAssignment,
    EndpointHealth,
    MeshState,
    cluster_model,
    model_cluster,
)
from control_plane.topology import Topology

log = logging.getLogger(__name__)

READY = "READY"
# No proxy for model servers; reconnect quickly so a restarted server is seen within a poll
# or two (gRPC's default backoff grows to two minutes).
CHANNEL_OPTIONS = (
    ("grpc.enable_http_proxy", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)

Reports = Mapping[EndpointAddress, "EndpointReport"]
Placement = tuple[bool, bool, frozenset[tuple[str, str]]]
AddressSource = Callable[[], Iterable[EndpointAddress] | Awaitable[Iterable[EndpointAddress]]]
ChangeCallback = Callable[[Reports], Awaitable[None] | None]


@dataclass(frozen=True)
class EndpointReport:
    """What one poll of one model server found."""

    address: EndpointAddress
    reachable: bool  # at least one of the two RPCs answered
    ready_models: frozenset[tuple[str, str]] = frozenset()  # (model, version) pairs READY
    server_ready: bool = False
    error: str = ""  # why an RPC failed; "" when both answered

    @property
    def placement(self) -> Placement:
        """What a change is judged on: error texts vary from poll to poll and do not count."""
        return (self.reachable, self.server_ready, self.ready_models)


def grpc_target(address: EndpointAddress) -> str:
    return f"[{address.host}]:{address.port}" if ":" in address.host else address.key


def open_channel(address: EndpointAddress) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(grpc_target(address), options=CHANNEL_OPTIONS)


async def probe_endpoint(
    address: EndpointAddress, timeout_s: float, channel: grpc.aio.Channel | None = None
) -> EndpointReport:
    """Asks one server for its READY model versions and readiness; never raises.

    Uses ``channel`` if given (it stays open), else a channel of its own for this call.
    """
    own = channel is None
    chan = open_channel(address) if channel is None else channel
    try:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(chan)
        index_request = service_pb2.RepositoryIndexRequest(ready=True)
        ready_request = service_pb2.ServerReadyRequest()
        (index, index_error), (ready, ready_error) = await asyncio.gather(
            _call(
                "RepositoryIndex", lambda: stub.RepositoryIndex(index_request, timeout=timeout_s)
            ),
            _call("ServerReady", lambda: stub.ServerReady(ready_request, timeout=timeout_s)),
        )
    finally:
        if own:
            await chan.close()
    models: frozenset[tuple[str, str]] = frozenset()
    if index is not None:
        models = frozenset(
            (m.name, m.version) for m in index.models if m.state == READY and m.version
        )
    return EndpointReport(
        address=address,
        reachable=index is not None or ready is not None,
        ready_models=models,
        server_ready=bool(ready is not None and ready.ready),
        error="; ".join(e for e in (index_error, ready_error) if e),
    )


async def _call(name: str, call: Callable[[], Awaitable[Any]]) -> tuple[Any, str]:
    try:
        return await call(), ""
    except grpc.aio.AioRpcError as exc:
        return None, f"{name}: {exc.code().name}: {exc.details()}"
    except Exception as exc:  # a probe never raises; the report carries the error
        return None, f"{name}: {type(exc).__name__}: {exc}"


class PlacementPoller:
    """Polls every endpoint each ``interval_s`` and reports placement changes.

    ``addresses`` returns the endpoints to poll now (sync or async, e.g. a closure over
    ``EndpointResolver.resolve`` of the current topology). ``on_change`` (sync or async) gets
    every endpoint's latest report, in address order, after the first poll and after each poll
    whose placement differs from the last one delivered; if it raises, the next poll delivers
    again. Endpoints that left are dropped and their channels closed.
    """

    def __init__(
        self,
        addresses: AddressSource,
        interval_s: float = 1.0,
        timeout_s: float = 1.0,
        on_change: ChangeCallback | None = None,
    ) -> None:
        self.addresses = addresses
        self.on_change = on_change
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._reports: Reports = MappingProxyType({})
        self._delivered: dict[EndpointAddress, Placement] | None = None
        self._channels: dict[EndpointAddress, grpc.aio.Channel] = {}
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    @property
    def reports(self) -> Reports:
        """The latest report of every endpoint, in address order (read-only)."""
        return self._reports

    @property
    def open_channels(self) -> frozenset[EndpointAddress]:
        """The endpoints the poller holds a channel to."""
        return frozenset(self._channels)

    async def start(self) -> None:
        """Starts polling in the background (the first poll right away)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="placement-poller")

    async def stop(self) -> None:
        """Stops polling and closes every channel."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])
        async with self._lock:
            channels, self._channels = list(self._channels.values()), {}
            await asyncio.gather(*(c.close() for c in channels))

    async def poll_once(self) -> Reports:
        """Polls every endpoint once (calls ``on_change`` if the placement changed)."""
        async with self._lock:
            found = self.addresses()
            if inspect.isawaitable(found):
                found = await found
            addresses = sorted(set(found))
            gone = [self._channels.pop(a) for a in set(self._channels) - set(addresses)]
            await asyncio.gather(*(channel.close() for channel in gone))
            reports = await asyncio.gather(
                *(probe_endpoint(a, self.timeout_s, self._channel(a)) for a in addresses)
            )
            self._log_changes(reports)
            self._reports = MappingProxyType(dict(zip(addresses, reports, strict=True)))
            placement = {r.address: r.placement for r in reports}
            if placement != self._delivered:
                if self.on_change is not None:
                    result = self.on_change(self._reports)
                    if inspect.isawaitable(result):
                        await result
                self._delivered = placement
            return self._reports

    def _channel(self, address: EndpointAddress) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = open_channel(address)
        return self._channels[address]

    def _log_changes(self, reports: Iterable[EndpointReport]) -> None:
        for report in reports:
            before = self._reports.get(report.address)
            if before is not None and before.placement == report.placement:
                continue
            if report.reachable:
                models = ", ".join(f"{m}:{v}" for m, v in sorted(report.ready_models)) or "none"
                state = "ready" if report.server_ready else "not ready"
                log.info("endpoint %s: %s; READY: %s", report.address.key, state, models)
            else:
                log.warning("endpoint %s unreachable: %s", report.address.key, report.error)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            try:
                await self.poll_once()
            except Exception:
                log.exception("placement poll failed; retrying next interval")
            next_at = max(next_at + self.interval_s, loop.time())
            await asyncio.sleep(next_at - loop.time())


def build_mesh_state(
    topology: Topology,
    reports: Reports,
    weights: Mapping[EndpointAddress, int] | None = None,
    health: Mapping[EndpointAddress, EndpointHealth] | None = None,
    pool_weights: Mapping[str, Mapping[EndpointAddress, int]] | None = None,
    pool_health: Mapping[str, Mapping[EndpointAddress, EndpointHealth]] | None = None,
) -> MeshState:
    """The mesh for a topology and the latest placement (pure; equal inputs, equal output).

    Per topology model M: ``model_cluster(M)`` holds every reachable endpoint where M has a
    READY version; ``model_cluster(M, V)`` exists for each V of M's version_split and each V
    READY anywhere, holding the reachable endpoints where (M, V) is READY. ``SERVERS_CLUSTER``
    holds the reachable endpoints whose server is ready. Clusters may be empty; models not in
    the topology get none. Weights default to 1 (raised to 1 if lower: EDS needs >= 1),
    health to HEALTHY. ``pool_weights`` / ``pool_health`` (per model name: what telemetry-driven
    routing decided) apply to that model's clusters, except that routing never ejects every
    endpoint of a cluster; ``weights`` / ``health`` (operator overrides) win over them
    everywhere. Cluster names and endpoints are sorted.
    """
    weights = weights or {}
    health = health or {}
    names = {m.name for m in topology.models}
    members: dict[str, set[EndpointAddress]] = {SERVERS_CLUSTER: set()}
    for model in topology.models:
        members[model_cluster(model.name)] = set()
        for version, _ in model.version_split:
            members[model_cluster(model.name, version)] = set()
    for address, report in reports.items():
        if not report.reachable:
            continue
        if report.server_ready:
            members[SERVERS_CLUSTER].add(address)
        for name, version in report.ready_models:
            if name in names:
                members[model_cluster(name)].add(address)
                members.setdefault(model_cluster(name, version), set()).add(address)

    pool_weights = pool_weights or {}
    pool_health = pool_health or {}

    def assigned(cluster: str) -> tuple[EndpointAssignment, ...]:
        model = cluster_model(cluster) or ""
        routed_weights = pool_weights.get(model, {})
        routed_health = pool_health.get(model, {})
        return tuple(
            _assignment(
                address,
                max(1, int(weights.get(address, routed_weights.get(address, 1)))),
                health.get(address, routed_health.get(address)) or EndpointHealth.HEALTHY,
            )
            for address in sorted(members[cluster], key=_address_order)
        )

    def fail_open(assigned: tuple[EndpointAssignment, ...]) -> tuple[EndpointAssignment, ...]:
        # The pool's ejection cap counts the whole model; a version cluster may hold only the
        # ejected ones. Routing never empties a cluster (an operator's UNHEALTHY still does).
        if any(a.health is EndpointHealth.HEALTHY for a in assigned):
            return assigned
        return tuple(
            dataclasses.replace(a, health=EndpointHealth.HEALTHY)
            if a.health is EndpointHealth.UNHEALTHY and a.address not in health
            else a
            for a in assigned
        )

    clusters = {name: fail_open(assigned(name)) for name in sorted(members)}
    return MeshState(listener=topology.listener, models=topology.models, clusters=clusters)


def _address_order(address: EndpointAddress) -> tuple[str, int]:
    return address.host, address.port  # EndpointAddress's own order, without its __lt__


@functools.lru_cache(maxsize=1 << 16)
def _assignment(
    address: EndpointAddress, weight: int, health: EndpointHealth
) -> EndpointAssignment:
    """One shared object per (address, weight, health): an unchanged cluster's tuple of them
    compares equal by identity, which keeps the incremental builder's comparison cheap at
    fleet scale."""
    return EndpointAssignment(address, weight, health)
