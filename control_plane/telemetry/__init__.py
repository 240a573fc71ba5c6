"""Telemetry: what the servers and Envoy report, taken in, checked and kept.

The OTLP receiver (``receiver``, decoding in ``decode`` and its fast path ``otlp_wire``)
binds each report to its sender under ``telemetry.tls`` (``identity``) and writes it into the
store (``store``: sliding windows per endpoint, ``values`` for what it hands out, ``series``
for per-version statistics, ``readings`` for the raw readings). Shards (``shards``) run
receivers and stores in processes of their own and push what moved (``moved``). Triton members
are scraped (``scraper``, mapped by ``triton``), and Envoy's own stats are kept apart
(``envoy``). Routing, placement and the canaries read the store; nothing here decides.
"""

from __future__ import annotations

import importlib
from typing import Any

# Loaded when first asked for, so importing one module of the package (``values``, say, in a
# decoder process) does not load the receiver's gRPC server and the shards with it.
_PUBLIC = {
    "EndpointTelemetry": "values",
    "EnvoyStats": "envoy",
    "MetricsScraper": "scraper",
    "TelemetryShards": "shards",
    "TelemetryStore": "store",
    "VersionTelemetry": "values",
    "start_receiver": "receiver",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
