"""Sets CPython's cyclic garbage collector for a server whose requests allocate and die young.

With CPython's default thresholds (700, 10, 10) a model server under load collected its young
generation every few requests, and the objects of requests still in flight survived those
collections, moved up, and set off full collections: about once a second at c64, each walking
the ~72,000 objects start-up had left alive (modules, protobuf descriptors, the models) for
15-35 ms while the event loop held the GIL (``bench/README.md``, "grpc.aio's floor, and the
garbage collector").

Two settings, both from the command line (``--gc-threshold``):

- ``tune`` raises the young generation's threshold (default 10,000 net allocations), so most
  of a request's objects are freed by reference counting before a collection sees them, few
  move up, and full collections become rare.
- ``settle`` freezes what is alive once the models have loaded (``gc.freeze``): later
  collections skip it. It runs again after each model load or unload, unfreezing and
  collecting first, so an unloaded model's reference cycles are freed then.

What it costs: cyclic garbage waits for up to ``threshold`` allocations (kilobytes to a few
MiB) before it is freed; an object alive at a settle that later becomes part of an unreachable
cycle waits for the next settle; each settle is one full collection on the loop thread
(10-20 ms with the demo models, once per load or unload). Reference counting, which frees almost
everything, is not changed.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)

DEFAULT_GEN0_THRESHOLD = 10_000


def tune(gen0_threshold: int) -> bool:
    """Sets the young generation's threshold (the older two keep CPython's); 0: no change."""
    if gen0_threshold <= 0:
        return False
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0_threshold, gen1, gen2)
    log.info("garbage collector: young generation threshold %d", gen0_threshold)
    return True


def settle() -> int:
    """Collects what is unreachable, then freezes what is left out of later collections.
    Returns how many objects are frozen."""
    gc.unfreeze()  # what an earlier settle froze may be garbage now (an unloaded model)
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("garbage collector: %d objects frozen out of later collections", frozen)
    return frozen
