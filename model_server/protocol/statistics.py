"""Triton's ModelStatistics answer from a loaded version's counters."""

from __future__ import annotations

from tritonclient.grpc import service_pb2

from model_server.lifecycle.version import DurationStat, ModelVersion


def _duration(target: service_pb2.StatisticDuration, source: DurationStat) -> None:
    target.count = source.count
    target.ns = source.ns


def add_statistics(response: service_pb2.ModelStatisticsResponse, v: ModelVersion) -> None:
    stats = response.model_stats.add(
        name=v.name,
        version=str(v.version),
        last_inference=v.stats.last_inference_ms,
        inference_count=v.stats.inference_count,
        execution_count=v.stats.execution_count,
    )
    inference = stats.inference_stats
    for field in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
        _duration(getattr(inference, field), getattr(v.stats, field))
    if v.memory_bytes:
        stats.memory_usage.add(
            type="CPU" if v.device.kind == "cpu" else "GPU",
            id=v.device.index,
            byte_size=v.memory_bytes,
        )
