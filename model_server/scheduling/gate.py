"""Server-wide admission: readiness and the requests in flight, which the drain waits for."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from model_server.core.errors import ModelUnavailable


@dataclass
class ServingGate:
    """Server-wide admission: readiness flags and the requests in flight (for the drain)."""

    ready: Callable[[], bool]
    refusing: bool = False
    in_flight: int = 0
    last_arrival: float = 0.0

    def __post_init__(self) -> None:
        self.idle = asyncio.Event()
        self.idle.set()

    def enter(self) -> None:
        self.last_arrival = time.monotonic()
        if self.refusing:
            raise ModelUnavailable("server is draining and takes no new requests")
        self.in_flight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()
