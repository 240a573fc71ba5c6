"""Every instrument the model server exports, defined once.

Served as Prometheus text on --metrics-port. The OTLP export of the same instruments (the
telemetry issue) reads the same objects. The names the control plane reads, and the latency
buckets, are the wire contract's (``infermesh.wire``).
"""

from __future__ import annotations

import contextlib
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from infermesh import wire

LOAD_BUCKETS_MS = (10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 120000)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
MODEL_STATES = ("INITIALIZING", "LOADING", "WARMING", "READY", "FAILED", "UNLOADING")


class ServerMetrics:
    """The model server's instruments, registered in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._children: dict[tuple[object, ...], Any] = {}  # child(): cached label children
        r = self.registry
        self.requests = Counter(
            wire.REQUESTS,
            "ModelInfer requests answered, by gRPC status code",
            ["model", "version", "code"],
            registry=r,
        )
        self.tenant_requests = Counter(
            "inference_tenant_requests",
            "Inference requests answered, by the tenant the edge authenticated: a tenant the "
            "topology names, 'other', or 'anonymous' (no authenticating edge)",
            ["model", "tenant", "code"],
            registry=r,
        )
        self.control_requests = Counter(
            "model_control_requests",
            "Model-repository calls (index, load, unload) that reached the service, over gRPC "
            "or REST, past any --restricted-api check, before the model-control mode's",
            ["call"],
            registry=r,
        )
        self.request_duration = Histogram(
            wire.REQUEST_DURATION,
            "ModelInfer time from receipt to answer (validation, queue, compute, encoding)",
            ["model", "version"],
            buckets=wire.LATENCY_BUCKETS_S,
            registry=r,
        )
        self.queue_depth = Gauge(
            wire.QUEUE_DEPTH,
            "Requests validated and waiting for an execution slot",
            ["model"],
            registry=r,
        )
        self.in_flight = Gauge(
            wire.IN_FLIGHT,
            "ModelInfer requests received and not yet answered",
            registry=r,
        )
        self.model_load_time = Histogram(
            "model_load_time_ms",
            "Time to load and warm one model version, in milliseconds",
            ["model"],
            buckets=LOAD_BUCKETS_MS,
            registry=r,
        )
        self.model_state = Gauge(
            wire.MODEL_STATE,
            "1 for the state each loaded model version is in, 0 for the others",
            ["model", "version", "state"],
            registry=r,
        )
        self.model_info = Gauge(
            "model_execution_provider_info",
            "1 per loaded model version, labelled with the execution provider that runs it",
            ["model", "version", "provider"],
            registry=r,
        )
        self.memory_used = Gauge(
            wire.MEMORY_USED,
            "Memory in use on the device (NVML) or by this process (CPU host)",
            ["device", "source"],
            registry=r,
        )
        self.memory_total = Gauge(
            wire.MEMORY_TOTAL,
            "Device memory (NVML) or this process's memory budget (CPU host)",
            ["device", "source"],
            registry=r,
        )
        self.batch_size = Histogram(
            "inference_batch_size",
            "Samples per ModelInfer request (the batch dimension; 1 for unbatched models)",
            ["model"],
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.queue_duration = Histogram(
            "inference_queue_duration_seconds",
            "Time a request waited for an execution slot or a dynamic batch",
            ["model"],
            buckets=wire.LATENCY_BUCKETS_S,
            registry=r,
        )
        self.executed_batch_size = Histogram(
            "inference_executed_batch_size",
            "Samples per ONNX Runtime execution (dynamic batching joins requests)",
            ["model"],
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.rejections = Counter(
            "inference_rejections",
            "Requests answered without running: queue_full (RESOURCE_EXHAUSTED) or deadline "
            "(DEADLINE_EXCEEDED while queued)",
            ["model", "reason"],
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "generation_time_to_first_token_seconds",
            "From a generation request's arrival to its first token",
            ["model"],
            buckets=wire.LATENCY_BUCKETS_S,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "generation_time_per_output_token_seconds",
            "Mean time between a finished sequence's tokens after the first",
            ["model"],
            buckets=wire.LATENCY_BUCKETS_S,
            registry=r,
        )
        self.generated_tokens = Counter(
            "generation_tokens", "Tokens generated (rate: tokens per second)", ["model"],
            registry=r,
        )  # fmt: skip
        self.decode_steps = Counter(
            "generation_decode_steps",
            "Decode steps by where their past came from: carried (the step before's outputs, "
            "the batch unchanged) or gathered (copied out of the KV pool)",
            ["model", "past"], registry=r,
        )  # fmt: skip
        self.sequences = Gauge(
            "generation_sequences", "Sequences generating (running) or waiting for KV blocks",
            ["model", "state"], registry=r,
        )  # fmt: skip
        self.kv_blocks_used = Gauge(
            wire.KV_BLOCKS_USED,
            "KV-cache blocks in use (0 until generative models exist)",
            ["model"],
            registry=r,
        )
        self.kv_blocks_total = Gauge(
            wire.KV_BLOCKS_TOTAL,
            "KV-cache blocks allocated (0 until generative models exist)",
            ["model"],
            registry=r,
        )
        self.prefix_hit_tokens = Counter(
            wire.PREFIX_HIT_TOKENS,
            "Prompt tokens whose keys/values came from the prefix cache (not computed)",
            ["model"], registry=r,
        )  # fmt: skip
        self.prefix_lookup_tokens = Counter(
            wire.PREFIX_LOOKUP_TOKENS,
            "Prompt tokens looked up in the prefix cache (every admitted sequence's)",
            ["model"], registry=r,
        )  # fmt: skip
        self.prefix_evictions = Counter(
            "prefix_cache_evictions", "Cached KV blocks whose memory a new allocation took back",
            ["model"], registry=r,
        )  # fmt: skip
        self.prefix_cached_blocks = Gauge(
            "prefix_cache_blocks", "KV blocks kept for their prefix that no sequence holds",
            ["model"], registry=r,
        )  # fmt: skip
        self.prefix_prefill_saved = Gauge(
            "prefix_cache_prefill_saved_ratio",
            "Share of prompt tokens since the model loaded whose prefill the cache saved",
            ["model"], registry=r,
        )  # fmt: skip
        self.certificate_reload_failures = Counter(
            "certificate_reload_failures",
            "renewed certificate files that failed their checks (the last good one stays in use)",
            registry=r,
        )
        self.certificate_expiry = Gauge(
            "certificate_expiry_timestamp_seconds",
            "when the certificate in use expires, Unix time (absent without --tls-cert)",
            registry=r,
        )
        self.draining = Gauge(
            wire.SERVER_DRAINING, "1 once the server has begun to drain", registry=r
        )
        self.label = Gauge(
            wire.SERVER_LABEL,
            "1 per routing label of the server (name, value): device_class and --label ones",
            ["name", "value"],
            registry=r,
        )

    def child(self, metric: Counter | Histogram, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached: the request path's label sets are few and
        bounded (models, tenants, codes) and their series are never removed, while
        ``labels()`` checks and joins its arguments under a lock on every call."""
        key = (metric, *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def publish_model_version(
        self, model: str, version: str, state: str, provider: str | None, previous: str | None
    ) -> None:
        """Marks ``state`` as the one state of a version, and labels the provider running it."""
        for name in MODEL_STATES:
            self.model_state.labels(model, version, name).set(1 if name == state else 0)
        if previous is not None and previous != provider:
            with contextlib.suppress(KeyError):
                self.model_info.remove(model, version, previous)
        if provider is not None:
            self.model_info.labels(model, version, provider).set(1)
        # No generative models yet: the series exist (at 0) for every loaded model.
        self.kv_blocks_used.labels(model).set(0)
        self.kv_blocks_total.labels(model).set(0)

    def clear_model_version(self, model: str, version: str, provider: str | None) -> None:
        """Removes the series of a version that is no longer loaded."""
        for name in MODEL_STATES:
            with contextlib.suppress(KeyError):
                self.model_state.remove(model, version, name)
        if provider is not None:
            with contextlib.suppress(KeyError):
                self.model_info.remove(model, version, provider)

    def requests_by_code(self) -> dict[str, int]:
        """Total ModelInfer answers per gRPC status code since start (for the exit summary)."""
        totals: dict[str, int] = {}
        for metric in self.requests.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    code = sample.labels["code"]
                    totals[code] = totals.get(code, 0) + int(sample.value)
        return totals
