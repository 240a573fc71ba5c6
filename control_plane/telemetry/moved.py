"""Whether an endpoint's telemetry moved enough to send it again (``telemetry.push_tolerance``).

A telemetry shard pushes the control plane every endpoint that reported, ten thousand a second
at fleet scale. Most of them report what they reported a second ago: a server at steady load
has the same rates, percentiles and memory within a percent. Receiving those (unpickling,
then making routing signals of each new object) was half of the control plane's own process
at 10,000 endpoints. So a shard sends an endpoint's telemetry again only when it moved: a
flag, a label, a model or the staleness changed, or a number moved by more than
``push_tolerance`` of the larger magnitude; otherwise it sends only that the endpoint reported
(a "touch", which keeps it fresh). ``push_tolerance`` is no more than any pool's
``recompute_tolerance``, so what is not sent is what routing would not act on anyway; and
every endpoint is sent whole at least every ``REFRESH_S``, so what GET /telemetry shows is
never older than that.

Ages are not compared: a touch brings them up to date on the control plane's side.
"""

from __future__ import annotations

import random

from control_plane.scoring.at_rest import near
from control_plane.telemetry.values import EndpointTelemetry, Flag, Signal

# An endpoint that reports is sent whole at least this often: what GET /telemetry shows is
# within push_tolerance of the newest, and never older than this. Each refresh comes after a
# random part of it, from half to all: a fleet that started together would otherwise be
# refreshed together, 10,000 endpoints in one push every REFRESH_S.
REFRESH_S = 15.0
# The observed reporting interval only sets when an endpoint turns stale (after a few of them):
# it moves with every late export (a loaded exporter's 1.0-1.7 s made every report "moved"),
# and matters only when it changes by a good part.
INTERVAL_TOLERANCE = 0.5
_SIGNALS = (
    "p50_ms",
    "p99_ms",
    "qps",
    "error_rate",
    "abandoned_rate",
    "queue_depth",
    "in_flight",
    "memory_used_bytes",
    "memory_total_bytes",
    "kv_blocks_used",
    "kv_blocks_total",
    "prefix_cache_hit_rate",
)
_EXACT = ("endpoint", "stale", "memory_source", "series", "dropped_series", "labels")


def telemetry_moved(before: EndpointTelemetry, after: EndpointTelemetry, tolerance: float) -> bool:
    """True when ``after`` differs from ``before`` in anything but ages and numbers within
    ``tolerance`` (relative). Written out as loops: a shard asks it of every report."""
    b, a = before.__dict__, after.__dict__
    for name in _EXACT:
        if b[name] != a[name]:
            return True
    if not near(before.interval_s, after.interval_s, max(tolerance, INTERVAL_TOLERANCE)):
        return True
    for name in _SIGNALS:
        if _moved(b[name], a[name], tolerance):
            return True
    if _flag(before.draining) != _flag(after.draining):
        return True
    if len(before.models) != len(after.models):
        return True
    for old, new in zip(before.models, after.models, strict=True):
        if old.model != new.model or _moved(old.p99_ms, new.p99_ms, tolerance):
            return True
        if _moved(old.qps, new.qps, tolerance) or _moved(old.error_rate, new.error_rate, tolerance):
            return True
        if _moved(old.abandoned_rate, new.abandoned_rate, tolerance):
            return True
    return False


def _moved(before: Signal | None, after: Signal | None, tolerance: float) -> bool:
    if before is None or after is None:
        return before is not after
    return not near(before[0], after[0], tolerance)


def _flag(flag: Flag | None) -> bool | None:
    return None if flag is None else flag.value


def split_moved(
    telemetry: dict[str, EndpointTelemetry],
    sent: dict[str, tuple[float, EndpointTelemetry]],
    now: float,
    tolerance: float,
    resend: frozenset[str] = frozenset(),
) -> tuple[dict[str, EndpointTelemetry], tuple[str, ...], bool]:
    """(the endpoints to send whole, the endpoints only touched, whether any is sent whole for
    more than its refresh: new, moved or asked for) of ``telemetry``, the endpoints that
    reported since the last push. ``sent`` (endpoint -> (when it is due again, what was last
    sent whole)) is updated; ``resend``: endpoints the control plane asked for whole (it could
    not apply a touch: it has the endpoint from another shard, or not at all)."""
    whole: dict[str, EndpointTelemetry] = {}
    touched = []
    moved = False
    for key, now_telemetry in telemetry.items():
        last = sent.get(key)
        if last is None or key in resend or telemetry_moved(last[1], now_telemetry, tolerance):
            moved = True
        elif now < last[0]:
            touched.append(key)
            continue
        whole[key] = now_telemetry
        sent[key] = (now + REFRESH_S * random.uniform(0.5, 1.0), now_telemetry)
    return whole, tuple(touched), moved
