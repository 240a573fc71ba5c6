"""One model version's life: INITIALIZING -> LOADING -> WARMING -> READY (or FAILED) -> UNLOADING.

Loading and warm-up run in a worker thread, never on the event loop. Inference runs through a
fixed number of execution slots (the instance_group count), each a worker thread
(scheduling.workers); requests waiting for a slot are the queue. Unloading waits for the
requests in flight.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2

from model_server.core.errors import ModelUnavailable
from model_server.core.memory import MemoryGuard, estimate_model_bytes, process_rss
from model_server.core.model_config import (
    ModelSpec,
    batching_policy,
    complete_spec,
    instance_count,
)
from model_server.core.runtime import DeviceChoice, OnnxSession
from model_server.generative.engine import GenerationEngine
from model_server.generative.text import (
    build_engine,
    engine_settings,
    generation_observer,
    is_decoder,
    publish_engine,
    special_ids,
    text_spec,
)
from model_server.lifecycle.warmup import warmup_inputs
from model_server.observability.metrics import ServerMetrics
from model_server.scheduling.batching import DynamicBatcher
from model_server.scheduling.schedulers import (
    BatchingScheduler,
    DirectScheduler,
    GenerationScheduler,
    Scheduler,
)
from model_server.scheduling.workers import Workers

log = logging.getLogger(__name__)


class ModelState(enum.StrEnum):
    INITIALIZING = "INITIALIZING"
    LOADING = "LOADING"
    WARMING = "WARMING"
    READY = "READY"
    FAILED = "FAILED"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"  # unloaded, or present on disk and never loaded


@dataclass
class DurationStat:
    count: int = 0
    ns: int = 0

    def add(self, ns: int) -> None:
        self.count += 1
        self.ns += ns


@dataclass
class VersionStats:
    """Counters behind ModelStatistics (Triton's semantics)."""

    success: DurationStat = field(default_factory=DurationStat)
    fail: DurationStat = field(default_factory=DurationStat)
    queue: DurationStat = field(default_factory=DurationStat)
    compute_input: DurationStat = field(default_factory=DurationStat)
    compute_infer: DurationStat = field(default_factory=DurationStat)
    compute_output: DurationStat = field(default_factory=DurationStat)
    inference_count: int = 0  # samples (batch elements)
    execution_count: int = 0  # model executions
    last_inference_ms: int = 0


@dataclass(slots=True)
class _DirectCall:
    """One request of a model without batching, from the loop to a worker."""

    queued_ns: int  # time.monotonic_ns() as it was handed to the workers
    left: bool = False  # its client left before a worker took it


class ModelVersion:
    """A loadable, servable version of a model. Owned by the repository; not thread-safe."""

    def __init__(
        self,
        name: str,
        version: int,
        path: Path,
        declared: model_config_pb2.ModelConfig,
        fingerprint: str,
        device: DeviceChoice,
        metrics: ServerMetrics,
        on_state_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.name = name
        self.version = version
        self.path = path
        self.declared = declared
        self.fingerprint = fingerprint
        self.device = device
        self.metrics = metrics
        self.on_state_change = on_state_change  # the repository republishes what clients see
        self.state = ModelState.INITIALIZING
        self.reason = ""
        self.spec: ModelSpec | None = None
        self.session: OnnxSession | None = None  # the first instance (metadata, provider)
        self._instances: queue.SimpleQueue[OnnxSession] = queue.SimpleQueue()  # free ones
        self.stats = VersionStats()
        self.memory_bytes = 0
        self.load_ms = 0.0
        self.slots_total = instance_count(declared)
        self._workers: Workers | None = None  # a thread per instance, from load to unload
        # How requests run, chosen once at load (scheduling.py): None until READY.
        self.scheduler: Scheduler[Any] | None = None
        self._stats_lock = threading.Lock()
        self._submitted = 0  # changed on the event loop
        self._started = 0  # changed by worker threads, under _stats_lock
        self.in_flight = 0
        # Labelled children looked up once: labels() costs a lock and a tuple per call.
        self._request_counters: dict[str, Any] = {}
        self.duration_metric = metrics.request_duration.labels(name, str(version))
        self._queue_metric = metrics.queue_duration.labels(name)
        self._executed_metric = metrics.executed_batch_size.labels(name)
        self._idle = asyncio.Event()
        self._idle.set()
        self._set_state(ModelState.INITIALIZING)

    @property
    def label(self) -> str:
        return f"model {self.name!r} version {self.version}"

    def _set_state(self, state: ModelState, reason: str = "") -> None:
        self.state = state
        self.reason = reason
        self.on_state_change()
        level = logging.ERROR if state is ModelState.FAILED else logging.INFO
        log.log(level, "%s: %s%s", self.label, state.value, f" ({reason})" if reason else "")

    async def load(self, guard: MemoryGuard) -> None:
        """Loads and warms the version; on any error it ends FAILED with the reason."""
        started = time.monotonic()
        self._set_state(ModelState.LOADING)
        expected = 0
        try:
            expected = estimate_model_bytes(self.path) * self.slots_total  # a session each
            guard.reserve(self.label, expected)
            before = process_rss()
            loop = asyncio.get_running_loop()
            self._workers = Workers(self.slots_total, f"{self.name}-v{self.version}", loop)
            await self._workers.run(self._open_session)
            self.memory_bytes = max(0, process_rss() - before)
            self._set_state(ModelState.WARMING)
            await self._workers.run(self._warm_up)
        except Exception as exc:
            self._close()
            self._set_state(ModelState.FAILED, f"{type(exc).__name__}: {exc}")
            return
        finally:
            guard.release(expected)
        self.load_ms = (time.monotonic() - started) * 1000
        self.metrics.model_load_time.labels(self.name).observe(self.load_ms)
        assert self.session is not None and self.spec is not None
        self.scheduler = self._scheduler()
        self.scheduler.start()
        if isinstance(self.scheduler, GenerationScheduler):
            publish_engine(self.metrics, self.name, self.scheduler.engine)
        self._set_state(ModelState.READY, f"on {self.session.provider}")

    def _scheduler(self) -> Scheduler[Any]:
        """The one place a version's way of running requests is chosen: a decoder (Optimum's
        names) generates; config.pbtxt's dynamic_batching batches; the rest run directly."""
        assert self.session is not None and self.spec is not None and self._workers is not None
        session, workers = self.session, self._workers
        if is_decoder(session.inputs, session.outputs):
            engine = build_engine(
                session.inputs, [o.name for o in session.outputs], session.run, self.declared,
                workers.run, generation_observer(self.metrics, self.name),
            )  # fmt: skip
            return GenerationScheduler(
                engine, self.name, self.version, special_ids(self.declared)[0]
            )
        policy = batching_policy(self.spec.config)
        if policy is not None:
            batcher = DynamicBatcher(
                policy, self._run_batch, self.slots_total, workers.submit, label=self.label,
                on_dequeue=self._dequeued, ahead=1,
            )  # fmt: skip
            refused = self.metrics.rejections
            return BatchingScheduler(
                self.spec, self.version, batcher, lambda why: refused.labels(self.name, why).inc()
            )
        return DirectScheduler(self.spec, self.version, self.execute_direct)

    @property
    def engine(self) -> GenerationEngine | None:
        """The generation engine, for a generative version that is loaded."""
        scheduler = self.scheduler
        return scheduler.engine if isinstance(scheduler, GenerationScheduler) else None

    def _open_session(self) -> None:
        parameters = {k: v.string_value for k, v in self.declared.parameters.items()}
        # One session per instance (instance_group count), each with its own worker thread
        # and memory arena: concurrent runs never share a session's scratch buffers.
        first = OnnxSession(self.path, self.device, parameters)
        if is_decoder(first.inputs, first.outputs):  # generative: text in, tokens out
            engine_settings(self.declared)  # a bad parameter fails the load, named
            self.spec = text_spec(self.declared)
            sessions = [first]  # one engine steps every sequence together
        else:
            sessions = [first] + [
                OnnxSession(self.path, self.device, parameters) for _ in range(self.slots_total - 1)
            ]
            self.spec = complete_spec(self.declared, first.inputs, first.outputs)
        for session in sessions:
            self._instances.put(session)
        self.session = sessions[0]

    def _warm_up(self) -> None:
        assert self.session is not None and self.spec is not None
        if is_decoder(self.session.inputs, self.session.outputs):
            return  # its first prefill is its warm-up
        outputs = [o.name for o in self.spec.outputs]
        for _ in range(self.slots_total):  # every instance, in turn
            for feeds, count in warmup_inputs(self.spec, self.path.parent.parent):
                for _ in range(count):
                    self._compute(outputs, feeds, 0, count=False)

    async def execute_direct(
        self, outputs: Sequence[str], feeds: Mapping[str, np.ndarray], batch: int
    ) -> list[np.ndarray]:
        """Runs one request on the version's worker threads (the instance_group count).

        Requests beyond the slots wait in the workers' queue: that wait is the queue depth,
        and a request whose client cancels while it waits never runs.
        """
        workers = self._workers
        if self.session is None or workers is None:
            raise ModelUnavailable(f"{self.label} is {self.state.value}")
        call = _DirectCall(time.monotonic_ns())
        self._submitted += 1
        try:
            return await workers.run(lambda: self._run(outputs, feeds, batch, call))
        except asyncio.CancelledError:
            call.left = True  # a worker that takes it after this skips it
            raise

    def _run(
        self,
        outputs: Sequence[str],
        feeds: Mapping[str, np.ndarray],
        batch: int,
        call: _DirectCall,
    ) -> list[np.ndarray]:
        """In a worker thread: the request leaves the queue, runs, and is counted; one whose
        client left while it waited does not run (nobody awaits its outcome)."""
        with self._stats_lock:
            self._started += 1
        if call.left:
            return []
        self._dequeued((time.monotonic_ns() - call.queued_ns) / 1e9)
        return self._compute(outputs, feeds, batch)

    def _run_batch(
        self, feeds: Mapping[str, np.ndarray], outputs: Sequence[str], rows: int
    ) -> list[np.ndarray]:
        """In a worker thread: one dynamic batch (the batcher joined the inputs)."""
        if self.session is None:
            raise ModelUnavailable(f"{self.label} is {self.state.value}")
        return self._compute(outputs, feeds, rows)

    def _dequeued(self, waited_s: float) -> None:
        with self._stats_lock:
            self.stats.queue.add(int(waited_s * 1e9))
        self._queue_metric.observe(waited_s)

    def _compute(
        self,
        outputs: Sequence[str],
        feeds: Mapping[str, np.ndarray],
        rows: int,
        count: bool = True,
    ) -> list[np.ndarray]:
        """On a worker thread, with a free instance (there are as many as worker threads)."""
        session = self._instances.get(timeout=60)
        try:
            started = time.monotonic_ns()
            result = session.run(outputs, feeds)
            finished = time.monotonic_ns()
        finally:
            self._instances.put(session)
        if not count:  # warm-up
            return result
        with self._stats_lock:
            self.stats.compute_infer.add(finished - started)
            self.stats.execution_count += 1
            self.stats.inference_count += rows
            self.stats.last_inference_ms = time.time_ns() // 1_000_000
        self._executed_metric.observe(rows)
        return result

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet started by a worker, or queued in the scheduler."""
        queued = self.scheduler.queued if self.scheduler is not None else 0
        return self._submitted - self._started + queued

    def request_counter(self, code: str) -> Any:
        """The inference_requests_total child for this version and ``code`` (cached)."""
        counter = self._request_counters.get(code)
        if counter is None:
            counter = self.metrics.requests.labels(self.name, str(self.version), code)
            self._request_counters[code] = counter
        return counter

    def begin_request(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def end_request(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def unload(self) -> None:
        """Stops taking work (the repository already routes elsewhere), waits, frees."""
        if self.state is ModelState.READY:
            self._set_state(ModelState.UNLOADING)
        await self._idle.wait()
        if self.scheduler is not None:
            await self.scheduler.stop()
            if isinstance(self.scheduler, GenerationScheduler):
                publish_engine(self.metrics, self.name, None)
        self._close()
        self._set_state(ModelState.UNAVAILABLE, "unloaded")

    def _close(self) -> None:
        self.session = None
        self._instances = queue.SimpleQueue()
        self.scheduler = None
        if self._workers is not None:
            self._workers.stop()
            self._workers = None
