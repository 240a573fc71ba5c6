"""The one place a new snapshot is made, with the requests for one coalesced.

Many things ask for a rebuild: placement changed, the router moved weights, a canary stepped,
a circuit opened, the topology or the endpoints changed, an operator overrode something. Each
asks ``request(reason)``; the rebuild runs once, at the event loop's next turn, for every
request made before it, and its reason lists them all. An operator's change asks ``now``,
which serves the pending requests too and says at once whether Envoy's snapshot changed.

The rebuild itself: the mesh state from the plane's inputs, the snapshot from the mesh state
(only the resources whose inputs changed are re-made), the cache set (a new version only when
something changed), and what it did kept for ``/status`` (``last``) and the metrics. A build
that fails (a bug) keeps the last good snapshot and says so in ``last``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from control_plane.metrics import ControlPlaneMetrics
from control_plane.model.mesh import MeshState
from control_plane.xds.incremental import SnapshotBuilder
from control_plane.xds.snapshot import InconsistentSnapshot, SnapshotCache

log = logging.getLogger(__name__)


class Rebuilder:
    def __init__(
        self,
        mesh_state: Callable[[], MeshState],
        builder: SnapshotBuilder,
        cache: SnapshotCache,
        metrics: ControlPlaneMetrics,
    ) -> None:
        self._mesh_state = mesh_state  # the plane's inputs, read when the rebuild runs
        self.builder = builder
        self.cache = cache
        self.metrics = metrics
        self.state: MeshState | None = None  # what the current snapshot was built from
        self.last: dict[str, Any] = {}  # the last rebuild, for /status
        self.requests = 0  # every request, served or pending
        self.rebuilds = 0
        self._reasons: list[str] = []
        self._pending: asyncio.Handle | None = None

    def request(self, reason: str) -> None:
        """A rebuild at the event loop's next turn, shared with every request before it."""
        self.requests += 1
        self._reasons.append(reason)
        if self._pending is None:
            self._pending = asyncio.get_running_loop().call_soon(self._run)

    def now(self, reason: str) -> bool:
        """A rebuild now, serving the pending requests too: whether the snapshot changed."""
        self.requests += 1
        self._reasons.append(reason)
        return self._run()

    def _run(self) -> bool:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        reasons, self._reasons = self._reasons, []
        if not reasons:
            return False
        self.rebuilds += 1
        self.metrics.rebuild_requests.inc(len(reasons))
        return self._build("; ".join(dict.fromkeys(reasons)), len(reasons))

    def _build(self, reason: str, served: int) -> bool:
        started = time.perf_counter()
        state = self._mesh_state()
        try:
            snapshot = self.builder.build(state)
        except Exception as exc:  # a bug, not an operator error: keep the last good snapshot
            log.error("snapshot not set (%s): %s: %s", reason, type(exc).__name__, exc,
                      exc_info=not isinstance(exc, InconsistentSnapshot))  # fmt: skip
            self.last = {
                "reason": reason,
                "requests": served,
                "at": round(time.time(), 3),
                "failed": f"{type(exc).__name__}: {exc}"[:300],
                "kept": "the last good snapshot; Envoy keeps what it had",
            }
            return False
        changed = self.cache.set_snapshot(snapshot)
        elapsed = time.perf_counter() - started
        self.metrics.snapshot_build.observe(elapsed)
        self.last = {
            "reason": reason,
            "requests": served,  # the requests this rebuild served (coalesced)
            "at": round(time.time(), 3),
            "build_ms": round(elapsed * 1000, 3),
            "changed": changed,
            "resources_made": self.builder.made,
            "resources_reused": self.builder.reused,
        }
        if changed:
            self.metrics.snapshots.inc()
            self.metrics.publish_assignments(state.clusters)
            log.info("snapshot set (%s): %s", reason, snapshot.versions())
        self.state = state
        return changed
