"""A model version's worker threads: blocking ONNX Runtime calls off the event loop, with as
little as possible between the loop and them.

One thread per instance (instance_group count). The loop hands a job over with one
``SimpleQueue.put`` and gets the outcome back with one ``call_soon_threadsafe``. The
``ThreadPoolExecutor`` this replaced did more on both sides of every hand-off: a work item and a
concurrent future per job, a lock and a Condition to set its result, its own callbacks, then
the post to the loop. Side by side its cost was within this host's noise (bench/README.md,
"The worker hand-off, and one batch ahead"); this is kept for being less code on both sides.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# A job's outcome, delivered on the event loop: its result, or the exception it raised.
Done = Callable[[Any], None]
# How the batcher has a job run: ``execute(job, done)`` (``Workers.submit``).
Execute = Callable[[Callable[[], Any], Done], None]


class WorkersStopped(RuntimeError):
    """A job handed to workers that were stopped (the version unloaded)."""


class Workers:
    """``count`` daemon threads taking jobs in order from one queue."""

    def __init__(self, count: int, name: str, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Done] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
            for i in range(count)
        ]
        self._stopped = False
        for thread in self._threads:
            thread.start()

    def submit(self, job: Callable[[], Any], done: Done) -> None:
        """Runs ``job`` on a worker, then ``done(result or exception)`` on the loop's thread.
        ``done`` is dropped when the loop has closed (the server stopped: nobody waits)."""
        if self._stopped:
            raise WorkersStopped("the model's workers have stopped")
        self._jobs.put((job, done))

    def run(self, job: Callable[[], T]) -> asyncio.Future[T]:
        """``job`` on a worker, as an awaitable. Cancelling the future does not stop a job that
        a worker has taken (nor one queued: the caller checks that itself); its outcome is
        dropped."""
        future: asyncio.Future[T] = self._loop.create_future()

        def settle(outcome: Any) -> None:
            if future.done():  # cancelled: the caller left
                return
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

        self.submit(job, settle)
        return future

    def stop(self) -> None:
        """Each thread ends after the jobs queued before this; new ones are refused."""
        if self._stopped:
            return
        self._stopped = True
        for _ in self._threads:
            self._jobs.put(None)

    def _work(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, done = item
            try:
                outcome = job()
            except BaseException as exc:  # handed to the loop, where the caller raises it
                outcome = exc
            with contextlib.suppress(RuntimeError):  # the loop is closed
                self._loop.call_soon_threadsafe(done, outcome)
            del item, job, done, outcome  # hold nothing while waiting for the next job
