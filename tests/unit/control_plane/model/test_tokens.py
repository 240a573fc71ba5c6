"""Token budgets: reserve first, settle last, never more than the burst plus the refill."""

from __future__ import annotations

import threading

from control_plane.model.mesh import TokenLimit
from control_plane.model.tokens import TokenLedger

LIMIT = TokenLimit(tokens_per_s=10.0, burst=100)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_reservation_takes_its_bound_and_the_settlement_refunds_the_rest() -> None:
    clock = Clock()
    ledger = TokenLedger(clock)
    assert ledger.reserve("a", "lm", LIMIT, 60, "r1").admitted
    refused = ledger.reserve("a", "lm", LIMIT, 60, "r2")
    assert not refused.admitted and refused.retry_after_s == 2  # 20 missing at 10/s
    assert ledger.settle("a", "lm", LIMIT, 10, "r1") == 50  # used 10 of 60
    assert ledger.available("a", "lm") == 90
    assert ledger.reserve("a", "lm", LIMIT, 60, "r2").admitted


def test_a_refund_needs_a_reservation_and_comes_once() -> None:
    ledger = TokenLedger(Clock())
    assert ledger.reserve("a", "lm", LIMIT, 80, "r1").admitted
    assert ledger.settle("a", "lm", LIMIT, 0, "nobody") == 0
    assert ledger.settle("a", "lm", LIMIT, 0, "r1") == 80
    assert ledger.settle("a", "lm", LIMIT, 0, "r1") == 0  # a second settlement gives nothing
    assert ledger.available("a", "lm") == 100  # and never above the burst


def test_using_more_than_reserved_is_debt_the_next_request_waits_out() -> None:
    clock = Clock()
    ledger = TokenLedger(clock)
    assert ledger.reserve("a", "lm", LIMIT, 50, "r1").admitted
    assert ledger.settle("a", "lm", LIMIT, 120, "r1") == -70
    assert ledger.available("a", "lm") == -20
    assert ledger.reserve("a", "lm", LIMIT, 10, "r2").retry_after_s == 3
    clock.now += 3
    assert ledger.reserve("a", "lm", LIMIT, 10, "r2").admitted


def test_the_bucket_refills_up_to_the_burst_only() -> None:
    clock = Clock()
    ledger = TokenLedger(clock)
    assert ledger.reserve("a", "lm", LIMIT, 100, "r1").admitted
    clock.now += 5
    assert ledger.available("a", "lm") == 50
    clock.now += 3600
    assert ledger.available("a", "lm") == 100


def test_a_request_larger_than_the_burst_is_refused_with_no_wait_that_helps() -> None:
    ledger = TokenLedger(Clock())
    answer = ledger.reserve("a", "lm", LIMIT, 101, "r1")
    assert not answer.admitted and answer.retry_after_s == 0
    assert ledger.reserve("a", "lm", LIMIT, 100, "r2").admitted  # nothing was taken


def test_tenants_and_models_have_buckets_of_their_own() -> None:
    ledger = TokenLedger(Clock())
    assert ledger.reserve("a", "lm", LIMIT, 100, "r1").admitted
    assert not ledger.reserve("a", "lm", LIMIT, 1, "r2").admitted
    assert ledger.reserve("b", "lm", LIMIT, 100, "r3").admitted
    assert ledger.reserve("a", "other-lm", LIMIT, 100, "r4").admitted


def test_unsettled_reservations_stay_charged_and_a_late_settlement_still_counts() -> None:
    """A stream held open past the hold that used more than it reserved is charged the rest
    (before, its reservation had expired and the settlement changed nothing)."""
    clock = Clock()
    ledger = TokenLedger(clock, hold_s=60)
    assert ledger.reserve("a", "lm", LIMIT, 30, "r1").admitted
    assert ledger.available("a", "lm") == 70  # charged while unsettled
    clock.now += 61  # refilled to the burst
    assert ledger.reserve("a", "lm", LIMIT, 1, "r2").admitted  # expires r1
    assert ledger.pending() == 1
    assert ledger.settle("a", "lm", LIMIT, 500, "r1") == -470  # used 500 of the 30 reserved
    assert ledger.available("a", "lm") == 100 - 1 - 470
    assert ledger.settle("a", "lm", LIMIT, 500, "r1") == 0  # once


def test_concurrent_reservations_never_admit_more_than_the_burst() -> None:
    clock = Clock()  # frozen: no refill, so the burst is all there is
    ledger = TokenLedger(clock)
    admitted: list[int] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        for n in range(50):
            if ledger.reserve("a", "lm", LIMIT, 7, f"{index}-{n}").admitted:
                with lock:
                    admitted.append(7)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(admitted) == 98  # 14 reservations of 7 fit in 100; none more
    assert ledger.available("a", "lm") == 2


def test_reservations_under_one_id_are_settled_one_each_and_add_up() -> None:
    """Envoy's script gives each reservation its own id; if two shared one, each settlement
    would still close one reservation (the oldest), and the charges add up to the use."""
    ledger = TokenLedger(Clock())
    assert ledger.reserve("a", "lm", LIMIT, 50, "same").admitted
    assert ledger.reserve("a", "lm", LIMIT, 10, "same").admitted
    assert ledger.settle("a", "lm", LIMIT, 10, "same") == 40  # closes the 50
    assert ledger.settle("a", "lm", LIMIT, 50, "same") == -40  # closes the 10
    assert ledger.settle("a", "lm", LIMIT, 0, "same") == 0
    assert ledger.available("a", "lm") == 40  # 100 - (10 + 50) used
    assert ledger.pending() == 0


def test_the_oldest_reservations_are_forgotten_first_when_too_many_are_open() -> None:
    """At most max_pending open and as many expired; past both, a reservation stays charged."""
    ledger = TokenLedger(Clock(), max_pending=2)
    for n in range(5):
        assert ledger.reserve("a", "lm", LIMIT, 1, f"r{n}").admitted
    assert ledger.pending() == 2  # r3, r4 open; r1, r2 expired; r0 forgotten
    assert ledger.settle("a", "lm", LIMIT, 0, "r0") == 0  # forgotten: stays charged
    assert ledger.settle("a", "lm", LIMIT, 0, "r1") == 1
    assert ledger.settle("a", "lm", LIMIT, 0, "r4") == 1
