"""Telemetry: what the servers and Envoy report, taken in, checked and kept.

The OTLP receiver (``receiver``, decoding in ``decode`` and its fast path ``otlp_wire``)
binds each report to its sender under ``telemetry.tls`` (``identity``) and writes it into the
store (``store``: sliding windows per endpoint, ``values`` for what it hands out, ``series``
for per-version statistics, ``readings`` for the raw readings). Shards (``shards``) run
receivers and stores in processes of their own and push what moved (``moved``). Triton members
are scraped (``scraper``, mapped by ``triton``), and Envoy's own stats are kept apart
(``envoy``). Routing, placement and the canaries read the store; nothing here decides.
"""

from control_plane.telemetry.envoy import EnvoyStats
from control_plane.telemetry.receiver import start_receiver
from control_plane.telemetry.scraper import MetricsScraper
from control_plane.telemetry.shards import TelemetryShards
from control_plane.telemetry.store import TelemetryStore
from control_plane.telemetry.values import EndpointTelemetry, VersionTelemetry

__all__ = [
    "EndpointTelemetry",
    "EnvoyStats",
    "MetricsScraper",
    "TelemetryShards",
    "TelemetryStore",
    "VersionTelemetry",
    "start_receiver",
]
