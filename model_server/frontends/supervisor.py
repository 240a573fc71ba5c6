"""The engine keeps its front ends running: it starts them, restarts one that exits (after a
short pause that grows while it keeps failing), and stops them all at the end of a drain,
before its own private channel closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("model_server.frontends")

RESTART_PAUSE_S = (0.2, 0.5, 1.0, 2.0, 5.0)  # after the 1st, 2nd... quick failure in a row
STEADY_S = 10.0  # a front end that ran this long before exiting starts the count again
STOP_TIMEOUT_S = 5.0
# How the engine (and the kernel, when the engine dies) stops a front end. Not SIGTERM: a
# SIGTERM to the process group must leave the front ends serving while the engine drains.
STOP_SIGNAL = signal.SIGUSR2


@dataclass(frozen=True)
class FrontendProcess:
    index: int
    pid: int


class Supervisor:
    """Runs ``count`` front ends, each from ``command(index)``."""

    def __init__(
        self,
        count: int,
        command: Callable[[int], list[str]],
        on_restart: Callable[[int], None] = lambda index: None,
    ) -> None:
        self.count = count
        self.command = command
        self.on_restart = on_restart
        self.stopping = False
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self._ready: dict[int, asyncio.Event] = {i: asyncio.Event() for i in range(count)}
        self._tasks: list[asyncio.Task[None]] = []

    def running(self) -> list[FrontendProcess]:
        return [
            FrontendProcess(index, proc.pid)
            for index, proc in sorted(self.procs.items())
            if proc.returncode is None
        ]

    def pids(self) -> list[int]:
        return [each.pid for each in self.running()]

    def on_ready(self, index: int, pid: int) -> None:
        proc = self.procs.get(index)
        if proc is not None and proc.pid == pid:
            self._ready[index].set()

    async def start(self, timeout_s: float) -> None:
        """Starts every front end; returns once each listens (TimeoutError otherwise)."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._keep(index)) for index in range(self.count)]
        waits = [event.wait() for event in self._ready.values()]
        await asyncio.wait_for(asyncio.gather(*waits), timeout_s)

    async def _spawn(self, index: int) -> asyncio.subprocess.Process:
        self._ready[index].clear()
        proc = await asyncio.create_subprocess_exec(
            *self.command(index), stdin=asyncio.subprocess.DEVNULL
        )
        self.procs[index] = proc
        return proc

    async def _keep(self, index: int) -> None:
        failures = 0
        while not self.stopping:
            started = time.monotonic()
            try:
                proc = await self._spawn(index)
            except OSError as exc:  # fork or exec failed (memory, process limits): try again
                failures += 1
                pause = _restart_pause(failures)
                log.error("front end %d could not start (%s); retrying in %.1fs", index, exc,
                          pause)  # fmt: skip
                await asyncio.sleep(pause)
                continue
            code = await proc.wait()
            if self.stopping:
                return
            failures = 0 if time.monotonic() - started > STEADY_S else failures + 1
            pause = _restart_pause(failures)
            log.warning("front end %d (pid %d) exited with %s; restarting in %.1fs", index,
                        proc.pid, _exit_text(code), pause)  # fmt: skip
            self.on_restart(index)
            await asyncio.sleep(pause)

    async def stop(self) -> None:
        """STOP_SIGNAL to every front end; SIGKILL to any still running after STOP_TIMEOUT_S."""
        self.stopping = True
        running = [proc for proc in self.procs.values() if proc.returncode is None]
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(STOP_SIGNAL)
        if running:
            _, late = await asyncio.wait(
                [asyncio.ensure_future(proc.wait()) for proc in running], timeout=STOP_TIMEOUT_S
            )
            for proc in running:
                if proc.returncode is None:
                    log.warning("front end pid %d still running; killing it", proc.pid)
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
            if late:
                await asyncio.wait(late, timeout=STOP_TIMEOUT_S)
        for task in self._tasks:
            task.cancel()
        log.info("front ends stopped: %s", ", ".join(
            f"{index}={_exit_text(proc.returncode)}" for index, proc in sorted(self.procs.items())
        ))  # fmt: skip


def _restart_pause(failures: int) -> float:
    """The pause before the next start after ``failures`` quick failures in a row (0: none)."""
    return RESTART_PAUSE_S[min(failures, len(RESTART_PAUSE_S)) - 1] if failures else 0.0


def _exit_text(code: int | None) -> str:
    if code is None:
        return "no exit yet"
    if code < 0:
        return signal.Signals(-code).name
    return f"code {code}"


def frontend_command(arguments: list[str]) -> list[str]:
    """The front-end module run by this interpreter, with ``arguments`` and its parent: this
    process (the kernel signals the front end when it dies)."""
    return [sys.executable, "-m", "model_server.frontends", "--parent", str(os.getpid()),
            *arguments]  # fmt: skip
