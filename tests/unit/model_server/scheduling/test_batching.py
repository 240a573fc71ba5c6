"""The dynamic batcher: joining, splitting, priorities, deadlines, a bounded queue."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2, service_pb2

from model_server.core.errors import InvalidInput
from model_server.core.model_config import (
    SKIP_DELAY_WHEN_IDLE,
    BatchingPolicy,
    batching_errors,
    batching_policy,
)
from model_server.core.validation import request_scheduling
from model_server.scheduling.batching import DeadlineExceeded, DynamicBatcher, QueueFull
from model_server.scheduling.workers import Workers

WEIGHTS = np.arange(12, dtype=np.float32).reshape(4, 3)


class Model:
    """y = x @ W and s = sum(x): records each call's rows; ``gate`` holds calls until set."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.order: list[float] = []  # the first value of each call's first row
        self.entered = 0  # calls that reached the model (held or not)
        self.hold = {0.0}  # calls whose first value is one of these wait for the gate
        self.gate = threading.Event()
        self.gate.set()

    def run(
        self, feeds: Mapping[str, np.ndarray], outputs: Sequence[str], rows: int
    ) -> list[np.ndarray]:
        self.entered += 1
        x = feeds["x"]
        if float(x[0, 0]) in self.hold:
            self.gate.wait(10)
        assert x.shape[0] == rows
        self.calls.append(rows)
        self.order.append(float(x[0, 0]))
        computed = {"y": lambda: x @ WEIGHTS, "s": lambda: x.sum(axis=1, keepdims=True)}
        return [computed[name]() for name in outputs]


class Clock:
    """A monotonic clock that moves only when told: queue delays without real waiting."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def batcher(
    model: Model,
    slots: int = 1,
    clock: Clock | None = None,
    ahead: int = 0,
    on_dequeue: Any = lambda waited_s: None,
    **policy: Any,
) -> tuple[DynamicBatcher, Workers]:
    pool = Workers(slots, "test", asyncio.get_running_loop())
    settings = {"max_batch_size": 8, **policy}
    b = DynamicBatcher(
        BatchingPolicy(**settings), model.run, slots, pool.submit, clock=clock or time.monotonic,
        on_dequeue=on_dequeue, ahead=ahead,
    )  # fmt: skip
    b.start()
    return b, pool


async def occupy(b: DynamicBatcher, model: Model) -> asyncio.Task[list[np.ndarray]]:
    """Holds the only slot with a request of value 0 until ``model.gate`` is set."""
    model.gate.clear()
    before = model.entered
    blocker = asyncio.create_task(b.submit(sample(0), ["s"], 1))
    await until(lambda: model.entered == before + 1, "the blocker to start")
    return blocker


def sample(value: float, rows: int = 1, width: int = 4) -> dict[str, np.ndarray]:
    return {"x": np.full((rows, width), value, dtype=np.float32)}


async def until(condition: Any, what: str, limit_s: float = 5.0) -> None:
    """Polls ``condition`` (state changed by worker threads) until true, within ``limit_s``."""
    async with asyncio.timeout(limit_s):
        while not condition():  # noqa: ASYNC110 (worker threads change it: no event to await)
            await asyncio.sleep(0.005)


async def test_concurrent_requests_run_as_fewer_calls_with_the_same_results() -> None:
    model = Model()
    b, pool = batcher(model)
    model.gate.clear()  # the first request occupies the only slot; the rest queue
    first = asyncio.create_task(b.submit(sample(0), ["y"], 1))
    await until(lambda: model.entered == 1, "the first to start")
    rest = [asyncio.create_task(b.submit(sample(i, rows=1 + i % 2), ["y", "s"], 1 + i % 2))
            for i in range(1, 7)]  # fmt: skip
    await until(lambda: b.queued == 6, "six queued")
    model.gate.set()
    results = await asyncio.gather(first, *rest)
    assert model.calls == [1, 8, 1]  # the first alone, then two batches of at most 8 rows
    for i, outputs in enumerate(results[1:], start=1):
        x = sample(i, rows=1 + i % 2)["x"]
        np.testing.assert_array_equal(outputs[0], x @ WEIGHTS)
        np.testing.assert_array_equal(outputs[1], x.sum(axis=1, keepdims=True))
    assert b.stats.batches == len(model.calls) and b.stats.rows == 10
    await b.stop()
    pool.stop()


async def test_batches_never_exceed_max_batch_size_and_shapes_do_not_mix() -> None:
    model = Model()
    b, pool = batcher(model, max_batch_size=4)
    blocker = await occupy(b, model)
    wide = [asyncio.create_task(b.submit(sample(i, width=4), ["s"], 1)) for i in range(6)]
    narrow = [asyncio.create_task(b.submit(sample(i, width=2), ["s"], 1)) for i in range(2)]
    await until(lambda: b.queued == 8, "eight queued")
    model.gate.set()
    await asyncio.gather(blocker, *wide, *narrow)
    assert max(model.calls) <= 4
    assert sorted(model.calls) == [1, 2, 2, 4]  # blocker, 4 + 2 wide, 2 narrow
    for i, task in enumerate(narrow):
        np.testing.assert_array_equal(task.result()[0], [[2.0 * i]])
    await b.stop()
    pool.stop()


async def test_higher_priority_runs_first() -> None:
    model = Model()
    b, pool = batcher(model, max_batch_size=1, priority_levels=3, default_priority=2)
    blocker = await occupy(b, model)
    low = asyncio.create_task(b.submit(sample(3), ["s"], 1, priority=3))
    default = asyncio.create_task(b.submit(sample(2), ["s"], 1))
    high = asyncio.create_task(b.submit(sample(1), ["s"], 1, priority=1))
    await until(lambda: b.queued == 3, "three queued")
    model.gate.set()
    await asyncio.gather(blocker, low, default, high)
    assert model.order == [0, 1, 2, 3]
    with pytest.raises(InvalidInput, match=r"priority 4 must be in 1\.\.3"):
        await b.submit(sample(0), ["s"], 1, priority=4)
    await b.stop()
    pool.stop()


async def test_a_request_past_its_deadline_never_runs() -> None:
    model = Model()
    b, pool = batcher(model, max_batch_size=1)
    blocker = await occupy(b, model)
    with pytest.raises(DeadlineExceeded, match="did not run") as raised:
        await b.submit(sample(7), ["s"], 1, timeout_s=0.05)
    assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    model.gate.set()
    await blocker
    assert model.order == [0] and b.stats.expired == 1
    await b.stop()
    pool.stop()


async def test_timeouts_count_from_arrival_not_from_the_queue() -> None:
    """A call that already waited in gRPC and the event loop has less of its timeout left."""
    model = Model()
    b, pool = batcher(model, max_batch_size=1, default_timeout_s=30.0)
    blocker = await occupy(b, model)
    # It arrived 31 s ago: its 30 s are spent. Counted from the queue it would wait 30 s more,
    # far past this bound (no timing margin to tune).
    async with asyncio.timeout(5):
        with pytest.raises(DeadlineExceeded):
            await b.submit(sample(7), ["s"], 1, received_at=time.monotonic() - 31.0)
    model.gate.set()
    await blocker
    await b.stop()
    pool.stop()


async def test_the_queue_policy_timeout_applies_without_a_request_timeout() -> None:
    model = Model()
    b, pool = batcher(model, max_batch_size=1, default_timeout_s=0.05)
    blocker = await occupy(b, model)
    with pytest.raises(DeadlineExceeded):
        await b.submit(sample(7), ["s"], 1)
    model.gate.set()
    await blocker
    await b.stop()
    pool.stop()


async def test_a_full_queue_rejects_at_once() -> None:
    model = Model()
    b, pool = batcher(model, max_batch_size=1, max_queue_size=2)
    blocker = await occupy(b, model)
    queued = [asyncio.create_task(b.submit(sample(i), ["s"], 1)) for i in (1, 2)]
    await until(lambda: b.queued == 2, "two queued")
    # Queued instead, it would wait behind the blocker, which holds its slot past this bound.
    async with asyncio.timeout(5):
        with pytest.raises(QueueFull, match="queue full") as raised:
            await b.submit(sample(3), ["s"], 1)
    assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    model.gate.set()
    await asyncio.gather(blocker, *queued)
    assert b.stats.rejected_full == 1 and model.order == [0, 1, 2]
    await b.stop()
    pool.stop()


async def settle() -> None:
    """Gives the scheduler task every chance to act on what it was told (no clock moves)."""
    for _ in range(20):
        await asyncio.sleep(0.001)


async def test_queue_delay_is_honoured_on_an_idle_model_as_triton_does() -> None:
    model, clock = Model(), Clock()
    b, pool = batcher(model, clock=clock, max_queue_delay_s=10.0, preferred_batch_sizes=(4,))
    first = asyncio.create_task(b.submit(sample(1), ["s"], 1))
    second = asyncio.create_task(b.submit(sample(2), ["s"], 1))
    await settle()
    assert model.entered == 0 and b.queued == 2  # idle, yet waiting for a preferred size
    clock.now = 10.0  # the oldest has waited the whole delay
    third = asyncio.create_task(b.submit(sample(3), ["s"], 1))  # wakes the scheduler
    await asyncio.gather(first, second, third)
    assert model.calls == [3]  # one batch: the delay bought company
    await b.stop()
    pool.stop()


async def test_a_preferred_size_runs_at_once_without_the_delay() -> None:
    model, clock = Model(), Clock()
    b, pool = batcher(model, clock=clock, max_queue_delay_s=10.0, preferred_batch_sizes=(2,))
    await b.submit(sample(1, rows=2), ["s"], 2)  # the clock never moves: no delay was waited
    assert model.calls == [2]
    await b.stop()
    pool.stop()


async def test_skip_delay_when_idle_runs_a_lone_request_at_once_but_waits_when_busy() -> None:
    model, clock = Model(), Clock()
    b, pool = batcher(
        model, slots=2, clock=clock, max_queue_delay_s=10.0, preferred_batch_sizes=(4,),
        skip_delay_when_idle=True,
    )  # fmt: skip
    await b.submit(sample(1), ["s"], 1)  # nothing running: waiting would only add latency
    assert model.calls == [1]
    blocker = await occupy(b, model)  # one instance busy: now company is worth waiting for
    waiting = asyncio.create_task(b.submit(sample(2), ["s"], 1))
    await settle()
    assert b.queued == 1 and model.entered == 2  # a slot is free, but the delay is honoured
    clock.now = 10.0
    late = asyncio.create_task(b.submit(sample(3), ["s"], 1))
    await asyncio.gather(waiting, late)
    model.gate.set()
    await blocker
    assert model.calls == [1, 2, 1]  # alone; the pair after the delay; then the blocker
    await b.stop()
    pool.stop()


async def test_a_cancelled_request_leaves_the_queue() -> None:
    model = Model()
    b, pool = batcher(model, max_batch_size=1)
    blocker = await occupy(b, model)
    doomed = asyncio.create_task(b.submit(sample(5), ["s"], 1))
    await until(lambda: b.queued == 1, "one queued")
    doomed.cancel()
    await until(lambda: b.queued == 0, "the queue to empty")
    model.gate.set()
    await blocker
    assert model.order == [0]
    await b.stop()
    pool.stop()


async def test_a_failing_call_fails_every_request_of_the_batch_and_the_batcher_goes_on() -> None:
    model = Model()
    calls = 0

    def flaky(feeds: Mapping[str, np.ndarray], outputs: Sequence[str], rows: int) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("onnxruntime said no")
        return model.run(feeds, outputs, rows)

    pool = Workers(1, "test", asyncio.get_running_loop())
    b = DynamicBatcher(BatchingPolicy(max_batch_size=4), flaky, 1, pool.submit)
    b.start()
    with pytest.raises(RuntimeError, match="said no"):
        await b.submit(sample(1), ["s"], 1)
    assert (await b.submit(sample(2), ["s"], 1))[0].tolist() == [[8.0]]
    await b.stop()
    pool.stop()


async def test_a_failing_batch_fails_its_own_requests_only() -> None:
    """Through the workers' hand-off: batches form, rows come back to their requests, a failure
    reaches its batch only and the instance is free again afterwards."""
    model = Model()
    model.hold = {0.0}
    calls = 0

    def run(feeds: Mapping[str, np.ndarray], outputs: Sequence[str], rows: int) -> Any:
        nonlocal calls
        calls += 1
        if float(feeds["x"][0, 0]) == 9.0:
            raise RuntimeError("onnxruntime said no")
        return model.run(feeds, outputs, rows)

    pool = Workers(1, "test", asyncio.get_running_loop())
    b = DynamicBatcher(BatchingPolicy(max_batch_size=8), run, 1, pool.submit)
    b.start()
    blocker = await occupy(b, model)
    waiting = [asyncio.create_task(b.submit(sample(v), ["s", "y"], 1)) for v in (1, 2, 3)]
    await until(lambda: b.queued == 3, "three requests queued behind the blocker")
    model.gate.set()
    (s0,), answers = await blocker, await asyncio.gather(*waiting)
    assert s0.tolist() == [[0.0]]
    assert [a[0].tolist() for a in answers] == [[[4.0]], [[8.0]], [[12.0]]]
    assert model.calls == [1, 3]  # the blocker alone, then one batch of the three
    with pytest.raises(RuntimeError, match="said no"):
        await b.submit(sample(9), ["s"], 1)
    assert (await b.submit(sample(2), ["s"], 1))[0].tolist() == [[8.0]]
    await b.stop()
    pool.stop()


async def test_one_batch_ahead_waits_at_the_workers_and_starts_when_the_instance_frees() -> None:
    """ahead=1: while the only instance runs, the next request is handed to the workers at once
    (it leaves the queue, alone) and runs as soon as the instance is free; later ones queue and
    form the batch after it."""
    model = Model()
    b, pool = batcher(model, ahead=1)
    blocker = await occupy(b, model)
    second = asyncio.create_task(b.submit(sample(1), ["s"], 1))
    await until(lambda: b._free_slots == 0, "the second handed to the workers")
    assert b.queued == 0
    rest = [asyncio.create_task(b.submit(sample(v), ["s"], 1)) for v in (2, 3, 4)]
    await until(lambda: b.queued == 3, "three queued behind the batch ahead")
    model.gate.set()
    answers = await asyncio.gather(blocker, second, *rest)
    assert [a[0].tolist() for a in answers] == [[[0.0]], [[4.0]], [[8.0]], [[12.0]], [[16.0]]]
    assert model.calls == [1, 1, 3]  # the blocker, the batch ahead, then the three together
    await b.stop()
    pool.stop()


async def test_requests_arriving_together_go_ahead_as_one_batch() -> None:
    """The batch ahead is formed by the scheduler's pass, after the loop has taken in the other
    requests that arrived with the first: they go ahead together, not one alone."""
    model = Model()
    b, pool = batcher(model, ahead=1)
    blocker = await occupy(b, model)
    together = [asyncio.create_task(b.submit(sample(v), ["s"], 1)) for v in (1, 2, 3)]
    await until(lambda: b._free_slots == 0, "a batch handed to the workers")
    assert b.queued == 0
    model.gate.set()
    await asyncio.gather(blocker, *together)
    assert model.calls == [1, 3]
    await b.stop()
    pool.stop()


async def test_time_waiting_at_the_workers_counts_as_queue_time() -> None:
    """A batch ahead is dequeued when it starts on the instance, not when it is handed over."""
    model, clock = Model(), Clock()
    waits: list[float] = []
    b, pool = batcher(model, clock=clock, ahead=1, on_dequeue=waits.append)
    blocker = await occupy(b, model)
    second = asyncio.create_task(b.submit(sample(1), ["s"], 1))
    await until(lambda: b._free_slots == 0, "the second handed to the workers")
    clock.now = 5.0  # the blocker runs for "5 s" while the second waits at the workers
    model.gate.set()
    await asyncio.gather(blocker, second)
    assert waits == [0.0, 5.0]
    await b.stop()
    pool.stop()


async def test_skip_delay_when_idle_means_nothing_handed_to_the_workers() -> None:
    """With a batch ahead allowed, "idle" still means no batch running or waiting: a request
    arriving while one runs waits for company (the queue delay) instead of going ahead."""
    model, clock = Model(), Clock()
    b, pool = batcher(
        model, clock=clock, ahead=1, max_queue_delay_s=10.0, skip_delay_when_idle=True
    )
    blocker = await occupy(b, model)  # idle: ran at once despite the delay
    waiting = asyncio.create_task(b.submit(sample(1), ["s"], 1))
    await until(lambda: b.queued == 1, "the second queued for company")
    clock.now = 10.0  # its delay is over: it goes ahead of the running blocker
    b._wake.set()
    await until(lambda: b.queued == 0, "the second handed to the workers")
    model.gate.set()
    assert (await waiting)[0].tolist() == [[4.0]]
    await blocker
    await b.stop()
    pool.stop()


# -- configuration ----------------------------------------------------------------------------
def config(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def test_policy_from_config_pbtxt() -> None:
    policy = batching_policy(
        config(
            "max_batch_size: 16 dynamic_batching { preferred_batch_size: [8, 4] "
            "max_queue_delay_microseconds: 500 priority_levels: 3 default_priority_level: 2 "
            "default_queue_policy { max_queue_size: 64 default_timeout_microseconds: 250000 } }"
        )
    )
    assert policy == BatchingPolicy(
        max_batch_size=16,
        preferred_batch_sizes=(4, 8),
        max_queue_delay_s=0.0005,
        priority_levels=3,
        default_priority=2,
        max_queue_size=64,
        default_timeout_s=0.25,
    )
    assert batching_policy(config("max_batch_size: 16")) is None
    assert batching_policy(config("max_batch_size: 0 dynamic_batching {}")) is None
    default = batching_policy(config("max_batch_size: 4 dynamic_batching {}"))
    assert default == BatchingPolicy(max_batch_size=4)
    assert not default.skip_delay_when_idle  # Triton's behaviour unless asked otherwise


@pytest.mark.parametrize(("value", "skip"), [("true", True), (" TRUE ", True), ("false", False)])
def test_skip_delay_when_idle_is_a_model_parameter(value: str, skip: bool) -> None:
    text = (
        "max_batch_size: 4 dynamic_batching { max_queue_delay_microseconds: 500 } "
        f'parameters {{ key: "{SKIP_DELAY_WHEN_IDLE}" value {{ string_value: "{value}" }} }}'
    )
    assert batching_errors(config(text)) == []
    policy = batching_policy(config(text))
    assert policy is not None and policy.skip_delay_when_idle is skip


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            "max_batch_size: 4 dynamic_batching { preferred_batch_size: 8 }",
            "preferred_batch_size 8",
        ),
        (
            "max_batch_size: 4 dynamic_batching { preferred_batch_size: 0 }",
            "preferred_batch_size 0",
        ),
        (
            "max_batch_size: 4 dynamic_batching { priority_levels: 2 default_priority_level: 3 }",
            "default_priority_level 3 must be <= priority_levels (2)",
        ),
        (
            "max_batch_size: 4 dynamic_batching {} parameters { "
            'key: "dynamic_batching_skip_delay_when_idle" value { string_value: "yes" } }',
            "must be 'true' or 'false', got 'yes'",
        ),
    ],
)
def test_bad_batching_config_is_named(text: str, error: str) -> None:
    (found,) = batching_errors(config(text))
    assert error in found


# -- what a request asks for ------------------------------------------------------------------
def infer_request(**parameters: tuple[str, Any]) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="m")
    for name, (kind, value) in parameters.items():
        setattr(request.parameters[name], kind, value)
    return request


@pytest.mark.parametrize(
    ("parameters", "metadata", "remaining", "expected"),
    [
        ({}, (), None, (0, None)),
        ({"priority": ("uint64_param", 2)}, (), None, (2, None)),
        ({"priority": ("int64_param", 1)}, (("x-priority", "3"),), None, (1, None)),
        ({}, (("x-priority", "3"),), None, (3, None)),
        ({"timeout": ("int64_param", 250_000)}, (), None, (0, 0.25)),
        ({"timeout": ("int64_param", 250_000)}, (), 0.1, (0, 0.1)),
        ({"timeout": ("int64_param", 0)}, (), 2.0, (0, 2.0)),
    ],
)
def test_priority_and_timeout_as_triton_reads_them(
    parameters: dict[str, tuple[str, Any]],
    metadata: tuple[tuple[str, str], ...],
    remaining: float | None,
    expected: tuple[int, float | None],
) -> None:
    assert request_scheduling(infer_request(**parameters), metadata, remaining) == expected


@pytest.mark.parametrize(
    ("parameters", "metadata", "error"),
    [
        ({"priority": ("string_param", "high")}, (), "parameters['priority']: expected an int64"),
        ({"timeout": ("int64_param", -5)}, (), "parameters['timeout']: expected an int64"),
        ({"priority": ("bool_param", True)}, (), "got bool_param True"),
        ({}, (("x-priority", "urgent"),), "header x-priority: expected a number >= 0"),
    ],
)
def test_hostile_scheduling_values_are_named(
    parameters: dict[str, tuple[str, Any]], metadata: tuple[tuple[str, str], ...], error: str
) -> None:
    with pytest.raises(InvalidInput, match=error.replace("[", r"\[").replace("]", r"\]")):
        request_scheduling(infer_request(**parameters), metadata, None)
