"""What the server says about itself: ``metrics`` (the Prometheus registry, with names from
``infermesh.wire``), ``telemetry`` (the same instruments exported over OTLP to every control
plane, over mutual TLS as the server) and ``tracing`` (an OpenTelemetry span per request).
"""
