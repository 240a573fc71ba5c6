"""The control plane process, the composition root: topology -> placement -> mesh state ->
snapshot -> Envoy.

``ControlPlane`` builds every stage, wires them together and starts their loops
(``loops.py``; each subsystem owns its own, and the topology watch, whose reload reconfigures
every stage, is this module's). One object makes snapshots, ``Rebuilder``
(``rebuilder.py``): placement changes, routing decisions, canary steps, circuits, topology
reloads and endpoint changes ask it for a rebuild and are coalesced; an operator's change
(``rebuild``) is served at once.

Why it is one module of this length: it is the composition root, and wiring each stage (the xDS
and admin servers, telemetry in process or in shards, discovery, the loops) is one list of steps
in an order that matters; what each stage does lives in its own package.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import signal
import time
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc
from envoy.service.ratelimit.v3 import rls_pb2_grpc

from control_plane.admin.api import OperatorApi
from control_plane.admin.http import AdminServer
from control_plane.admin.live_view import LiveFeed
from control_plane.admin.tokens import AdminTokens, check_exposure
from control_plane.app.loops import Loops
from control_plane.app.rebuilder import Rebuilder
from control_plane.config.tenants import security_warnings
from control_plane.config.topology import (
    Topology,
    TopologyError,
    TopologyFingerprint,
    listing_fingerprint,
    load_topology,
    topology_fingerprint,
)
from control_plane.discovery.endpoints import DiscoveredEndpoints
from control_plane.discovery.placement import PlacementPoller
from control_plane.metrics import ControlPlaneMetrics
from control_plane.model.canary import CanaryRun
from control_plane.model.mesh import (
    NO_PODS,
    EndpointAddress,
    MeshState,
    ServerPods,
    UpstreamTls,
)
from control_plane.model.operator_state import OperatorState
from control_plane.routing.canary_runs import CanaryRuns
from control_plane.routing.fallback import Fallbacks
from control_plane.routing.loop import RoutingLoop
from control_plane.routing.mesh_state import ClusterMemo, build_mesh_state
from control_plane.routing.router import Router
from control_plane.scoring.types import Labels
from control_plane.telemetry import identity as otlp_identity
from control_plane.telemetry.envoy import EnvoyStats
from control_plane.telemetry.readings import TelemetryReadings
from control_plane.telemetry.receiver import start_decoders, start_receiver
from control_plane.telemetry.scraper import MetricsScraper
from control_plane.telemetry.shards import TelemetryShards
from control_plane.telemetry.store import TelemetryStore
from control_plane.telemetry.values import VersionTelemetry
from control_plane.xds import upstream_tls
from control_plane.xds.ads import AdsServicer
from control_plane.xds.incremental import SnapshotBuilder
from control_plane.xds.nodes import NodeRegistry
from control_plane.xds.snapshot import SnapshotCache
from control_plane.xds.token_limiter import TokenLimiter

log = logging.getLogger("control_plane")
TOPOLOGY_CHECK_INTERVAL_S = 1.0


@dataclass(frozen=True)
class ControlPlaneSettings:
    topology: Path
    xds_port: int | None = None  # overrides the topology's (0: a free port)
    admin_port: int | None = None
    listener_port: int | None = None  # overrides the topology's listener.port
    otlp_port: int | None = None  # overrides telemetry.port (0: a free port)
    routing: bool = True  # telemetry-driven weights and ejection
    admin_token: str | None = None  # POSTs need it as a bearer token; the live view's actions
    admin_read_token: str | None = None  # GETs of state (status, telemetry, /ui, events) need it
    # (header, value) the placement poller sends with RepositoryIndex, for servers that
    # restrict their model-repository API
    model_server_credential: tuple[str, str] | None = None


def load_with_overrides(settings: ControlPlaneSettings) -> Topology:
    topology = load_topology(settings.topology)
    if settings.listener_port is not None:
        listener = dataclasses.replace(topology.listener, port=settings.listener_port)
        topology = dataclasses.replace(topology, listener=listener)
    return topology


class ControlPlane:
    def __init__(self, settings: ControlPlaneSettings) -> None:
        self.settings = settings
        self.topology: Topology = load_with_overrides(settings)
        self.fingerprint = self._fingerprints()
        self.topology_error = ""
        telemetry = otlp_identity.plaintext_warnings(self.topology.telemetry)
        for warning in security_warnings(self.topology.listener) + telemetry:
            log.warning("%s", warning)
        self.metrics = ControlPlaneMetrics()
        self._publish_certificates()
        self.cache = SnapshotCache()
        self.nodes = NodeRegistry()
        self.discovery = DiscoveredEndpoints(
            lambda: self.topology.endpoints, self._endpoints_changed
        )
        options = self.topology.telemetry
        # What the in-process receiver and the scraper store; routing, placement hints, canaries
        # and GET /telemetry read it merged with the telemetry shards' (telemetry.shards).
        self.store = TelemetryStore(
            options.window_s, options.stale_after_intervals, options.forget_after_s
        )
        self.telemetry = TelemetryReadings(self.store)
        self.shards: TelemetryShards | None = None
        self.envoy_stats = EnvoyStats(options.window_s)
        # Endpoints that do not push OTLP (Triton): their Prometheus metrics, scraped
        self.scraper = MetricsScraper(self.store, interval_s=options.scrape_interval_s)
        self.router = Router()
        self.operator = OperatorState()  # overrides and version splits, over the topology's
        self.canaries = CanaryRuns(self.router.decisions, self.metrics)
        self.fallbacks = Fallbacks(self.router.decisions)
        self.api = OperatorApi(self)
        self.otlp_server: grpc.aio.Server | None = None
        self.decoders: ProcessPoolExecutor | None = None  # telemetry.decoder_processes
        self.otlp_port = 0
        self._with_pods: tuple[Topology | None, ServerPods, Topology] = (
            None, NO_PODS, self.topology,
        )  # fmt: skip
        self.poller = PlacementPoller(
            lambda: self.endpoints,
            self.topology.placement.poll_interval_s,
            self.topology.placement.timeout_s,
            self._on_placement_change,
            max_probes_per_s=self.topology.placement.max_probes_per_s,
            max_concurrent_probes=self.topology.placement.max_concurrent_probes,
            unreachable_after=self.topology.placement.unreachable_after,
            credential=(settings.model_server_credential,)
            if settings.model_server_credential
            else (),
            tls=self.topology.listener.upstream_tls,
        )
        self.mesh_memo: ClusterMemo = {}  # clusters' assignments kept between rebuilds
        self.grpc_server: grpc.aio.Server | None = None
        self.admin: AdminServer | None = None
        self.xds_port = 0
        self.admin_port = 0
        self.loops = Loops(self.metrics)  # every loop below, supervised (loops.py)
        self.live = LiveFeed()
        # The one place a snapshot is made; requests for one are coalesced (rebuilder.py).
        self.rebuilder = Rebuilder(self._mesh_inputs, SnapshotBuilder(), self.cache, self.metrics)
        # Routing's loop: telemetry into weights and ejections (routing/loop.py).
        self.routing = RoutingLoop(
            self.router, self.telemetry, self.envoy_stats, self.metrics,
            lambda: self.topology, lambda: self.poller.reports, lambda: self.mesh_state,
            self.rebuilder.request, lambda: self.poller.last_reachable,
        )  # fmt: skip

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        t = self.topology
        tokens = AdminTokens(self.settings.admin_read_token, self.settings.admin_token)
        check_exposure(t.admin.host, tokens)  # before anything binds
        if await self.discovery.sync():  # waits (bounded) for each Service's first LIST
            await self._pods_moved()
        self.grpc_server = grpc.aio.server(
            options=[("grpc.keepalive_time_ms", 30_000), ("grpc.so_reuseport", 0)]
        )
        tls = t.listener.upstream_tls if t.xds_tls else None
        domain = tls.trust_domain if tls is not None else None
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(
            AdsServicer(self.cache, self.nodes, self.metrics, domain), self.grpc_server
        )
        # The tenants' token limits: Envoy's rate limit service, on the same port and mTLS.
        self.token_limiter = TokenLimiter(
            lambda: self.topology.listener.auth,
            lambda: frozenset(m.name for m in self.topology.models),
            self.metrics,
            domain,
        )
        rls_pb2_grpc.add_RateLimitServiceServicer_to_server(self.token_limiter, self.grpc_server)
        xds_port = t.xds.port if self.settings.xds_port is None else self.settings.xds_port
        address = f"{t.xds.host}:{xds_port}"
        self.xds_port = (
            self.grpc_server.add_secure_port(
                address,
                upstream_tls.server_credentials(lambda: self.topology.listener.upstream_tls),
            )
            if tls is not None
            else self.grpc_server.add_insecure_port(address)
        )
        admin_port = t.admin.port if self.settings.admin_port is None else self.settings.admin_port
        self.admin = AdminServer(
            t.admin.host,
            admin_port,
            asyncio.get_running_loop(),
            self.metrics.registry,
            gets={
                "/status": self.api.status,
                "/telemetry": self.api.telemetry_json,
                "/decisions": self.api.decisions,
                "/canaries": self.api.canaries_json,
            },
            posts=[
                (r"/endpoints/([^/]+)", self.api.override),
                (r"/models/([^/]+)/split", self.api.set_split),
                (r"/models/([^/]+)/canary", self.api.canary_request),
            ],
            healthy=self.api.healthy,
            live=self.live,
            tokens=tokens,
        )
        self.admin_port = self.admin.port
        otlp_port = t.telemetry.port if self.settings.otlp_port is None else self.settings.otlp_port
        if t.telemetry.shards:
            tls = t.listener.upstream_tls
            me = tls.control_plane if tls is not None and t.telemetry.tls else None
            self.shards = TelemetryShards(
                t.telemetry.shards, t.telemetry, self.envoy_stats, self.metrics,
                # called in a reader thread: the event is set on the loop's
                on_moved=functools.partial(
                    asyncio.get_running_loop().call_soon_threadsafe, self.routing.wake.set
                ),
                pki=(tls.pki_dir, me.name) if tls is not None and me is not None else None,
            )  # fmt: skip
            self.telemetry.shards = self.shards
            self.shards.set_pods(self.server_pods)  # what each shard is told when it starts
            self.otlp_port = await asyncio.to_thread(self.shards.start, otlp_port)
        else:
            await self._start_receiver(otlp_port)
        self.scraper.set_targets(t.scrape_targets)
        self.scraper.set_tls(t.listener.upstream_tls)
        await self.scraper.start()
        await self.poller.poll_once()  # the first snapshot already knows what is READY where
        self.rebuild("start")
        await self.grpc_server.start()
        self.admin.start()
        await self.poller.start()
        # Each subsystem owns its loop; this only starts them, supervised.
        spawn = self.loops.spawn
        spawn("watch_topology", self._watch_topology)
        if self.settings.routing:
            spawn("route_by_telemetry", self.routing.run_forever)
        spawn("refresh_dns", self.discovery.refresh_dns)
        spawn("follow_slices", self.discovery.follow_slices)
        spawn(
            "publish_live_view",
            lambda: self.live.publish_forever(self.api.live_frame, lambda: len(self.endpoints)),
        )
        spawn(
            "judge_canaries",
            lambda: self.canaries.judge_forever(
                self._version_stats, self.version_ready, self._canary_stepped
            ),
        )
        spawn(
            "probe_on_hints", lambda: self.poller.follow_hints(self.telemetry.take_placement_hints)
        )
        spawn(
            "watch_circuits",
            lambda: self.fallbacks.watch_forever(
                lambda: self.topology, self.envoy_stats.recent_overflows, self._circuits_moved
            ),
        )
        log.info(
            "control plane listening: xds=%s:%d admin=%s:%d otlp=%s:%d topology=%s endpoints=%d",
            t.xds.host, self.xds_port, t.admin.host, self.admin_port,
            t.telemetry.host, self.otlp_port,
            self.settings.topology, len(self.endpoints),
        )  # fmt: skip

    async def _start_receiver(self, port: int) -> None:
        """The OTLP receiver in this process, on the in-process store."""
        t = self.topology.telemetry
        if t.decoder_processes:
            self.decoders = start_decoders(t.decoder_processes)
        self.otlp_server, self.otlp_port = await start_receiver(
            self.store,
            self.metrics,
            t.host,
            port,
            envoy=self.envoy_stats,
            decoders=self.decoders,
            tls=(lambda: self.topology.listener.upstream_tls) if t.tls else None,
            pods=lambda: self.server_pods,
        )

    async def stop(self) -> None:
        await self.poller.stop()
        await self.scraper.stop()
        self.loops.stop()
        await self.discovery.stop()
        if self.admin is not None:
            self.admin.stop()
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace=1.0)
        if self.otlp_server is not None:
            await self.otlp_server.stop(grace=0.5)
        if self.decoders is not None:
            self.decoders.shutdown(wait=False, cancel_futures=True)
        if self.shards is not None:
            await asyncio.to_thread(self.shards.stop)

    # -- the one place that changes what Envoy is told ----------------------------------------
    def rebuild(self, reason: str) -> bool:
        """A rebuild now (an operator's change): whether Envoy's snapshot changed."""
        return self.rebuilder.now(reason)

    @property
    def mesh_state(self) -> MeshState | None:
        """What the current snapshot was built from."""
        return self.rebuilder.state

    @property
    def last_rebuild(self) -> dict[str, Any]:
        return self.rebuilder.last

    def _mesh_inputs(self) -> MeshState:
        return build_mesh_state(
            self.effective_topology(),
            self.routing.reports(),
            self.operator.weights,
            self.operator.health,
            pool_weights=self.router.pool_weights(),
            pool_health=self.router.pool_health(),
            labels=self.endpoint_labels(),
            checked_down=self.checked_down,
            memo=self.mesh_memo,
        )

    def _on_placement_change(self, reports: Any) -> None:
        # Before the rebuild reads them: a server that just became unreachable from here but
        # that Envoy still reaches stays in its clusters, with no flap (routing.partitions).
        self.routing.refresh_held(time.monotonic())
        self.rebuilder.request("placement changed")

    @property
    def checked_down(self) -> dict[str, frozenset[EndpointAddress]]:
        """listener.health_checks: model: what Envoy's checks find down (routing.loop)."""
        return self.routing.checked_down

    @property
    def held_endpoints(self) -> frozenset[EndpointAddress]:
        """Unreachable from here, but Envoy's checks pass: kept (routing.partitions)."""
        return frozenset(self.routing.held)

    def _canary_stepped(self, model: str, run: CanaryRun) -> None:
        self.operator.set_split(model, run.split())
        self.rebuilder.request(f"canary of {model}: {run.reason}")

    def _circuits_moved(self, models: list[str]) -> None:
        self.rebuilder.request(f"circuit of {', '.join(models)} opened or closed")

    def _version_stats(
        self, models: list[str], now: float
    ) -> dict[str, dict[str, VersionTelemetry]]:
        # A canary is judged on what its versions did since it started, not before.
        since = {m: self.canaries.runs[m].started_at for m in models}
        return {m: self.telemetry.version_stats(m, now, since[m]) for m in models}

    def version_ready(self, model: str, version: str) -> bool:
        """Whether some reachable endpoint has this version of the model READY."""
        return any(
            r.reachable and (model, version) in r.ready_models for r in self.poller.reports.values()
        )

    # -- topology and DNS ---------------------------------------------------------------------
    async def reload_on_hangup(self) -> None:
        await self.reload_topology("SIGHUP")

    async def reload_topology(self, reason: str) -> None:
        try:
            topology = await asyncio.to_thread(load_with_overrides, self.settings)
        except (TopologyError, OSError) as exc:
            self.topology_error = str(exc)
            self.metrics.topology_reload_failures.inc()
            log.error("topology not reloaded (%s); keeping the last good one: %s", reason, exc)
            return
        if (topology.xds, topology.admin) != (self.topology.xds, self.topology.admin):
            log.warning("xds/admin addresses changed in the topology: they apply at restart")
        self.topology, self.topology_error = topology, ""
        log.info(
            "topology reloaded (%s): %d models, %d endpoint sources",
            reason, len(topology.models), len(topology.endpoints),
        )  # fmt: skip
        self.poller.interval_s = topology.placement.poll_interval_s
        self.poller.max_probes_per_s = topology.placement.max_probes_per_s
        self.poller.max_concurrent_probes = topology.placement.max_concurrent_probes
        self.poller.unreachable_after = topology.placement.unreachable_after
        await self.poller.set_tls(self.upstream_tls())
        self._publish_certificates()
        self.scraper.interval_s = topology.telemetry.scrape_interval_s
        self.scraper.set_targets(topology.scrape_targets)
        self.scraper.set_tls(topology.listener.upstream_tls)
        if await self.discovery.sync():
            await self._pods_moved()
        await self.poller.poll_once()
        self.rebuilder.request(f"topology reloaded ({reason})")

    def _publish_certificates(self) -> None:
        """certificate_expiry_timestamp_seconds{identity}: alert on it (renewal stopped)."""
        tls = self.topology.listener.upstream_tls
        self.metrics.certificate_expiry.clear()
        for spiffe_id, expiry in upstream_tls.served_identities(tls) if tls else ():
            self.metrics.certificate_expiry.labels(spiffe_id).set(expiry)

    def _fingerprints(self) -> tuple[TopologyFingerprint | None, ...]:
        """The topology file's, then those of the files it names (API keys, JWKS, the
        certificates): a key added or revoked, a certificate renewed, reaches Envoy without a
        restart."""
        tls, edge = self.topology.listener.upstream_tls, self.topology.listener.tls
        paths: tuple[str | os.PathLike[str], ...] = (
            self.settings.topology, *self.topology.listener.auth.files,
            *(tls.files if tls is not None else ()), *(edge.files if edge is not None else ()),
        )  # fmt: skip
        found = tuple(topology_fingerprint(path) for path in paths)
        # A new Envoy node's certificate is served once it appears, with no reload asked.
        return found + ((listing_fingerprint(tls.pki_dir, "envoy_*.crt"),) if tls else ())

    async def _watch_topology(self) -> None:
        while True:
            await asyncio.sleep(TOPOLOGY_CHECK_INTERVAL_S)
            fingerprint = await asyncio.to_thread(self._fingerprints)
            if fingerprint[0] is not None and fingerprint != self.fingerprint:
                self.fingerprint = fingerprint
                await self.reload_topology("file changed")

    @property
    def endpoints(self) -> tuple[EndpointAddress, ...]:
        """The servers the topology's sources name now (``DiscoveredEndpoints``)."""
        return self.discovery.addresses

    @property
    def server_pods(self) -> ServerPods:
        """Kubernetes: the pod at each address, whose name its certificate carries."""
        return self.discovery.pods

    async def _endpoints_changed(self, reason: str, pods_moved: bool) -> None:
        """Discovery found other servers: ask them what they serve, then tell Envoy."""
        if pods_moved:
            await self._pods_moved()
        await self.poller.poll_once()
        self.rebuilder.request(reason)

    async def _pods_moved(self) -> None:
        """New pods reach every check of a server's certificate: the probes' and the
        telemetry shards' here, Envoy's with the next rebuild (``upstream_tls``)."""
        await self.poller.set_tls(self.upstream_tls())
        if self.shards is not None:
            await asyncio.to_thread(self.shards.set_pods, self.server_pods)

    def upstream_tls(self) -> UpstreamTls | None:
        """The topology's mutual TLS to the servers with discovery's pods in it
        (``UpstreamTls.pods``): what probes, telemetry and Envoy check servers by."""
        return self._discovered_topology().listener.upstream_tls

    def _discovered_topology(self) -> Topology:
        """The topology with ``server_pods`` in its upstream TLS: the same object until
        either changes, so the snapshot's caches keyed on its listener keep their entries."""
        tls = self.topology.listener.upstream_tls
        if tls is None or not self.server_pods:
            return self.topology
        base, pods, made = self._with_pods
        if base is not self.topology or pods is not self.server_pods:
            listener = dataclasses.replace(
                self.topology.listener, upstream_tls=dataclasses.replace(tls, pods=self.server_pods)
            )
            made = dataclasses.replace(self.topology, listener=listener)
            self._with_pods = (self.topology, self.server_pods, made)
        return made

    # -- admin --------------------------------------------------------------------------------
    def endpoint_labels(self) -> Mapping[str, Labels]:
        """The labels routing and the lanes use: the topology's over the servers' own
        (``control_plane.model.lanes``); the topology's alone until routing has run."""
        return self.router.labels or self.topology.endpoint_labels

    def effective_topology(self) -> Topology:
        """The topology with the operator's (and canaries') version splits in place of the
        file's, the models whose circuit is open routed to their fallback, each model's
        per-try timeout from telemetry (routing.hedging), and discovery's pods
        (``upstream_tls``)."""
        opened = self.fallbacks.open_models(time.monotonic())
        topology = self._discovered_topology()
        splits = self.operator.splits
        hedges = self.router.pool_hedges()
        if not splits and not opened and not hedges:
            return topology
        models = tuple(
            dataclasses.replace(
                m,
                version_split=splits.get(m.name, m.version_split),
                fallback_active=m.name in opened,
                hedge_per_try_s=hedges[m.name].timeout_s if m.name in hedges else None,
            )
            for m in self.topology.models
        )
        return dataclasses.replace(topology, models=models)


async def serve(settings: ControlPlaneSettings) -> int:
    plane = ControlPlane(settings)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    # Handlers first: a SIGHUP that arrives while starting must not kill the process.
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(
        signal.SIGHUP, lambda: plane.loops.spawn("reload_on_hangup", plane.reload_on_hangup)
    )
    try:
        await plane.start()
    except BaseException:
        with contextlib.suppress(Exception):
            await plane.stop()  # what started before the failure (telemetry shards)
        raise
    await stop.wait()
    log.info("control plane stopping")
    with contextlib.suppress(Exception):
        await plane.stop()
    return 0
