"""Telemetry: what the servers and Envoy report, taken in, checked and kept.

The OTLP receiver (``receiver``, decoding in ``decode`` and its fast path ``otlp_wire``)
binds each report to its sender under ``telemetry.tls`` (``identity``) and writes it into the
store (``store``: sliding windows per endpoint, ``values`` for what it hands out, ``series``
for per-version statistics, ``readings`` for the raw readings). Shards (``shards``) run
receivers and stores in processes of their own and push what moved (``moved``). Triton members
are scraped (``scraper``, mapped by ``triton``), and Envoy's own stats are kept apart
(``envoy``). Routing, placement and the canaries read the store; nothing here decides.
"""

from control_plane.lazy import exports

__getattr__, __all__ = exports(
    __name__,
    {
        "EndpointTelemetry": "values",
        "EnvoyStats": "envoy",
        "MetricsScraper": "scraper",
        "TelemetryShards": "shards",
        "TelemetryStore": "store",
        "VersionTelemetry": "values",
        "start_receiver": "receiver",
    },
)
