"""Every instrument the model server exports, defined once.

Served as Prometheus text on --metrics-port. The OTLP export of the same instruments (the
telemetry issue) reads the same objects, so names, labels and buckets live only here.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Fine enough for a P99 of sub-millisecond calls and wide enough for multi-second ones. Between
# 1 ms and 100 ms, where SLAs live, neighbouring bounds are at most 15% apart, so a P99
# interpolated inside a bucket is within 15% of the truth; the control plane weights on it.
_LATENCY_BUCKETS_MS = (
    0.1, 0.125, 0.15, 0.175, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9,
    1, 1.15, 1.3, 1.5, 1.75, 2, 2.3, 2.6, 3, 3.5, 4, 4.5, 5, 5.75, 6.5, 7.5, 8.5,
    10, 11.5, 13, 15, 17.5, 20, 23, 26, 30, 35, 40, 45, 50, 57.5, 65, 75, 85,
    100, 125, 150, 200, 250, 300, 400, 500, 650, 800,
    1000, 1250, 1500, 2000, 2500, 3000, 4000, 5000, 6500, 8000, 10000,
)  # fmt: skip
LATENCY_BUCKETS_S = tuple(round(ms / 1000, 7) for ms in _LATENCY_BUCKETS_MS)
LOAD_BUCKETS_MS = (10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 120000)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
MODEL_STATES = ("INITIALIZING", "LOADING", "WARMING", "READY", "FAILED", "UNLOADING")


class ServerMetrics:
    """The model server's instruments, registered in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "inference_requests",
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
            "inference_request_duration_seconds",
            "ModelInfer time from receipt to answer (validation, queue, compute, encoding)",
            ["model", "version"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.queue_depth = Gauge(
            "inference_queue_depth",
            "Requests validated and waiting for an execution slot",
            ["model"],
            registry=r,
        )
        self.in_flight = Gauge(
            "inference_in_flight_requests",
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
            "model_state",
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
            "accelerator_memory_used_bytes",
            "Memory in use on the device (NVML) or by this process (CPU host)",
            ["device", "source"],
            registry=r,
        )
        self.memory_total = Gauge(
            "accelerator_memory_total_bytes",
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
            buckets=LATENCY_BUCKETS_S,
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
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "generation_time_per_output_token_seconds",
            "Mean time between a finished sequence's tokens after the first",
            ["model"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.generated_tokens = Counter(
            "generation_tokens", "Tokens generated (rate: tokens per second)", ["model"],
            registry=r,
        )  # fmt: skip
        self.sequences = Gauge(
            "generation_sequences", "Sequences generating (running) or waiting for KV blocks",
            ["model", "state"], registry=r,
        )  # fmt: skip
        self.kv_blocks_used = Gauge(
            "kv_cache_blocks_used",
            "KV-cache blocks in use (0 until generative models exist)",
            ["model"],
            registry=r,
        )
        self.kv_blocks_total = Gauge(
            "kv_cache_blocks_total",
            "KV-cache blocks allocated (0 until generative models exist)",
            ["model"],
            registry=r,
        )
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
        self.draining = Gauge("server_draining", "1 once the server has begun to drain", registry=r)
        self.label = Gauge(
            "server_label",
            "1 per routing label of the server (name, value): device_class and --label ones",
            ["name", "value"],
            registry=r,
        )

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
