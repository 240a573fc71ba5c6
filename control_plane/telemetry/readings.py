"""What the control plane reads telemetry from: its own ``TelemetryStore`` (scraped Triton
endpoints, and every exporter when it receives OTLP itself) merged with its telemetry shards'
(``control_plane.telemetry.shards``), behind the store's read methods."""

from __future__ import annotations

from typing import Any

from control_plane.telemetry.series import VersionSeries, version_telemetry
from control_plane.telemetry.shards import TelemetryShards
from control_plane.telemetry.store import TelemetryStore
from control_plane.telemetry.values import EndpointTelemetry, VersionTelemetry, telemetry_document


class TelemetryReadings:
    def __init__(self, store: TelemetryStore, shards: TelemetryShards | None = None) -> None:
        self.store = store
        self.shards = shards

    def __len__(self) -> int:
        return len(self.store) + (len(self.shards) if self.shards is not None else 0)

    def snapshot(self, now: float, ages: bool = True) -> dict[str, EndpointTelemetry]:
        own = self.store.snapshot(now, ages)
        if self.shards is None:
            return own
        return {**self.shards.snapshot(now, ages), **own}

    def as_json(self, now: float, ages: bool = True) -> dict[str, Any]:
        """GET /telemetry's body (``ages``: see ``TelemetryStore.snapshot``)."""
        store = self.store
        return telemetry_document(
            self.snapshot(now, ages), store.window_s, store.stale_after_intervals
        )

    def take_placement_hints(self) -> set[str]:
        hints = self.store.take_placement_hints()
        return hints | self.shards.take_placement_hints() if self.shards is not None else hints

    def version_stats(
        self, model: str, now: float, since: float | None = None
    ) -> dict[str, VersionTelemetry]:
        """``TelemetryStore.version_stats`` over the store and every shard. An endpoint that
        moved between shards (it reconnected) counts once: where it last reported."""
        if self.shards is None:
            return self.store.version_stats(model, now, since)
        merged: VersionSeries = {}
        for found in (
            self.store.version_series(model, since),
            *self.shards.version_series(model, since),
        ):
            for endpoint, (last_seen, versions) in found.items():
                if endpoint not in merged or merged[endpoint][0] < last_seen:
                    merged[endpoint] = (last_seen, versions)
        parts = [versions for _, versions in merged.values()]
        return version_telemetry(parts, now, self.store.window_s)
