"""core.collector: the young threshold, and settle's collect-then-freeze (each test restores
the process's collector as it found it)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from model_server.core import collector


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> tuple[list[Node], weakref.ref[Node]]:
    """Two nodes that refer to each other, held by the returned list (and watched)."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return [a], weakref.ref(a)


@pytest.fixture(autouse=True)
def restored() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_tune_raises_the_young_threshold_only() -> None:
    _, gen1, gen2 = gc.get_threshold()
    assert collector.tune(12_345) is True
    assert gc.get_threshold() == (12_345, gen1, gen2)


def test_zero_leaves_cpythons_thresholds() -> None:
    before = gc.get_threshold()
    assert collector.tune(0) is False
    assert gc.get_threshold() == before


def test_settle_frees_unreachable_cycles_and_freezes_the_rest() -> None:
    holder, watched = cycle()
    kept = Node()
    holder.clear()  # the cycle is garbage now, freed only by a collection
    assert watched() is not None
    frozen = collector.settle()
    assert watched() is None
    assert frozen == gc.get_freeze_count() > 0
    assert not any(o is kept for o in gc.get_objects())  # frozen: later collections skip it


def test_a_later_settle_frees_what_an_earlier_one_froze() -> None:
    """An unloaded model's cycles: alive at one settle, garbage before the next."""
    holder, watched = cycle()
    collector.settle()
    holder.clear()
    gc.collect()
    assert watched() is not None  # frozen: a plain collection does not see it
    collector.settle()
    assert watched() is None
