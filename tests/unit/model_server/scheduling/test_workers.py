"""A model version's worker threads: jobs run off the loop, their outcomes come back on it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from model_server.scheduling.workers import Workers, WorkersStopped


@contextmanager
def workers(count: int) -> Iterator[Workers]:
    pool = Workers(count, "test", asyncio.get_running_loop())
    try:
        yield pool
    finally:
        pool.stop()


async def test_a_job_runs_on_a_worker_and_its_result_comes_back_on_the_loop() -> None:
    loop_thread = threading.get_ident()
    seen: list[int] = []

    def job() -> int:
        seen.append(threading.get_ident())
        return 42

    with workers(1) as pool:
        assert await pool.run(job) == 42
    assert seen and seen[0] != loop_thread


async def test_submit_calls_done_on_the_loop_with_the_result_or_the_exception() -> None:
    loop_thread = threading.get_ident()
    outcomes: list[tuple[object, int]] = []
    both = asyncio.Event()

    def done(outcome: object) -> None:
        outcomes.append((outcome, threading.get_ident()))
        if len(outcomes) == 2:
            both.set()

    def fails() -> None:
        raise RuntimeError("onnxruntime said no")

    with workers(1) as pool:
        pool.submit(lambda: "fine", done)
        pool.submit(fails, done)
        await asyncio.wait_for(both.wait(), 5)
    assert outcomes[0] == ("fine", loop_thread)
    error, thread = outcomes[1]
    assert isinstance(error, RuntimeError) and str(error) == "onnxruntime said no"
    assert thread == loop_thread


async def test_an_exception_is_raised_to_the_awaiting_caller_and_the_worker_goes_on() -> None:
    def fails() -> None:
        raise ValueError("bad feed")

    with workers(1) as pool:
        with pytest.raises(ValueError, match="bad feed"):
            await pool.run(fails)
        assert await pool.run(lambda: "still serving") == "still serving"


async def test_count_threads_run_jobs_at_the_same_time() -> None:
    """Two instances: two jobs run at once (each waits for the other to start)."""
    started = threading.Barrier(2, timeout=5)

    def job() -> str:
        started.wait()  # breaks (raises) unless both run at the same time
        return "ran"

    with workers(2) as pool:
        assert await asyncio.gather(pool.run(job), pool.run(job)) == ["ran", "ran"]


async def test_a_cancelled_caller_gets_nothing_and_the_loop_is_not_disturbed() -> None:
    release = threading.Event()

    def slow() -> str:
        release.wait(5)
        return "late"

    with workers(1) as pool:
        future = pool.run(slow)
        future.cancel()
        release.set()
        # The late outcome is dropped (setting a cancelled future would raise on the loop).
        assert await pool.run(lambda: "next") == "next"
        assert future.cancelled()


async def test_stop_finishes_queued_jobs_then_refuses_new_ones() -> None:
    release = threading.Event()
    pool = Workers(1, "test", asyncio.get_running_loop())
    first = pool.run(lambda: release.wait(5))
    queued = pool.run(lambda: "queued before stop")
    pool.stop()
    with pytest.raises(WorkersStopped, match="stopped"):
        pool.submit(lambda: None, lambda outcome: None)
    release.set()
    assert await first is True
    assert await queued == "queued before stop"
    for thread in pool._threads:
        thread.join(5)
        assert not thread.is_alive()
