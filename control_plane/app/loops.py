"""The control plane's loops, supervised: each subsystem owns its loop (the poller, discovery,
the canaries, the circuits, the live view, routing), and the composition root only starts
them here. A loop whose iteration raises is logged, counted in
``control_loop_failures_total{loop}`` and started again, so a bug in one tick never silently
stops routing; ``stop`` cancels exactly the loops this supervisor started."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from control_plane.metrics import ControlPlaneMetrics

log = logging.getLogger("control_plane")
LOOP_RESTART_DELAY_S = 1.0  # a loop that raised starts again after this


class Loops:
    def __init__(self, metrics: ControlPlaneMetrics) -> None:
        self.metrics = metrics
        self.tasks: set[asyncio.Task[None]] = set()

    def spawn(self, name: str, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Runs ``run`` until it returns, restarting it (after LOOP_RESTART_DELAY_S) each
        time it raises."""

        async def supervised() -> None:
            while True:
                try:
                    await run()
                    log.warning("%s returned; it is not restarted", name)
                    return
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        raise  # stop(): this loop's own cancellation
                    # Something the loop awaited was cancelled under it (a channel closed):
                    # a failure like any other, not the end of the loop.
                    log.exception("%s was cancelled from below; restarting it", name)
                    self.metrics.loop_failures.labels(name).inc()
                    await asyncio.sleep(LOOP_RESTART_DELAY_S)
                except Exception:
                    log.exception("%s failed; restarting it", name)
                    self.metrics.loop_failures.labels(name).inc()
                    await asyncio.sleep(LOOP_RESTART_DELAY_S)

        task = asyncio.get_running_loop().create_task(supervised(), name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def stop(self) -> None:
        for task in list(self.tasks):
            task.cancel()
