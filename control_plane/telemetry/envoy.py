"""Envoy's own view of each endpoint, from its OpenTelemetry stat sink (pure, no I/O).

Envoy reports with the resource attribute telemetry.sdk.name = "envoy" and no
service.instance.id; per-endpoint stats (``track_cluster_stats.per_endpoint_stats``) carry
``envoy.cluster_name`` and ``envoy.endpoint_address``. They tell what Envoy sent each endpoint
and how much failed, which the servers cannot see (a refused connection never reaches them).
Envoy has no per-endpoint latency histogram: per-endpoint P99 comes from the servers.

Several Envoys report: each tags its stats with its node id (``ENVOY_NODE_TAG``, a fixed tag
in the bootstrap), and every series is kept per Envoy. Interleaved in one series, two Envoys'
counters would read as restarts at every report. Stats without the tag (an Envoy with another
bootstrap) count as one unnamed Envoy.

``checked_down`` is what Envoy's own active health checks found: the endpoints every Envoy
that recently reported them in a cluster calls unhealthy there. With
``listener.health_checks: model`` only a model's own clusters are checked, and the control
plane carries this into the model's other clusters (see ``placement.build_mesh_state``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.metrics.v1 import metrics_pb2

from infermesh.wire import ENVOY_NODE_TAG

ENVOY_SDK_NAME = "envoy"
# Envoy stat (tag-extracted name) -> our signal name, and whether it is a counter.
ENDPOINT_STATS = {
    "cluster.endpoint.rq_total": ("requests", True),
    "cluster.endpoint.rq_error": ("errors", True),
    "cluster.endpoint.rq_active": ("active", False),
    "cluster.endpoint.healthy": ("healthy", False),
}
# Cluster-level counters: requests Envoy refused because a circuit breaker was open; and the
# requests it sent upstream, of which retries (a hedge counts as one), for hedging's guard.
CLUSTER_STATS = {
    "cluster.upstream_rq_pending_overflow": "overflow",
    "cluster.upstream_rq_active_overflow": "overflow",
    "cluster.upstream_rq_retry": "retries",
    "cluster.upstream_rq_total": "requests",
}
USED_STATS = frozenset(ENDPOINT_STATS) | frozenset(CLUSTER_STATS)
MAX_ENDPOINTS = 10_000
MAX_CLUSTERS = 10_000
CHECKED_DOWN_MAX_AGE_S = 3.0  # Envoy flushes stats every second: three missed reports
RETRY_WINDOW_S = 10.0  # hedging's guard: a slow server re-weighted in ~1 s stays under budget
FORGET_NODE_AFTER_S = 60.0  # an Envoy silent this long (replaced, renamed) loses its series


def is_envoy(resource_metrics: metrics_pb2.ResourceMetrics) -> bool:
    return any(
        a.key == "telemetry.sdk.name" and a.value.string_value == ENVOY_SDK_NAME
        for a in resource_metrics.resource.attributes
    )


def used_stats(resources: Iterable[metrics_pb2.ResourceMetrics]) -> bytes:
    """An export request of only the stats ``EnvoyStats`` reads, serialised: what a telemetry
    shard forwards of an Envoy's report (Envoy sends every stat it has, a few hundred per
    cluster, and the control plane's process reads a handful)."""
    out = ExportMetricsServiceRequest()
    for resource in resources:
        kept = out.resource_metrics.add(resource=resource.resource)
        for scope in resource.scope_metrics:
            wanted = [m for m in scope.metrics if m.name in USED_STATS]
            if wanted:
                kept.scope_metrics.add(scope=scope.scope).metrics.extend(wanted)
    return out.SerializeToString()


def stat_name(cluster: str) -> str:
    """A cluster's name as Envoy writes it in stats (``model:m`` -> ``model_m``)."""
    return cluster.replace(":", "_")


def _drop_nodes(series: dict[Any, Any], nodes: set[str]) -> None:
    """Deletes the keys whose last item (the Envoy node) is one of ``nodes``."""
    for key in [k for k in series if k[-1] in nodes]:
        del series[key]


def node_of(resource: metrics_pb2.ResourceMetrics) -> str:
    """The reporting Envoy's node id: the fixed tag on its stats ("" without it)."""
    for scope in resource.scope_metrics:
        for metric in scope.metrics:
            kind = metric.WhichOneof("data")
            for point in getattr(metric, kind).data_points if kind else ():
                for attribute in point.attributes:
                    if attribute.key == ENVOY_NODE_TAG:
                        return attribute.value.string_value
                break  # the tag is on every stat or on none
    return ""


class EnvoyStats:
    """Per endpoint and cluster: counter samples over a window, and the last gauges."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self.last_report: float | None = None
        # (address, cluster, signal, Envoy node) -> samples, or the last gauge
        self._counters: dict[tuple[str, str, str, str], deque[tuple[float, float]]] = {}
        self._gauges: dict[tuple[str, str, str, str], tuple[float, float]] = {}
        # (stat, cluster, Envoy node) -> (arrival, value) samples over the window
        self._cluster_counters: dict[tuple[str, str, str], deque[tuple[float, float]]] = {}
        self._previous_report: dict[str, float] = {}  # Envoy node -> its previous report
        # (address, cluster) some Envoy called unhealthy: checked_down reads only these, not
        # every gauge (at 10,000 endpoints Envoy reports tens of thousands a second)
        self._maybe_down: set[tuple[str, str]] = set()
        self._nodes: set[str] = set()
        self._lock = threading.Lock()

    def ingest(self, resources: Iterable[metrics_pb2.ResourceMetrics], now: float) -> int:
        used = 0
        with self._lock:
            self.last_report = now
            self._forget_silent_nodes(now)
            for resource in resources:
                node = node_of(resource)  # one Envoy's report
                for scope in resource.scope_metrics:
                    for metric in scope.metrics:
                        known = ENDPOINT_STATS.get(metric.name)
                        if known is not None:
                            used += self._metric(metric, known[0], known[1], now, node)
                        elif metric.name in CLUSTER_STATS:
                            used += self._cluster_metric(metric, now, node)
                self._previous_report[node] = now
                self._nodes.add(node)
        return used

    def _forget_silent_nodes(self, now: float) -> None:
        """Every series of a node not heard from for FORGET_NODE_AFTER_S goes: Envoys come and
        go under new node ids (a Kubernetes pod's name), and their series would otherwise
        fill the caps for good."""
        silent = {n for n, at in self._previous_report.items() if now - at > FORGET_NODE_AFTER_S}
        if not silent:
            return
        for series in (self._counters, self._gauges, self._cluster_counters):
            _drop_nodes(series, silent)
        for node in silent:
            del self._previous_report[node]
        self._nodes -= silent

    def _metric(
        self, metric: metrics_pb2.Metric, name: str, counter: bool, now: float, node: str
    ) -> int:
        data = metric.sum.data_points if counter else metric.gauge.data_points
        used = 0
        for point in data:
            attrs = {a.key: a.value.string_value for a in point.attributes}
            address = attrs.get("envoy.endpoint_address", "")
            if not address:
                continue
            key = (address, attrs.get("envoy.cluster_name", ""), name, node)
            value = float(point.as_int if point.HasField("as_int") else point.as_double)
            if counter:
                samples = self._counters.get(key)
                if samples is None:
                    if len(self._counters) >= MAX_ENDPOINTS * 8:
                        continue
                    samples = self._counters[key] = deque(maxlen=256)
                if samples and value < samples[-1][1]:
                    samples.clear()  # Envoy restarted: a new series
                samples.append((now, value))
                while len(samples) > 2 and samples[1][0] < now - self.window_s:
                    samples.popleft()
            elif key in self._gauges or len(self._gauges) < MAX_ENDPOINTS * 8:
                self._gauges[key] = (now, value)
                if name == "healthy" and value <= 0:
                    self._maybe_down.add(key[:2])
            used += 1
        return used

    def _cluster_metric(self, metric: metrics_pb2.Metric, now: float, node: str) -> int:
        used = 0
        for point in metric.sum.data_points:
            attrs = {a.key: a.value.string_value for a in point.attributes}
            if "envoy.endpoint_address" in attrs or not attrs.get("envoy.cluster_name"):
                continue
            key = (metric.name, attrs["envoy.cluster_name"], node)
            samples = self._cluster_counters.get(key)
            if samples is None:
                if len(self._cluster_counters) >= MAX_CLUSTERS:
                    continue
                samples = self._cluster_counters[key] = deque(maxlen=64)
                previous = self._previous_report.get(node)
                if previous is not None:
                    # Envoy exports a counter once it is first used: it was 0 at the last report.
                    samples.append((previous, 0.0))
            value = float(point.as_int if point.HasField("as_int") else point.as_double)
            if samples and value < samples[-1][1]:
                samples.clear()  # Envoy restarted
            samples.append((now, value))
            while len(samples) > 2 and samples[1][0] < now - RETRY_WINDOW_S:
                samples.popleft()
            used += 1
        return used

    def recent_overflows(self, clusters: set[str], now: float, max_age_s: float = 3.0) -> float:
        """Requests refused by open circuit breakers in ``clusters`` between Envoy's last two
        reports (names as Envoy writes them in stats: ':' becomes '_'), if the last is recent."""
        wanted = {stat_name(c) for c in clusters}
        total = 0.0
        with self._lock:
            for (stat, cluster, _node), samples in self._cluster_counters.items():
                if CLUSTER_STATS[stat] != "overflow" or cluster not in wanted:
                    continue
                if len(samples) >= 2 and now - samples[-1][0] <= max_age_s:
                    total += samples[-1][1] - samples[-2][1]
        return total

    def retry_shares(
        self, clusters_by_model: Mapping[str, Collection[str]], now: float
    ) -> dict[str, float | None]:
        """Envoy's retries (hedges included) per first try it sent to each model's clusters
        over the last ``RETRY_WINDOW_S`` (not the telemetry window, which may be as short as a
        second or two: a slow server's first second would read as a whole window of hedges),
        from every Envoy that reported within it; None for a model it sent none. One pass over
        Envoy's counters for every model (a routing tick asks for every hedged model)."""
        model_of = {stat_name(c): m for m, clusters in clusters_by_model.items() for c in clusters}
        counted = {m: {"retries": 0.0, "requests": 0.0} for m in clusters_by_model}
        with self._lock:
            for (stat, cluster, _node), samples in self._cluster_counters.items():
                kind, model = CLUSTER_STATS[stat], model_of.get(cluster)
                if model is None or kind not in ("retries", "requests"):
                    continue
                if now - samples[-1][0] <= RETRY_WINDOW_S:
                    counted[model][kind] += samples[-1][1] - samples[0][1]
        shares: dict[str, float | None] = {}
        for model, count in counted.items():
            first_tries = count["requests"] - count["retries"]
            shares[model] = count["retries"] / first_tries if first_tries > 0 else None
        return shares

    def as_json(self, now: float) -> dict[str, Any]:
        with self._lock:
            endpoints: dict[str, dict[str, Any]] = {}
            for (address, _cluster, name, _node), samples in self._counters.items():
                entry = endpoints.setdefault(address, {})
                first, last = samples[0], samples[-1]
                rate = (last[1] - first[1]) / (last[0] - first[0]) if last[0] > first[0] else 0.0
                entry[f"{name}_per_s"] = round(entry.get(f"{name}_per_s", 0.0) + rate, 3)
                entry["age_s"] = round(min(entry.get("age_s", 1e9), now - last[0]), 3)
            for (address, _cluster, name, _node), (_at, value) in self._gauges.items():
                entry = endpoints.setdefault(address, {})
                if name == "healthy":  # healthy in every cluster it is in
                    entry[name] = bool(entry.get(name, True) and value > 0)
                else:
                    entry[name] = entry.get(name, 0.0) + value
            age = None if self.last_report is None else round(now - self.last_report, 3)
            return {
                "last_report_age_s": age,
                "nodes": sorted(self._nodes),  # the reporting Envoys ("": without the tag)
                "endpoints": dict(sorted(endpoints.items())),
            }

    def checks_pass(
        self, addresses: Collection[str], now: float, max_age_s: float = CHECKED_DOWN_MAX_AGE_S
    ) -> frozenset[str]:
        """Those of ``addresses`` (endpoint keys) that some Envoy reported within ``max_age_s``
        and that every such report calls healthy, in every cluster: Envoy reaches them and its
        checks (and outlier detection) pass. One pass over the gauges, so callers ask only for
        the few endpoints in question (routing.partitions)."""
        wanted = set(addresses)
        if not wanted:
            return frozenset()
        seen: set[str] = set()
        failing: set[str] = set()
        with self._lock:
            for (address, _, name, _), (at, value) in self._gauges.items():
                if name == "healthy" and address in wanted and now - at <= max_age_s:
                    (seen if value > 0 else failing).add(address)
        return frozenset(seen - failing)

    def checked_down(
        self, now: float, max_age_s: float = CHECKED_DOWN_MAX_AGE_S
    ) -> dict[str, frozenset[str]]:
        """Per cluster (its ``stat_name``), the endpoints that every Envoy reporting them there
        within ``max_age_s`` calls unhealthy. One Envoy that cannot reach a server (its own
        network) does not take it away from the others."""
        out: dict[str, set[str]] = {}
        with self._lock:
            for address, cluster in list(self._maybe_down):
                said = []  # what each Envoy that reported it recently says
                for node in self._nodes:
                    sample = self._gauges.get((address, cluster, "healthy", node))
                    if sample is not None and now - sample[0] <= max_age_s:
                        said.append(sample[1])
                if said and all(value <= 0 for value in said):
                    out.setdefault(cluster, set()).add(address)
                elif not any(value <= 0 for value in said):  # up again, or no word: forget
                    self._maybe_down.discard((address, cluster))
        return {cluster: frozenset(addresses) for cluster, addresses in out.items()}
