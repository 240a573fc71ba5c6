"""Every series the Grafana dashboard queries is one that InferMesh or Envoy exports."""

from __future__ import annotations

import json
import re

from prometheus_client import CollectorRegistry

from control_plane.metrics import ControlPlaneMetrics
from model_server.observability.metrics import ServerMetrics
from tests.support import ROOT

PROMQL_WORDS = {"histogram_quantile", "clamp_min", "sum", "by", "rate", "increase"}
LABELS = {"le", "instance", "code", "cluster", "endpoint", "health", "device", "source", "model",
          "type", "envoy_cluster_name"}  # fmt: skip


def exported(registry: CollectorRegistry) -> set[str]:
    names: set[str] = set()
    for family in registry.collect():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


def test_dashboard_queries_only_exported_series() -> None:
    dashboard = json.loads((ROOT / "otel" / "grafana" / "infermesh-dashboard.json").read_text())
    known = exported(ServerMetrics().registry) | exported(ControlPlaneMetrics().registry)
    queried: set[str] = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = re.sub(r'"[^"]*"', "", target["expr"])  # drop label values
            expr = re.sub(r"\[[^\]]*\]", "", expr)  # and range selectors
            queried |= set(re.findall(r"[a-z_][a-z0-9_]*", expr)) - PROMQL_WORDS - LABELS
    unknown = {name for name in queried - known if not name.startswith("envoy_")}
    assert unknown == set()
    for needed in ("inference_request_duration_seconds_bucket", "xds_endpoint_weight",
                   "accelerator_memory_used_bytes", "kv_cache_blocks_used",
                   "inference_queue_depth"):  # fmt: skip
        assert needed in queried
