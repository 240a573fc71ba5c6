"""What the live mesh view (GET /ui, fed by GET /events) shows: one frame a second.

``build_frame`` is pure: from the admin's status and the telemetry store's JSON it makes, per
model pool, a row per endpoint (state in words, weight, share of the pool's traffic, P99, QPS,
memory and KV-cache use, the reason for its weight), the version split and canary, plus the
recent decisions and the Envoy nodes. ``History`` keeps the last minutes of each row's P99,
QPS, weight and share, so a page that (re)connects draws its sparklines at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)
HISTORY_POINTS = 300  # five minutes at one frame a second
LIVE_VIEW_INTERVAL_S = 1.0  # a frame every second while a page is open
LIVE_VIEW_IDLE_INTERVAL_S = 10.0  # and this often while no page is open, at the least:
LIVE_VIEW_IDLE_S_PER_ENDPOINT = 0.005  # a frame's cost grows with the fleet (50 s at 10,000)
DECISIONS_SHOWN = 40
SPARK_FIELDS = ("p99_ms", "qps", "weight", "share")

# An endpoint's state, most telling first: the page shows it as a labelled badge.
UNREACHABLE, NOT_READY, EJECTED, DRAINING = "unreachable", "not ready", "ejected", "draining"
PROBATION, SLOW_START, SERVING = "probation", "slow start", "serving"


def _value(signal: Mapping[str, Any] | None) -> float | None:
    return None if not signal or signal.get("value") is None else float(signal["value"])


def endpoint_state(
    endpoint: Mapping[str, Any] | None, routing: Mapping[str, Any], draining: bool
) -> str:
    """The one word an operator needs: why this endpoint gets what it gets."""
    if endpoint is not None and not endpoint.get("reachable", False):
        return UNREACHABLE
    health = routing.get("health", "HEALTHY")
    override = (endpoint or {}).get("health_override")
    if draining or health == "DRAINING" or override == "DRAINING":
        return DRAINING
    if health != "HEALTHY" or override not in (None, "HEALTHY"):
        return EJECTED
    state = routing.get("state", "")
    if state == "probation":
        return PROBATION
    if state == "slow_start":
        return SLOW_START
    return SERVING


def _affinity(found: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The pool's affinity for its heading (None: mode none)."""
    if not found or found.get("mode", "none") == "none":
        return None
    return {k: found.get(k) for k in ("mode", "prefix_bytes", "session_header",
                                      "hash_balance_factor")}  # fmt: skip


def build_frame(
    status: Mapping[str, Any], telemetry: Mapping[str, Any], wall: float
) -> dict[str, Any]:
    """One frame of the live view (JSON-ready)."""
    endpoints = status.get("endpoints", {})
    signals = telemetry.get("endpoints", {})
    pools = []
    for pool, routing in sorted(status.get("routing", {}).items()):
        rows = []
        for key, route in sorted(routing.get("endpoints", {}).items()):
            tele = signals.get(key, {})
            models = tele.get("models", ())
            model: Mapping[str, Any] = next((m for m in models if m.get("model") == pool), {})
            rows.append(
                {
                    "endpoint": key,
                    "state": endpoint_state(
                        endpoints.get(key), route, bool(_value(tele.get("draining")))
                    ),
                    "weight": route.get("weight"),
                    "score": route.get("score"),
                    "reason": route.get("reason", ""),
                    "p99_ms": _value(model.get("p99_ms")) or _value(tele.get("p99_ms")),
                    "qps": _value(model.get("qps")),
                    "memory_used_bytes": _value(tele.get("memory_used_bytes")),
                    "memory_total_bytes": _value(tele.get("memory_total_bytes")),
                    "kv_blocks_used": _value(tele.get("kv_blocks_used")),
                    "kv_blocks_total": _value(tele.get("kv_blocks_total")),
                    "prefix_cache_hit_rate": _value(tele.get("prefix_cache_hit_rate")),
                    "stale": bool(tele.get("stale", True)),
                    "labels": (endpoints.get(key) or {}).get("labels") or {},
                }
            )
        total_qps = sum(r["qps"] or 0.0 for r in rows)
        for row in rows:
            row["share"] = (row["qps"] or 0.0) / total_qps if total_qps > 0 else None
        pools.append(
            {
                "model": pool,
                "fail_open": bool(routing.get("fail_open")),
                "version_split": status.get("version_splits", {}).get(pool) or {},
                "canary": status.get("canaries", {}).get(pool),
                "circuit": status.get("circuits", {}).get(pool),
                "affinity": _affinity(status.get("affinity", {}).get(pool)),
                "endpoints": rows,
            }
        )
    return {
        "at": round(wall, 3),
        "window_s": telemetry.get("window_s"),  # QPS, P99 and share are over this window
        "snapshot": status.get("snapshot"),
        "topology_error": status.get("topology", {}).get("error"),
        "warnings": status.get("warnings", []),
        "pools": pools,
        "decisions": timeline(status),
        "nodes": status.get("nodes", []),
    }


def timeline(status: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The routing decisions and every Envoy node's last NACK, oldest first, the newest kept."""
    events = list(status.get("decisions", ()))
    for node in status.get("nodes", ()):
        for kind, resource in node.get("types", {}).items():
            nack = resource.get("last_nack")
            if nack:
                text = f"{kind} version {nack.get('version')} NACKed: {nack.get('error')}"
                events.append({"at": nack.get("at", 0.0), "pool": node["node_id"],
                               "decision": text, "nack": True})  # fmt: skip
    events.sort(key=lambda event: event.get("at", 0.0))
    return events[-DECISIONS_SHOWN:]


# The most sparkline points a page's first event carries, over every endpoint together: at
# 1,000 endpoints x 300 points it was 27 MB of JSON and about a second of serialising with the
# GIL held (the control plane's loop stalled), repeated on every reconnect. A large fleet's
# lines start shorter and fill in from the frames that follow.
OPENING_POINTS = 30_000
OPENING_MIN_POINTS = 10  # every line gets at least this many


@dataclass
class History:
    """The last ``points`` values of each (pool, endpoint)'s sparkline fields, kept as tuples
    (``at`` then SPARK_FIELDS): a dict per point held three times the memory."""

    points: int = HISTORY_POINTS
    series: dict[tuple[str, str], collections.deque[tuple[Any, ...]]] = field(default_factory=dict)

    def add(self, frame: Mapping[str, Any]) -> None:
        seen = set()
        for pool in frame["pools"]:
            for row in pool["endpoints"]:
                key = (pool["model"], row["endpoint"])
                seen.add(key)
                line = self.series.setdefault(key, collections.deque(maxlen=self.points))
                line.append((frame["at"], *(row.get(f) for f in SPARK_FIELDS)))
        for gone in set(self.series) - seen:  # an endpoint that left: forget it
            del self.series[gone]

    def as_json(self) -> dict[str, dict[str, list[dict[str, Any]]]]:
        """Each line's newest points, within OPENING_POINTS over all of them."""
        each = max(OPENING_MIN_POINTS, OPENING_POINTS // max(1, len(self.series)))
        names = ("at", *SPARK_FIELDS)
        out: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for (pool, endpoint), line in sorted(self.series.items()):
            tail = itertools.islice(line, max(0, len(line) - each), None)
            out.setdefault(pool, {})[endpoint] = [dict(zip(names, p, strict=True)) for p in tail]
        return out


class LiveFeed:
    """The newest frame and the history, published from the event loop once a second and read
    by the admin's HTTP threads (one per open page): readers wait, nobody recomputes."""

    def __init__(self, points: int = HISTORY_POINTS) -> None:
        self.history = History(points)
        self.viewers = 0  # pages open now: frames every second only while there are some
        self._frame: dict[str, Any] | None = None
        self._sequence = 0
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Counts one open page for as long as the block runs."""
        with self._changed:
            self.viewers += 1
        try:
            yield
        finally:
            with self._changed:
                self.viewers -= 1

    async def publish_forever(
        self, frame: Callable[[], Awaitable[dict[str, Any]]], fleet_size: Callable[[], int]
    ) -> None:
        """A frame every second while a page is open, and every LIVE_VIEW_IDLE_INTERVAL_S
        otherwise: the history a page draws first stays, and a fleet nobody watches does not
        pay a frame a second (measured at 11-20% of the control plane's time at 1,000
        endpoints). The idle interval grows with the fleet: at 10,000 endpoints (py-spy, this
        2-core host) a frame every 10 s took a quarter of its time."""
        last = -math.inf
        while True:
            now = time.monotonic()
            idle_s = max(LIVE_VIEW_IDLE_INTERVAL_S, LIVE_VIEW_IDLE_S_PER_ENDPOINT * fleet_size())
            if self.viewers or now - last >= idle_s:
                last = now
                try:
                    self.publish(await frame())
                except Exception:  # a view must never take the control plane down
                    log.exception("live view frame failed")
            await asyncio.sleep(LIVE_VIEW_INTERVAL_S)

    def publish(self, frame: dict[str, Any]) -> None:
        with self._changed:
            self.history.add(frame)
            self._frame = frame
            self._sequence += 1
            self._changed.notify_all()

    def opening(self) -> tuple[int, dict[str, Any]]:
        """What a page gets first: the history and the newest frame, with its sequence."""
        with self._changed:
            return self._sequence, {"history": self.history.as_json(), "frame": self._frame}

    def next_frame(self, after: int, timeout: float) -> tuple[int, dict[str, Any] | None]:
        """The first frame newer than sequence ``after`` (None if none came within timeout)."""
        with self._changed:
            self._changed.wait_for(lambda: self._sequence > after, timeout)
            if self._sequence > after:
                return self._sequence, self._frame
            return after, None
