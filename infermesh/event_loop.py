"""The asyncio event loop a process runs on: uvloop where it is installed, else asyncio's own.

A model server's event-loop thread is its bottleneck under load (grpc.aio's per-call work, our
request path and the batcher all run there). uvloop's loop (libuv, in C) schedules callbacks
and futures for less CPU than asyncio's pure-Python selector loop; bench/README.md ("The event
loop") has the side-by-side figures. ``auto`` takes uvloop when it imports and asyncio's loop
otherwise (uvloop has no Windows build), so the choice never stops a process from starting;
``uvloop`` insists on it and ``asyncio`` keeps the standard loop (for comparison, or to rule
the loop out when debugging).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

CHOICES = ("auto", "uvloop", "asyncio")

T = TypeVar("T")
LoopFactory = Callable[[], asyncio.AbstractEventLoop]


class EventLoopUnavailable(RuntimeError):
    """``uvloop`` was asked for and does not import here."""


def loop_factory(choice: str) -> LoopFactory:
    """What makes the loop ``choice`` (one of CHOICES) names; ``running_loop_name`` says
    which one it made."""
    if choice not in CHOICES:
        raise ValueError(f"event loop: expected one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "asyncio":
        return asyncio.new_event_loop
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError as exc:
        if choice == "uvloop":
            raise EventLoopUnavailable(
                f"--event-loop uvloop: uvloop does not import ({exc})"
            ) from exc
        return asyncio.new_event_loop
    factory: LoopFactory = uvloop.new_event_loop
    return factory


def run(main: Coroutine[Any, Any, T], choice: str = "auto") -> T:
    """``asyncio.run(main)`` on the loop ``choice`` names."""
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(main)


def running_loop_name() -> str:
    """Which loop runs the caller, "uvloop" or "asyncio" (for the start-up log line)."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"


def add_event_loop_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--event-loop",
        choices=CHOICES,
        default="auto",
        help="the asyncio event loop: uvloop (faster; 'auto' takes it when installed) or "
        "asyncio's own (default: auto)",
    )
