"""Dynamic batching with Triton's semantics: priorities, queue delay, deadlines, a bounded queue.

A model version whose config.pbtxt has ``dynamic_batching`` (and ``max_batch_size > 0``) gets a
``DynamicBatcher``. Requests wait in one FIFO queue per priority level; a scheduler task on the
event loop forms a batch whenever an execution slot (instance) is free: the oldest request of the
highest priority first, then every compatible request (same inputs, same non-batch shapes and
types) in priority then arrival order, up to ``max_batch_size`` rows. A batch smaller than that
(and not a preferred size) waits for more until its oldest request has queued
``max_queue_delay``, idle model or not, as Triton does; the model parameter
``dynamic_batching_skip_delay_when_idle: "true"`` runs it at once when no batch is running.
Inputs are joined with one ``np.concatenate`` per input, run in one ONNX Runtime call on a
worker thread, and the outputs split back by rows.

A request whose deadline (the sooner of its gRPC deadline, its "timeout" parameter and the
queue policy's default timeout) passes while it is queued is answered DEADLINE_EXCEEDED and
never runs. A full queue (``max_queue_size``) answers RESOURCE_EXHAUSTED at once. A request
whose client cancels while queued leaves the queue.

With ``ahead`` (the model server passes 1), that many batches more than the instances may be
handed to the workers: while every instance runs, the next batch waits at the workers, and an
instance that finishes starts it at once instead of idling through a round trip to the event
loop (the worker posts its answer, the loop forms the next batch, hands it back). A batch
waiting there has left the queue: its requests no longer expire or give way to a higher
priority; the wait is at most one batch's run, and it counts as queue time (measured when the
batch starts).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from model_server.core.errors import InferenceError, InvalidInput
from model_server.core.model_config import BatchingPolicy
from model_server.scheduling.workers import Execute

RunBatch = Callable[[Mapping[str, np.ndarray], Sequence[str], int], list[np.ndarray]]


class QueueFull(InferenceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(InferenceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


@dataclass(eq=False)
class _Pending:
    feeds: Mapping[str, np.ndarray]
    outputs: tuple[str, ...]
    rows: int
    priority: int
    deadline: float | None  # monotonic seconds
    queued_at: float  # monotonic seconds
    future: asyncio.Future[list[np.ndarray]]

    @functools.cached_property
    def key(self) -> tuple[tuple[str, tuple[int, ...], str], ...]:
        """What a batch's requests share (input names, non-batch shapes, types); computed only
        when the request queues: one that runs at once is never compared."""
        return tuple(sorted((n, tuple(a.shape[1:]), a.dtype.str) for n, a in self.feeds.items()))


@dataclass
class BatchStats:
    """What the batcher did (the metrics count the same per model, see lifecycle)."""

    batches: int = 0
    rows: int = 0
    rejected_full: int = 0
    expired: int = 0


class DynamicBatcher:
    def __init__(
        self,
        policy: BatchingPolicy,
        run_batch: RunBatch,
        slots: int,
        execute: Execute,
        label: str = "model",
        clock: Callable[[], float] = time.monotonic,
        on_dequeue: Callable[[float], None] = lambda waited_s: None,
        ahead: int = 0,
    ) -> None:
        self.policy = policy
        self.label = label
        self._run_batch = run_batch  # blocking: joins nothing, runs one ONNX Runtime call
        # Runs a blocking callable on the version's worker threads and hands its outcome back
        # on the loop (workers.Workers.submit): the batch ends in that one loop step.
        self._execute = execute
        self._free_slots = slots + ahead  # batches that may be handed to the workers now
        self._slots = slots + ahead
        self._ahead = ahead
        self._clock = clock
        # Each request's time in the queue, as its batch starts (on the worker's thread).
        self._on_dequeue = on_dequeue
        self._queues: list[deque[_Pending]] = [deque() for _ in range(policy.priority_levels)]
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._wait_until = math.inf  # when the scheduler's current wait ends (inf: none)
        self.stats = BatchStats()

    @property
    def queued(self) -> int:
        return sum(len(q) for q in self._queues)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._schedule())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for queue in self._queues:
            while queue:
                pending = queue.popleft()
                if not pending.future.done():
                    pending.future.set_exception(
                        InferenceError(f"{self.label} is unloading", grpc.StatusCode.UNAVAILABLE)
                    )

    async def submit(
        self,
        feeds: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        rows: int,
        priority: int = 0,
        timeout_s: float | None = None,
        received_at: float | None = None,
    ) -> list[np.ndarray]:
        """Queues one request and waits for its outputs (in ``outputs`` order).

        Timeouts count from ``received_at`` (the server's clock when the call arrived) when
        given: under overload a call may wait in gRPC and the event loop before it gets here.
        """
        policy = self.policy
        if not 0 <= priority <= policy.priority_levels:
            raise InvalidInput(
                f"{self.label}: priority {priority} must be in 1..{policy.priority_levels} "
                "(0 for the default)"
            )
        if policy.max_queue_size and self.queued >= policy.max_queue_size:
            self.stats.rejected_full += 1
            raise QueueFull(
                f"{self.label}: queue full ({policy.max_queue_size} requests waiting); retry later"
            )
        now = self._clock()
        limits = [t for t in (timeout_s, policy.default_timeout_s or None) if t is not None]
        start = now if received_at is None else min(now, received_at)
        deadline = start + min(limits) if limits else None
        level = (priority or policy.default_priority) - 1
        future: asyncio.Future[list[np.ndarray]] = asyncio.get_running_loop().create_future()
        pending = _Pending(feeds, tuple(outputs), rows, level, deadline, now, future)
        if self._runs_at_once(rows, deadline, now):
            self._start([pending], rows)  # what the scheduler would do, without its pass
        else:
            self._enqueue(pending)
        try:
            return await future
        except asyncio.CancelledError:
            # A cancelled request still queued leaves the queue; one already running finishes.
            with contextlib.suppress(ValueError):
                self._queues[level].remove(pending)
            raise

    def _runs_at_once(self, rows: int, deadline: float | None, now: float) -> bool:
        """Whether a request arriving now would leave in the scheduler's next pass: nothing is
        queued, an instance is free and its batch of one may run (no delay to wait, a preferred
        or full size, or an idle model with skip_delay_when_idle). At c1 this is every request:
        starting it here saves the scheduler's pass (a task switch, an Event, a queue scan). A
        batch going ahead is left to the pass, which runs after the loop has taken in the other
        requests that arrived with this one, so they go ahead together."""
        policy = self.policy
        return (
            self._free_slots > self._ahead
            and not any(self._queues)
            and (deadline is None or deadline > now)
            and (
                policy.max_queue_delay_s <= 0
                or rows >= policy.max_batch_size
                or self._preferred(rows)
                or (policy.skip_delay_when_idle and self._free_slots == self._slots)
            )
        )

    def _enqueue(self, pending: _Pending) -> None:
        deadline = pending.deadline
        self._queues[pending.priority].append(pending)
        # The scheduler looks only when it could act: a slot is free, or this request's
        # deadline comes before the end of its current wait. Waking it for every arrival while
        # every instance is busy cost a scheduler pass (and a scan of the queue) per request,
        # which grew with the queue: at c64 the event loop is the bottleneck.
        if self._free_slots > 0 or (deadline is not None and deadline < self._wait_until):
            self._wake.set()

    # -- the scheduler ------------------------------------------------------------------------
    async def _schedule(self) -> None:
        while True:
            self._expire()
            self._wake.clear()  # nothing awaits between here and the wait: no lost wake-up
            if self._free_slots <= 0 or not any(self._queues):
                await self._wait(None)
                continue
            batch, rows, oldest = self._gather()
            remaining = self.policy.max_queue_delay_s - (self._clock() - oldest)
            # As Triton: a batch below max_batch_size and the preferred sizes waits for company
            # until its oldest request has queued max_queue_delay. With skip_delay_when_idle it
            # runs at once when no batch is running (waiting then only adds latency at low load).
            if (
                rows < self.policy.max_batch_size
                and remaining > 0
                and not self._preferred(rows)
                and not (self.policy.skip_delay_when_idle and self._free_slots == self._slots)
            ):
                await self._wait(remaining)  # for more requests, or the delay to run out
                continue
            self._dequeue(batch)
            self._start(batch, rows)

    def _start(self, batch: list[_Pending], rows: int) -> None:
        """Hands ``batch`` (already out of the queues) to the workers. No task: the worker
        posts ``_finish`` to the loop."""
        self._free_slots -= 1
        outputs = sorted({name for p in batch for name in p.outputs})
        try:
            feeds = (
                batch[0].feeds
                if len(batch) == 1
                else {
                    name: np.concatenate([p.feeds[name] for p in batch]) for name in batch[0].feeds
                }
            )

            def run() -> list[np.ndarray]:  # on a worker thread
                started = self._clock()
                for pending in batch:
                    self._on_dequeue(started - pending.queued_at)
                return self._run_batch(feeds, outputs, rows)

            self._execute(run, lambda outcome: self._finish(batch, outputs, rows, outcome))
        except Exception as exc:  # the inputs did not join, or the workers stopped
            self._finish(batch, outputs, rows, exc)

    def _finish(
        self,
        batch: list[_Pending],
        outputs: list[str],
        rows: int,
        results: list[np.ndarray] | BaseException,
    ) -> None:
        """Frees the instance and answers every request of the batch (a failure is shared)."""
        self._free_slots += 1
        if any(self._queues):  # with none queued the next arrival finds the free instance itself
            self._wake.set()
        if isinstance(results, BaseException):
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(results)
            return
        self.stats.batches += 1
        self.stats.rows += rows
        by_name = dict(zip(outputs, results, strict=True))
        start = 0
        for p in batch:
            if not p.future.done():
                p.future.set_result([by_name[n][start : start + p.rows] for n in p.outputs])
            start += p.rows

    async def _wait(self, limit_s: float | None) -> None:
        """Until something is queued or a slot frees (or ``limit_s``, or the next deadline)."""
        deadlines = [p.deadline for q in self._queues for p in q if p.deadline is not None]
        if deadlines:
            until = min(deadlines) - self._clock()
            limit_s = until if limit_s is None else min(limit_s, until)
        self._wait_until = math.inf if limit_s is None else self._clock() + limit_s
        # A timer that sets the wake event, not wait_for: wait_for wraps the wait in a task of
        # its own and raises TimeoutError, costs paid on every queue-delay wait.
        loop = asyncio.get_running_loop()
        timer = None if limit_s is None else loop.call_later(max(0.0, limit_s), self._wake.set)
        try:
            await self._wake.wait()
        finally:
            if timer is not None:
                timer.cancel()
            self._wait_until = math.inf  # not waiting: an arrival with a deadline wakes it

    def _dequeue(self, batch: list[_Pending]) -> None:
        """Takes ``batch`` out of the queues: usually the heads, popped; else one pass."""
        for level, queue in enumerate(self._queues):
            taken = [p for p in batch if p.priority == level]
            if not taken:
                continue
            if all(queue[i] is p for i, p in enumerate(taken)):
                for _ in taken:
                    queue.popleft()
            else:
                chosen = set(taken)
                self._queues[level] = deque(p for p in queue if p not in chosen)

    def _preferred(self, rows: int) -> bool:
        return rows in self.policy.preferred_batch_sizes

    def _expire(self) -> None:
        now = self._clock()
        for queue in self._queues:
            for pending in [p for p in queue if p.deadline is not None and p.deadline <= now]:
                queue.remove(pending)
                self.stats.expired += 1
                if not pending.future.done():
                    waited_ms = (now - pending.queued_at) * 1000
                    pending.future.set_exception(
                        DeadlineExceeded(
                            f"{self.label}: deadline passed after {waited_ms:.0f} ms in the queue; "
                            "the request did not run"
                        )
                    )

    def _gather(self) -> tuple[list[_Pending], int, float]:
        """The next batch: the head of the best non-empty level and what fits with it."""
        head = next((q[0] for q in self._queues if q), None)
        if head is None:
            return [], 0, 0.0
        batch, rows, limit = [], 0, self.policy.max_batch_size
        for queue in self._queues:
            for pending in queue:
                if pending.key == head.key and rows + pending.rows <= limit:
                    batch.append(pending)
                    rows += pending.rows
            if rows >= limit:
                break
        return batch, rows, min(p.queued_at for p in batch)
