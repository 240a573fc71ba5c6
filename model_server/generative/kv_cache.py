"""The KV cache of a generative model, kept in fixed-size blocks under a budget, with prefix
caching (vLLM's automatic prefix caching).

A ``KvCache`` owns one preallocated pool per layer for keys and one for values, each shaped
``[total_blocks, heads, block_tokens, head_dim]``. A sequence holds a list of blocks that grows
as it does (``reserve``) and gives them back when it finishes, is cancelled or its client goes
away (``release``). When the pool cannot cover a reservation the caller is told
(``KvCacheFull``) and decides: wait, or refuse the new sequence.

**Prefix caching.** A block that fills up is keyed by a hash chain: ``block_hash(parent,
tokens)``, a stable digest (BLAKE2b, never Python's randomized ``hash``) of the hash of every
block before it and its own tokens, so equal keys mean equal tokens from position 0 on, hence
equal keys/values (the model is causal). A new sequence (``admit``) looks its tokens' full
blocks up in order and shares the longest chain found; its prefill computes only the rest.
Shared blocks are read-only and counted (``refs``). A block whose count drops to 0 stays
cached in an LRU until an allocation needs its memory and nothing is free: then the oldest
goes (an eviction; a released sequence's tail is older than its head, so chains shrink from
their ends). A partially filled block is never keyed, hence never shared; a sequence only ever
writes past its full blocks, into a block it alone holds. The one exception is a prompt whose
every block is cached: its last token must still be computed (its logits give the first new
token), so its last block is copied (copy-on-write) rather than shared. Off
(``prefix_caching=False``), nothing is keyed and released blocks are free at once.

ONNX Runtime's decoder (Optimum's naming) takes past keys/values as dense tensors, so each step
``gather``s the running sequences' blocks into one left-padded batch
``[batch, heads, max_len, head_dim]`` per layer (left padding keeps every sequence's newest token
in the last column, where the step's new token goes) and ``append``s what the step produced.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

ROOT_HASH = b""  # the parent of a sequence's first block


class KvCacheFull(Exception):
    """Not enough free blocks for a reservation (nothing was allocated)."""


@dataclass(frozen=True)
class KvShape:
    layers: int
    heads: int
    head_dim: int
    block_tokens: int = 16
    total_blocks: int = 256

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.layers * self.heads * self.block_tokens * self.head_dim * 4


@dataclass
class PrefixStats:
    """What prefix caching did since the cache was made (counters)."""

    lookup_tokens: int = 0  # tokens of admitted sequences, looked up
    hit_tokens: int = 0  # of those, the ones whose keys/values came from the cache
    evictions: int = 0  # cached blocks whose memory an allocation took back
    copies: int = 0  # copy-on-write of a shared block

    @property
    def saved(self) -> float:
        """The share of prefill tokens the cache saved."""
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full block: its parent's key and its own tokens, stable across runs."""
    data = np.asarray(tokens, dtype=np.int64).tobytes()
    return hashlib.blake2b(parent + data, digest_size=16).digest()


def block_keys(tokens: Sequence[int], block_tokens: int) -> Iterator[bytes]:
    """The keys of ``tokens``' full blocks, first to last (computed as they are asked for)."""
    parent = ROOT_HASH
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        parent = block_hash(parent, tokens[start : start + block_tokens])
        yield parent


class KvCache:
    def __init__(
        self,
        shape: KvShape,
        prefix_caching: bool = True,
        observe: Callable[[str, float], None] = lambda what, value: None,
    ) -> None:
        self.shape = shape
        self.prefix_caching = prefix_caching
        self._observe = observe  # ("prefix_lookup"|"prefix_hit"|"prefix_eviction", count)
        # Per layer, keys (and values) as [heads, slots, head_dim], block b holding slots
        # b * block_tokens onwards: gather then copies whole rows of head_dim floats. One block
        # more than the budget: the last stays zero, the source of gather's padding.
        slots = (shape.total_blocks + 1) * shape.block_tokens
        pool = (shape.heads, slots, shape.head_dim)
        self.keys = [np.zeros(pool, np.float32) for _ in range(shape.layers)]
        self.values = [np.zeros(pool, np.float32) for _ in range(shape.layers)]
        self._free: list[int] = list(range(shape.total_blocks - 1, -1, -1))  # a stack
        self.refs = [0] * shape.total_blocks  # sequences holding each block
        self._cached: OrderedDict[int, None] = OrderedDict()  # refs 0, keyed: LRU, oldest 1st
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._blocks: dict[str, list[int]] = {}
        self._lengths: dict[str, int] = {}  # tokens written per sequence
        self._tokens: dict[str, list[int] | None] = {}  # their ids (None: not keyed)
        self._chain: dict[str, list[bytes]] = {}  # keys of the sequence's full blocks
        self.stats = PrefixStats()

    # -- accounting -----------------------------------------------------------------------
    @property
    def used_blocks(self) -> int:
        """Blocks held by sequences (cached blocks no sequence holds are not counted)."""
        return self.shape.total_blocks - self.free_blocks

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation may take: free ones and cached ones no sequence holds."""
        return len(self._free) + len(self._cached)

    @property
    def cached_blocks(self) -> int:
        """Blocks kept for their prefix that no sequence holds (evicted first when needed)."""
        return len(self._cached)

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.shape.block_tokens)

    def length(self, sequence: str) -> int:
        return self._lengths.get(sequence, 0)

    def sequences(self) -> list[str]:
        return list(self._blocks)

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        """The cached blocks holding the longest chain of ``tokens``' full blocks."""
        if not self.prefix_caching:
            return []
        found = []
        for key in block_keys(tokens, self.shape.block_tokens):
            block = self._by_hash.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def holds(self, key: bytes) -> bool:
        """Whether a block with this key (``block_keys``) is cached, shareable."""
        return key in self._by_hash

    def admit(self, sequence: str, tokens: Sequence[int], room: int) -> int:
        """Makes a new sequence whose first ``len(tokens)`` tokens are ``tokens``, with
        blocks for ``room`` tokens, sharing the longest cached prefix; returns how many
        leading tokens' keys/values are already in place (at most ``len(tokens) - 1``). Takes
        nothing when it does not fit (``KvCacheFull``)."""
        if sequence in self._blocks:
            raise ValueError(f"{sequence}: already holds blocks")
        found = self.lookup(tokens)
        size = self.shape.block_tokens
        cached = min(len(found) * size, len(tokens) - 1)
        shared = found[: cached // size]  # the rest (a block at most) is copied on write
        copied = found[len(shared) :]
        missing = self.blocks_for(max(room, len(tokens))) - len(shared)
        pinned = [*shared, *copied]  # none of them may be evicted to make room
        available = self.free_blocks - sum(1 for b in pinned if self.refs[b] == 0)
        if copied and missing > available:  # the copy's source would take the last block:
            available += 1 if self.refs[copied[0]] == 0 else 0  # compute its tokens instead
            copied, pinned, cached = [], shared, len(shared) * size
        if missing > available:
            raise KvCacheFull(
                f"{sequence}: needs {missing} more KV blocks, {available} free of "
                f"{self.shape.total_blocks}"
            )
        for block in pinned:
            if self.refs[block] == 0:
                del self._cached[block]
            self.refs[block] += 1
        held = [*shared, *(self._take() for _ in range(missing))]
        for source in copied:  # the prompt's last block: its last slot gets written
            self._copy(source, held[len(shared)])
            self._unhold(source)
        self._blocks[sequence], self._lengths[sequence] = held, cached
        self._tokens[sequence] = list(tokens[:cached])
        self._chain[sequence] = [self._hash_of[b] for b in shared]
        self.stats.lookup_tokens += len(tokens)
        self.stats.hit_tokens += cached
        self._observe("prefix_lookup", len(tokens))
        self._observe("prefix_hit", cached)
        return cached

    def reserve(self, sequence: str, tokens: int) -> None:
        """Makes room for ``tokens`` tokens in all (a new sequence, or one that grows)."""
        held = self._blocks.setdefault(sequence, [])
        self._lengths.setdefault(sequence, 0)
        self._tokens.setdefault(sequence, [])
        self._chain.setdefault(sequence, [])
        missing = self.blocks_for(tokens) - len(held)
        if missing > self.free_blocks:
            if not held:
                self._forget(sequence)
            raise KvCacheFull(
                f"{sequence}: needs {missing} more KV blocks, {self.free_blocks} free of "
                f"{self.shape.total_blocks}"
            )
        for _ in range(max(0, missing)):
            held.append(self._take())

    def release(self, sequence: str) -> int:
        """Gives back every block of ``sequence``: a keyed one no other sequence holds is
        kept as cached (its tail first, so it is evicted first), the others are free; how
        many (0 if unknown)."""
        held = self._blocks.get(sequence, [])
        self._forget(sequence)
        for block in reversed(held):
            self._unhold(block)
        return len(held)

    def _unhold(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self._hash_of:
                self._cached[block] = None  # the most recent end
            else:
                self._free.append(block)

    def _forget(self, sequence: str) -> None:
        self._blocks.pop(sequence, None)
        self._lengths.pop(sequence, None)
        self._tokens.pop(sequence, None)
        self._chain.pop(sequence, None)

    def _take(self) -> int:
        """A block to write: a free one, else the least recently cached (evicted)."""
        block = self._free.pop() if self._free else self._evict()
        self.refs[block] = 1
        return block

    def _evict(self) -> int:
        block, _ = self._cached.popitem(last=False)
        del self._by_hash[self._hash_of.pop(block)]
        self.stats.evictions += 1
        self._observe("prefix_eviction", 1)
        return block

    def _slots(self, block: int, offset: int = 0, count: int | None = None) -> slice:
        """The pool's slots (its second axis) of ``block``, from ``offset``, ``count`` of them
        (the rest of the block by default)."""
        size = self.shape.block_tokens
        first = block * size + offset
        return slice(first, first + (size - offset if count is None else count))

    def _copy(self, source: int, target: int) -> None:
        to, of = self._slots(target), self._slots(source)
        for layer in range(self.shape.layers):
            self.keys[layer][:, to] = self.keys[layer][:, of]
            self.values[layer][:, to] = self.values[layer][:, of]
        self.stats.copies += 1

    # -- data -----------------------------------------------------------------------------
    def append(
        self,
        sequence: str,
        keys: list[np.ndarray],
        values: list[np.ndarray],
        tokens: Sequence[int] | None = None,
    ) -> None:
        """Writes new tokens' keys/values (per layer ``[heads, n, head_dim]``) after the
        sequence's last token; the blocks must have been reserved. With the tokens' ids, the
        blocks this fills are keyed for later sequences (without them, the sequence's blocks
        are never shared)."""
        start = self._lengths[sequence]
        count = keys[0].shape[1]
        held, size = self._blocks[sequence], self.shape.block_tokens
        if self.blocks_for(start + count) > len(held):
            raise KvCacheFull(f"{sequence}: append of {count} tokens past its reservation")
        position = start
        while position < start + count:  # one block-sized span at a time
            block, offset = held[position // size], position % size
            if self.refs[block] != 1 or block in self._hash_of:  # never: see the docstring
                raise RuntimeError(f"{sequence}: a write into shared block {block}")
            n = min(size - offset, start + count - position)
            source = slice(position - start, position - start + n)
            target = self._slots(block, offset, n)
            for layer in range(self.shape.layers):
                self.keys[layer][:, target] = keys[layer][:, source]
                self.values[layer][:, target] = values[layer][:, source]
            position += n
        self._lengths[sequence] = start + count
        self._key_full_blocks(sequence, tokens, count)

    def _key_full_blocks(self, sequence: str, tokens: Sequence[int] | None, count: int) -> None:
        seen = self._tokens.get(sequence)
        if not self.prefix_caching:
            return
        if seen is None or tokens is None or len(tokens) != count:
            self._tokens[sequence] = None  # ids unknown from here on: nothing more is keyed
            return
        seen.extend(tokens)
        chain, held, size = self._chain[sequence], self._blocks[sequence], self.shape.block_tokens
        while (len(chain) + 1) * size <= len(seen):
            index = len(chain)
            parent = chain[-1] if chain else ROOT_HASH
            key = block_hash(parent, seen[index * size : (index + 1) * size])
            chain.append(key)
            if self.prefix_caching and key not in self._by_hash:  # else a twin is cached
                self._by_hash[key], self._hash_of[held[index]] = held[index], key

    def gather(self, sequences: list[str]) -> tuple[list[np.ndarray], list[np.ndarray], int]:
        """Per layer, the sequences' cached keys and values as one left-padded batch
        ``[batch, heads, max_len, head_dim]`` (zeros in the padding), and ``max_len``.

        One indexed copy per layer and tensor, straight into that order: an index says, for
        each row, head and column, which row of the pool it comes from. (A copy per block and
        layer cost most of a decode step.)
        """
        lengths = [self._lengths[s] for s in sequences]
        longest = max(lengths, default=0)
        size, heads, head_dim = self.shape.block_tokens, self.shape.heads, self.shape.head_dim
        slots = np.full((len(sequences), longest), self.shape.total_blocks * size, np.intp)
        for row, (sequence, length) in enumerate(zip(sequences, lengths, strict=True)):
            if length:
                position = np.arange(length)
                held = np.asarray(self._blocks[sequence][: self.blocks_for(length)], np.intp)
                slots[row, longest - length :] = held[position // size] * size + position % size
        per_head = self.keys[0].shape[1]
        rows = (slots[:, None, :] + np.arange(heads)[:, None] * per_head).ravel()
        shape = (len(sequences), heads, longest, head_dim)

        def take(pool: np.ndarray) -> np.ndarray:
            return pool.reshape(-1, head_dim).take(rows, axis=0).reshape(shape)

        return [take(p) for p in self.keys], [take(p) for p in self.values], longest
