"""infermesh.event_loop: which loop a process runs on, and what happens when uvloop is missing."""

from __future__ import annotations

import argparse
import asyncio
import sys

import pytest

from infermesh import event_loop


async def _loop_name() -> str:
    await asyncio.sleep(0)
    return event_loop.running_loop_name()


def test_auto_runs_on_uvloop_where_it_is_installed() -> None:
    uvloop = pytest.importorskip("uvloop")
    assert event_loop.loop_factory("auto") is uvloop.new_event_loop
    assert event_loop.run(_loop_name()) == "uvloop"
    assert event_loop.run(_loop_name(), "uvloop") == "uvloop"


def test_asyncio_keeps_the_standard_loop() -> None:
    assert event_loop.run(_loop_name(), "asyncio") == "asyncio"


def test_the_coroutine_result_and_exceptions_come_back() -> None:
    async def fails() -> None:
        raise KeyError("kept")

    with pytest.raises(KeyError, match="kept"):
        event_loop.run(fails())


@pytest.fixture
def without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules makes the import raise ModuleNotFoundError, as on a host without it.
    monkeypatch.setitem(sys.modules, "uvloop", None)


@pytest.mark.usefixtures("without_uvloop")
def test_auto_falls_back_to_asyncio_without_uvloop() -> None:
    assert event_loop.loop_factory("auto") is asyncio.new_event_loop
    assert event_loop.run(_loop_name()) == "asyncio"


@pytest.mark.usefixtures("without_uvloop")
def test_asking_for_uvloop_without_it_is_an_error_naming_the_flag() -> None:
    with pytest.raises(event_loop.EventLoopUnavailable, match="--event-loop uvloop"):
        event_loop.loop_factory("uvloop")


def test_an_unknown_choice_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="auto, uvloop, asyncio"):
        event_loop.loop_factory("trio")
    parser = argparse.ArgumentParser()
    event_loop.add_event_loop_argument(parser)
    assert parser.parse_args([]).event_loop == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--event-loop", "trio"])
