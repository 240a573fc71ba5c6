"""The engine's supervisor with real child processes: a front end that cannot even be
started is tried again (before, the one failed exec ended that front end's keeper task for
good, so the server ran one front end short until it restarted), and ``stop`` ends every
child it started."""

from __future__ import annotations

import asyncio
import logging
import sys

import pytest

from model_server.frontends import supervisor
from model_server.frontends.supervisor import Supervisor
from tests.support import alive, wait_for_async

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


async def test_a_front_end_that_cannot_be_started_is_tried_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "model_server.frontends")
    commands = iter([["/nonexistent/frontend"], SLEEPER])
    keeper = Supervisor(1, lambda index: next(commands))
    starting = asyncio.create_task(keeper.start(timeout_s=10))
    try:
        await wait_for_async(keeper.pids, 10, "the second try running")
        [pid] = keeper.pids()
        keeper.on_ready(0, pid)  # what a front end's READY frame tells the engine
        await starting
        assert "front end 0 could not start" in caplog.text
    finally:
        await keeper.stop()
    assert not alive(pid)
    assert f"front ends stopped: 0={supervisor.STOP_SIGNAL.name}" in caplog.text
