"""Token budgets per (tenant, model): reserve a request's bound first, settle what it used last.

Charging tokens only after a generation ends (what envoyproxy/ai-gateway #2394 and #1754
complain about) lets a burst of concurrent requests all pass while the bucket still looks full
and overspend it by every request's size. Here admission **reserves** the request's bound
(``max_tokens`` plus the prompt's bound) and is refused unless the bucket holds it; the
**settlement** at the end refunds the reserved tokens the request did not use (or charges a
request that used more than it reserved, as debt the next requests wait out). However many
requests arrive at once, the tokens admitted never exceed the burst plus the refill.

A settlement refunds only a reservation this ledger made (by request id, once): a refund
nobody reserved, or a second one for the same request, changes nothing. Two reservations under
one id (which Envoy's admission script never makes) are settled one each, oldest first, so the
tokens charged in all still add up to the tokens used. Reservations never
settled (the request's end was not reported) stay charged; after ``hold_s`` they move to a
second, as bounded, record of expired reservations, so a settlement that comes later still
counts: a ModelStreamInfer stream held open past ``hold_s`` that used more than it reserved
is charged the difference (before, an expired reservation made its settlement a no-op, and
a long stream was never charged beyond its reservation). Thread-safe: one lock, O(1) per
call.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from control_plane.model.mesh import TokenLimit

HOLD_S = 600.0  # how long an unsettled reservation is remembered (then it stays charged)
MAX_PENDING = 100_000  # reservations remembered at once (the oldest go first)


@dataclass(frozen=True)
class Admission:
    """A reservation's answer: admitted, or refused with the whole seconds to wait
    (``retry_after_s``; 0 when waiting cannot help: the request is larger than the burst)."""

    admitted: bool
    tokens: int
    retry_after_s: int = 0
    available: float = 0.0


@dataclass
class _Bucket:
    level: float  # may go below 0: debt from a request that used more than it reserved
    updated: float
    limit: TokenLimit

    def refill(self, now: float, limit: TokenLimit) -> None:
        self.level = min(
            float(limit.burst), self.level + max(0.0, now - self.updated) * limit.tokens_per_s
        )
        self.updated = now
        self.limit = limit


class TokenLedger:
    """The buckets and the open reservations of one limiter (a control-plane replica)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        hold_s: float = HOLD_S,
        max_pending: int = MAX_PENDING,
    ) -> None:
        self._clock = clock
        self._hold_s = hold_s
        self._max_pending = max_pending
        self._lock = threading.Lock()
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        # (tenant, model, request id, n) -> (tokens reserved, when); n tells apart reservations
        # under one id (ids are unique per request, but the ledger does not rely on it)
        self._pending: OrderedDict[tuple[str, str, str, int], tuple[int, float]] = OrderedDict()
        self._serial = 0
        self._by_id: dict[tuple[str, str, str], deque[int]] = {}  # the serials of each id
        # (tenant, model, request id) -> the tokens of its expired reservations, oldest first
        self._expired: OrderedDict[tuple[str, str, str], deque[int]] = OrderedDict()

    def _bucket(self, key: tuple[str, str], limit: TokenLimit, now: float) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(float(limit.burst), now, limit)
        bucket.refill(now, limit)
        return bucket

    def _expire(self, now: float) -> None:
        while self._pending:
            key, (_, when) = next(iter(self._pending.items()))
            if now - when <= self._hold_s and len(self._pending) < self._max_pending:
                return
            tokens, _ = self._pending.pop(key)
            serials = self._by_id[key[:3]]
            serials.popleft()  # the oldest of its id: reservations expire in order
            if not serials:
                del self._by_id[key[:3]]
            self._expired.setdefault(key[:3], deque()).append(tokens)
            self._expired.move_to_end(key[:3])
            while len(self._expired) > self._max_pending:
                self._expired.popitem(last=False)  # forgotten for good: it stays charged

    def reserve(
        self, tenant: str, model: str, limit: TokenLimit, tokens: int, request_id: str
    ) -> Admission:
        """Takes ``tokens`` (at least 1) from the bucket if it holds them."""
        tokens = max(1, int(tokens))
        with self._lock:
            now = self._clock()
            self._expire(now)
            bucket = self._bucket((tenant, model), limit, now)
            if tokens > limit.burst:
                return Admission(False, tokens, 0, bucket.level)
            if bucket.level < tokens:
                wait = math.ceil((tokens - bucket.level) / limit.tokens_per_s)
                return Admission(False, tokens, max(1, wait), bucket.level)
            bucket.level -= tokens
            self._serial += 1
            self._pending[(tenant, model, request_id, self._serial)] = (tokens, now)
            self._by_id.setdefault((tenant, model, request_id), deque()).append(self._serial)
            return Admission(True, tokens, 0, bucket.level)

    def settle(self, tenant: str, model: str, limit: TokenLimit, used: int, request_id: str) -> int:
        """Closes ``request_id``'s reservation given the tokens it ``used``: returns the tokens
        given back (negative: charged beyond the reservation); 0 with no open reservation."""
        with self._lock:
            now = self._clock()
            key = (tenant, model, request_id)
            serials = self._by_id.get(key)
            if serials:
                serial = serials.popleft()  # the oldest open reservation under this id
                if not serials:
                    del self._by_id[key]
                reserved = self._pending.pop((*key, serial))[0]
            elif key in self._expired:  # settled after hold_s: it counts all the same
                expired = self._expired[key]
                reserved = expired.popleft()
                if not expired:
                    del self._expired[key]
            else:
                return 0
            refund = reserved - max(0, int(used))
            bucket = self._bucket((tenant, model), limit, now)
            bucket.level = min(float(limit.burst), bucket.level + refund)
            return refund

    def available(self, tenant: str, model: str) -> float | None:
        """The tokens the bucket holds now (None before its first request)."""
        with self._lock:
            bucket = self._buckets.get((tenant, model))
            if bucket is None:
                return None
            bucket.refill(self._clock(), bucket.limit)
            return bucket.level

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)
