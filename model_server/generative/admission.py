"""Which waiting sequences one round of the generation engine's scheduler admits.

The line is FIFO: the first waiting sequence joins when its tokens (its prompt, and what it
generated before a preemption) plus one fit in the KV cache (``KvCache.admit``, which shares
its longest cached prefix), and nobody passes it while it does not fit, up to ``slots``
sequences a round (the engine's ``max_running``).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol, TypeVar

from model_server.generative.kv_cache import KvCache, KvCacheFull


class Waiting(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def tokens(self) -> list[int]: ...


S = TypeVar("S", bound=Waiting)


def admit(waiting: deque[S], cache: KvCache, slots: int) -> list[S]:
    """Takes from the front of ``waiting`` the sequences this round admits (their blocks held,
    their cached prefix shared)."""
    admitted: list[S] = []
    while waiting and len(admitted) < slots:
        sequence = waiting[0]
        tokens = sequence.tokens
        try:
            cache.admit(sequence.name, tokens, len(tokens) + 1)
        except KvCacheFull:
            break  # it waits until running sequences give blocks back
        waiting.popleft()
        admitted.append(sequence)
    return admitted
