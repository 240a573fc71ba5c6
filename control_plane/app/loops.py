"""The control plane's loops, supervised: each subsystem owns its loop (the poller, discovery,
the canaries, the circuits, the live view, routing), and the composition root only starts
them here. A loop whose iteration raises is logged, counted in
``control_loop_failures_total{loop}`` and started again, so a bug in one tick never silently
stops routing; ``stop`` cancels exactly the loops this supervisor started."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
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
                    return
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


async def ticks_or_wakes(
    wake: asyncio.Event, interval: float, min_gap: float, run: Callable[[], Awaitable[None]]
) -> None:
    """Runs ``run`` ``interval`` after the last run ended, or once ``wake`` is set but no
    sooner than ``min_gap`` after it (routing: at rest nothing moves and the tick is all
    there is; a change waits for the gap, not for the tick). Forever."""
    loop = asyncio.get_running_loop()
    while True:
        ended = loop.time()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), interval)
        await asyncio.sleep(max(0.0, ended + min_gap - loop.time()))
        wake.clear()
        await run()
