"""Every instrument the control plane exports, defined once (Prometheus text on its admin port)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from control_plane.model.mesh import EndpointAssignment

FAST_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip


class ControlPlaneMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._published: dict[str, tuple[EndpointAssignment, ...]] = {}  # per cluster
        r = self.registry
        self.nacks = Counter(
            "xds_nacks", "xDS responses an Envoy rejected (NACK)", ["type"], registry=r
        )
        self.responses = Counter(
            "xds_responses", "xDS responses sent", ["type", "mode"], registry=r
        )
        self.streams = Gauge("xds_connected_streams", "Open ADS streams", ["mode"], registry=r)
        self.push_to_ack = Histogram(
            "xds_push_to_ack_seconds",
            "Time from sending an xDS response to its ACK",
            ["type"],
            buckets=FAST_BUCKETS_S,
            registry=r,
        )
        # Labels bounded: named tenants and "other"; the topology's models (control_plane.xds
        # .token_limiter); event reserved | refunded | used.
        self.tenant_tokens = Counter(
            "tenant_tokens",
            "Tokens of tenants' requests per model: reserved at admission, refunded at the end, "
            "used as the model server reported",
            ["tenant", "model", "event"],
            registry=r,
        )
        self.tenant_token_refusals = Counter(
            "tenant_token_refusals",
            "Requests refused by a tenant's token limit on a model",
            ["tenant", "model"],
            registry=r,
        )
        self.snapshots = Counter("xds_snapshots", "Snapshots set (a changed mesh)", registry=r)
        self.rebuild_requests = Counter(
            "xds_rebuild_requests",
            "Requests for a rebuild (several may be served by one: xds_snapshot_build_seconds)",
            registry=r,
        )
        self.snapshot_build = Histogram(
            "xds_snapshot_build_seconds",
            "Time to build and check a snapshot from the mesh state",
            buckets=FAST_BUCKETS_S,
            registry=r,
        )
        self.telemetry_points = Counter(
            "telemetry_points", "OTLP metric data points accepted by the receiver", registry=r
        )
        self.telemetry_points_ignored = Counter(
            "telemetry_points_ignored",
            "OTLP metric data points ignored (malformed, unknown or over a limit)",
            ["reason"],
            registry=r,
        )
        self.telemetry_ingest = Histogram(
            "telemetry_ingest_seconds",
            "Time to decode and store one OTLP export request",
            buckets=FAST_BUCKETS_S,
            registry=r,
        )
        self.telemetry_shard_restarts = Counter(
            "telemetry_shard_restarts",
            "Telemetry shard processes that ended unasked and were started again",
            registry=r,
        )
        self.telemetry_shard_endpoints = Counter(
            "telemetry_shard_endpoints",
            "Endpoints in the shards' pushes: sent whole (their telemetry moved) or touched "
            "(reported, within telemetry.push_tolerance of what was sent)",
            ["sent"],
            registry=r,
        )
        self.telemetry_shard_points = Counter(
            "telemetry_shard_points",
            "Data points each telemetry shard took in, used or not: the kernel shares out "
            "connections, not points, so a few exporters' connections (a handful of collectors) "
            "can leave one shard most of the work",
            ["shard"],
            registry=r,
        )
        self.telemetry_shard_delay = Histogram(
            "telemetry_shard_delay_seconds",
            "From a report's arrival at a telemetry shard to the control plane holding it (the "
            "oldest report of each push): how far ingest runs behind",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=r,
        )
        self.telemetry_endpoints = Gauge(
            "telemetry_endpoints", "Endpoints the telemetry store currently tracks", registry=r
        )
        self.routing_recompute = Histogram(
            "routing_recompute_seconds",
            "Time to turn telemetry into every pool's weights and ejections",
            buckets=FAST_BUCKETS_S,
            registry=r,
        )
        self.routing_pools = Counter(
            "routing_pools",
            "Pools per routing tick: computed, or skipped at rest (no input moved)",
            ["outcome"],
            registry=r,
        )
        self.loop_failures = Counter(
            "control_loop_failures",
            "Iterations of a control-plane loop that raised (the loop is restarted)",
            ["loop"],
            registry=r,
        )
        self.ejections = Counter(
            "routing_ejections",
            "Endpoints ejected by telemetry-driven routing, by cause",
            ["cause"],
            registry=r,
        )
        self.canary_percent = Gauge(
            "canary_percent", "Share of a model's traffic on its canary version", ["model"],
            registry=r,
        )  # fmt: skip
        self.canary_transitions = Counter(
            "canary_transitions",
            "Canary steps by outcome (started, advanced, promoted, rolled_back, aborted)",
            ["model", "outcome"],
            registry=r,
        )
        self.endpoint_weight = Gauge(
            "xds_endpoint_weight",
            "EDS load_balancing_weight pushed, per cluster and endpoint",
            ["cluster", "endpoint"],
            registry=r,
        )
        self.telemetry_reports_rejected = Counter(
            "telemetry_reports_rejected",
            "OTLP reports refused because the sender is not the workload they report for",
            ["reason"],
            registry=r,
        )
        self.topology_reload_failures = Counter(
            "topology_reload_failures",
            "reloads of the topology (or a file it names: keys, certificates) that failed their "
            "checks; the last good one stays in use, /status says why",
            registry=r,
        )
        self.certificate_expiry = Gauge(
            "certificate_expiry_timestamp_seconds",
            "when each certificate the control plane serves (Envoy's, over SDS) or uses expires",
            ["identity"],
            registry=r,
        )
        self.endpoint_health = Gauge(
            "xds_endpoint_health",
            "1 for the EDS health pushed for each endpoint in each cluster",
            ["cluster", "endpoint", "health"],
            registry=r,
        )

    def publish_assignments(self, clusters: Mapping[str, Sequence[EndpointAssignment]]) -> None:
        """Replaces the weight and health series with what the snapshot just set; only the
        endpoints whose assignment changed are touched (a weight change in one pool of a fleet
        rewrote every series: 7% of the control plane's time at 1,000 endpoints; one server
        leaving or joining rewrote every series of `servers`, 16% at 10,000)."""
        published = self._published
        for cluster in [c for c in published if c not in clusters]:
            self._unpublish(cluster, published.pop(cluster))
        for cluster, assignments in clusters.items():
            before = published.get(cluster)
            now = tuple(assignments)
            if before is not None and before == now:
                continue
            old = set(before or ())
            new = set(now)
            self._unpublish(cluster, old - new)  # changed weight or health too: new series below
            for a in new - old:
                self.endpoint_weight.labels(cluster, a.address.key).set(a.weight)
                self.endpoint_health.labels(cluster, a.address.key, a.health.value).set(1)
            published[cluster] = now

    def _unpublish(self, cluster: str, assignments: Iterable[EndpointAssignment]) -> None:
        for a in assignments:
            with contextlib.suppress(KeyError):
                self.endpoint_weight.remove(cluster, a.address.key)
            with contextlib.suppress(KeyError):
                self.endpoint_health.remove(cluster, a.address.key, a.health.value)
