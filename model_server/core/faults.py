"""Fault injection for tests and drills (``--enable-fault-injection``; off by default).

The admin HTTP endpoint (POST /faults) changes the faults; ModelInfer reads them on the event
loop. The current faults are one immutable snapshot, replaced whole, so a reader never sees a
half-applied change.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import mmap
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

from model_server.core.errors import ModelUnavailable

log = logging.getLogger(__name__)

PAGE_BYTES = 4096
BALLAST_CHUNK_BYTES = 1024 * 1024  # 256 page faults between two GIL releases
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
            # An anonymous mapping costs nothing until touched (``bytearray(size)`` zeroes every
            # byte while holding the GIL: 1.5 s for 560 MiB, long enough to time requests
            # out). Touch one byte per page (untouched pages are not resident and RSS would not
            # move), a chunk at a time, letting go of the GIL between chunks.
            ballast = mmap.mmap(-1, size)
            with memoryview(ballast) as view:
                for start in range(0, size, BALLAST_CHUNK_BYTES):
                    end = min(size, start + BALLAST_CHUNK_BYTES)
                    view[start:end:PAGE_BYTES] = b"\x01" * len(range(start, end, PAGE_BYTES))
                    time.sleep(0)
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
