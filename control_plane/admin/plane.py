"""What the operator API needs of the control plane, as a narrow interface.

The composition root (``app.server.ControlPlane``) offers all of this; the admin layer names
only what it reads and the one way it changes things (``rebuild``), so it imports nothing
above it and a test can hand it any object that has these members.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from control_plane.config.topology import Topology
from control_plane.discovery.placement import PlacementPoller
from control_plane.model.mesh import EndpointAddress, MeshState, UpstreamTls
from control_plane.model.operator_state import OperatorState
from control_plane.routing.canary_runs import CanaryRuns
from control_plane.routing.fallback import Fallbacks
from control_plane.routing.router import Router
from control_plane.scoring.types import Labels
from control_plane.telemetry.envoy import EnvoyStats
from control_plane.telemetry.readings import TelemetryReadings
from control_plane.telemetry.scraper import MetricsScraper
from control_plane.xds.nodes import NodeRegistry
from control_plane.xds.snapshot import SnapshotCache


class PlaneSettings(Protocol):
    @property
    def topology(self) -> Path: ...


class OperatedPlane(Protocol):
    """Read-only views of the plane's parts, and ``rebuild``: the one place a change is made."""

    @property
    def settings(self) -> PlaneSettings: ...
    @property
    def topology(self) -> Topology: ...
    @property
    def topology_error(self) -> str: ...
    @property
    def last_rebuild(self) -> dict[str, Any]: ...
    @property
    def mesh_state(self) -> MeshState | None: ...
    @property
    def cache(self) -> SnapshotCache: ...
    @property
    def nodes(self) -> NodeRegistry: ...
    @property
    def poller(self) -> PlacementPoller: ...
    @property
    def operator(self) -> OperatorState: ...
    @property
    def router(self) -> Router: ...
    @property
    def canaries(self) -> CanaryRuns: ...
    @property
    def fallbacks(self) -> Fallbacks: ...
    @property
    def checked_down(self) -> dict[str, frozenset[EndpointAddress]]: ...
    @property
    def held_endpoints(self) -> frozenset[EndpointAddress]: ...
    @property
    def telemetry(self) -> TelemetryReadings: ...
    @property
    def scraper(self) -> MetricsScraper: ...
    @property
    def envoy_stats(self) -> EnvoyStats: ...
    @property
    def endpoints(self) -> tuple[EndpointAddress, ...]: ...

    def endpoint_labels(self) -> Mapping[str, Labels]: ...
    def effective_topology(self) -> Topology: ...
    def upstream_tls(self) -> UpstreamTls | None: ...
    def rebuild(self, reason: str) -> bool: ...
