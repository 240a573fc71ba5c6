"""Fault injection for tests and drills (``--enable-fault-injection``; off by default).

The admin HTTP endpoint (POST /faults) changes the faults; ModelInfer reads them on the event
loop. The current faults are one immutable snapshot, replaced whole, so a reader never sees a
half-applied change.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import logging
import math
import mmap
import random
import threading
from dataclasses import dataclass
from typing import Any

from model_server.core.errors import ModelUnavailable

log = logging.getLogger(__name__)

INJECTED_MESSAGE = "injected fault"


class FaultError(ValueError):
    """A POST /faults body that cannot be applied; names the field."""


@dataclass(frozen=True)
class Faults:
    latency_ms: float = 0.0
    error_rate: float = 0.0
    ballast_bytes: int = 0
    # Latency and errors only for requests served by this model version ("": every request);
    # a bad canary is one version failing, not the whole server.
    version: str = ""

    def applies_to(self, version: int) -> bool:
        return not self.version or self.version == str(version)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _number(body: dict[str, Any], key: str) -> float:
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise FaultError(f"{key}: expected a finite number, got {value!r}")
    return float(value)


def _version(value: object) -> str:
    """A model version number (2 or "2"), or "" / null for every version."""
    if value is None or value == "":
        return ""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return str(value)
    if isinstance(value, str) and value.isdigit() and int(value) >= 1:
        return str(int(value))
    raise FaultError(f"version: expected a model version like 2, or null for all, got {value!r}")


def parse_faults(body: object, current: Faults) -> Faults:
    """The faults after applying ``body`` (any subset of the fields) to ``current``."""
    if not isinstance(body, dict):
        raise FaultError("body: expected a JSON object")
    known = {"latency_ms", "error_rate", "ballast_bytes", "version", "reset"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise FaultError(f"{unknown[0]}: unknown field (expected one of {sorted(known)})")
    reset = body.get("reset", False)
    if not isinstance(reset, bool):
        raise FaultError(f"reset: expected true or false, got {reset!r}")
    base = Faults() if reset else current
    changes: dict[str, Any] = {}
    if "latency_ms" in body:
        latency = _number(body, "latency_ms")
        if latency < 0:
            raise FaultError(f"latency_ms: must be >= 0, got {latency}")
        changes["latency_ms"] = latency
    if "error_rate" in body:
        rate = _number(body, "error_rate")
        if not 0.0 <= rate <= 1.0:
            raise FaultError(f"error_rate: must be between 0 and 1, got {rate}")
        changes["error_rate"] = rate
    if "ballast_bytes" in body:
        ballast = body["ballast_bytes"]
        if isinstance(ballast, bool) or not isinstance(ballast, int) or ballast < 0:
            raise FaultError(f"ballast_bytes: expected an integer >= 0, got {ballast!r}")
        changes["ballast_bytes"] = ballast
    if "version" in body:
        changes["version"] = _version(body["version"])
    return dataclasses.replace(base, **changes)


class FaultInjector:
    """The faults in force, and the ballast memory that backs ``ballast_bytes``."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.current = Faults()
        self._ballast: mmap.mmap | None = None
        self._lock = threading.Lock()  # HTTP handler threads apply changes one at a time

    def apply(self, body: object) -> Faults:
        """Validates and applies a POST /faults body; raises FaultError naming the field."""
        with self._lock:
            new = parse_faults(body, self.current)
            if new.ballast_bytes != self.current.ballast_bytes:
                self._set_ballast(new.ballast_bytes)
            old, self.current = self.current, new
        if new != old:
            log.warning("fault injection changed: %s (was %s)", new.as_dict(), old.as_dict())
        return new

    def _set_ballast(self, size: int) -> None:
        if self._ballast is not None:  # freed first, so a resize never holds both
            self._ballast.close()
            self._ballast = None
        if size > 0:
            # An anonymous mapping costs nothing until touched, so every page is written to make
            # it resident. The writing must not hold the GIL: ``bytearray(size)`` zeroes 560 MiB
            # in 1.5 s holding it, and touching a page at a time with GIL releases between chunks
            # took over 5 s on a loaded server (each release waits out other threads' switch
            # interval). ctypes.memset is a foreign call, made with the GIL released.
            ballast = mmap.mmap(-1, size)
            window = (ctypes.c_char * size).from_buffer(ballast)
            ctypes.memset(ctypes.addressof(window), 1, size)
            del window  # its export of the buffer would keep the mapping from closing
            self._ballast = ballast

    async def before_execute(self, version: int) -> None:
        """Applies the latency and error faults to one request that ``version`` of its model
        serves (on the event loop)."""
        faults = self.current
        if not faults.applies_to(version):
            return
        if faults.latency_ms > 0:
            await asyncio.sleep(faults.latency_ms / 1000.0)
        if faults.error_rate > 0 and random.random() < faults.error_rate:
            raise ModelUnavailable(INJECTED_MESSAGE)
