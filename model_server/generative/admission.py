"""Which waiting sequences one round of the generation engine's scheduler admits.

The line is FIFO: the first waiting sequence joins when its tokens (its prompt, and what it
generated before a preemption) plus one fit in the KV cache (``KvCache.admit``, which shares
its longest cached prefix), and nobody passes it while it does not fit, up to ``slots``
sequences a round (the engine's ``max_running``).

**A prefix being written is waited for.** A block becomes shareable only once a prefill has
written its keys/values, and a round admits all its sequences before prefilling any: two
identical prompts admitted together would each compute, and hold, the same blocks (after a
cold start, N streams with one system prompt held N copies of it). So a waiting sequence
whose leading full blocks, past those the cache holds, equal blocks that a sequence admitted
in this round is about to write ends the round: it joins in the next one, after that prefill,
and shares them. It waits one round at most: the next round starts with nothing admitted, so
whatever became of the first sequence (prefilled, finished, failed, gone) it then joins with
what the cache holds. The sequences behind it wait that round too (FIFO). With prefix caching
off nothing is deferred.

**Reject** (``kv_when_full="reject"``): the engine refuses a request on arrival unless its
prompt fits in the free blocks beside what the sequences already waiting need
(``blocks_to_admit``). Blocks can still go between that check and admission (a running
sequence's decode step takes its next block first), so when the first waiting sequence does
not fit here, every new sequence waiting is refused rather than left to wait; a preempted one
(it has streamed tokens already) waits for its blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol, TypeVar

from model_server.generative.kv_cache import KvCache, KvCacheFull, block_keys


class Waiting(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def generated(self) -> list[int]: ...

    @property
    def tokens(self) -> list[int]: ...


S = TypeVar("S", bound=Waiting)


def blocks_to_admit(cache: KvCache, tokens: Sequence[int]) -> int:
    """The blocks admitting these tokens takes at most (sharing a cached prefix takes fewer)."""
    return cache.blocks_for(len(tokens) + 1)


def admit(waiting: deque[S], cache: KvCache, slots: int, reject: bool) -> tuple[list[S], list[S]]:
    """Takes from the front of ``waiting`` the sequences this round admits (their blocks held,
    their cached prefix shared) and, with ``reject``, the new ones refused."""
    admitted: list[S] = []
    unwritten: set[bytes] = set()  # keys of the full blocks the admitted ones will write
    while waiting and len(admitted) < slots:
        sequence = waiting[0]
        tokens = sequence.tokens
        if unwritten and _waits_for_prefix(cache, tokens, unwritten):
            break  # the next round shares what this round's prefill writes
        try:
            cache.admit(sequence.name, tokens, len(tokens) + 1)
        except KvCacheFull:
            if not reject:
                break  # it waits until running sequences give blocks back
            refused = [s for s in waiting if not s.generated]  # a preempted one waits
            for s in refused:
                waiting.remove(s)
            return admitted, refused
        waiting.popleft()
        admitted.append(sequence)
        if cache.prefix_caching and waiting:
            unwritten.update(block_keys(tokens, cache.shape.block_tokens))
    return admitted, []


def _waits_for_prefix(cache: KvCache, tokens: Sequence[int], unwritten: set[bytes]) -> bool:
    """Whether the first of ``tokens``' full blocks that the cache lacks is about to be
    written by a sequence admitted in this round."""
    for key in block_keys(tokens, cache.shape.block_tokens):
        if not cache.holds(key):
            return key in unwritten
    return False
