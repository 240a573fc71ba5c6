"""Prefix caching in the block KV cache: shared read-only blocks keyed by a hash chain,
reference counts, an LRU of cached blocks evicted oldest first, copy-on-write of a prompt's
last block, and, under random operations and budgets, every sequence's keys/values intact."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model_server.generative.kv_cache import (
    ROOT_HASH,
    KvCache,
    KvCacheFull,
    KvShape,
    block_hash,
)

SHAPE = KvShape(layers=2, heads=1, head_dim=3, block_tokens=4, total_blocks=8)


def kv(tokens: list[int], start: int, end: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Keys/values of positions start..end-1 as a causal model's: each depends on every token
    up to it (token, position, sum of the prefix), so a block of another prefix differs."""
    rows = [(tokens[i], i, sum(tokens[: i + 1])) for i in range(start, end)]
    data = np.array(rows, np.float32).reshape(1, end - start, 3)
    return [data, data + 1], [data * 2, data * 3]


def write(cache: KvCache, name: str, tokens: list[int]) -> int:
    """A prefill: admit with the prefix the cache holds, then append the rest."""
    cached = cache.admit(name, tokens, len(tokens) + 1)
    keys, values = kv(tokens, cached, len(tokens))
    cache.append(name, keys, values, tokens[cached:])
    return cached


def assert_holds(cache: KvCache, name: str, tokens: list[int]) -> None:
    keys, values, longest = cache.gather([name])
    want_k, want_v = kv(tokens, 0, len(tokens))
    assert longest == len(tokens)
    for layer in range(cache.shape.layers):
        np.testing.assert_array_equal(keys[layer][0], want_k[layer])
        np.testing.assert_array_equal(values[layer][0], want_v[layer])


def test_the_hash_chain_is_stable_and_covers_the_whole_prefix() -> None:
    first = block_hash(ROOT_HASH, [1, 2, 3, 4])
    assert first == block_hash(b"", (1, 2, 3, 4))
    assert first.hex() == "087a24230771ee662be37e5493b333d7"  # in every process: no hash()
    assert block_hash(first, [5, 6, 7, 8]) != block_hash(
        block_hash(ROOT_HASH, [0, 2, 3, 4]), [5, 6, 7, 8]
    )


def test_a_common_prefix_is_shared_and_only_the_rest_is_computed() -> None:
    cache = KvCache(SHAPE)
    a = list(range(1, 11))  # 10 tokens: two full blocks and half of one
    assert write(cache, "a", a) == 0
    b = [*a[:8], 50, 51, 52]
    assert write(cache, "b", b) == 8  # its two full blocks came from a
    assert cache.stats.hit_tokens == 8 and cache.stats.lookup_tokens == 21
    assert cache.used_blocks == 4  # 3 for a, and 1 of b's own past the 2 it shares
    shared = cache._blocks["a"][:2]
    assert cache._blocks["b"][:2] == shared and [cache.refs[x] for x in shared] == [2, 2]
    assert_holds(cache, "a", a)
    assert_holds(cache, "b", b)
    c = [*a[:6], 9, 9, 9]  # shares one block only: the second differs in its last two tokens
    assert write(cache, "c", c) == 4


def test_a_partly_filled_block_is_never_shared() -> None:
    cache = KvCache(SHAPE)
    write(cache, "a", [1, 2, 3, 4, 5, 6])
    assert write(cache, "b", [1, 2, 3, 4, 5, 6, 7]) == 4  # not the 5, 6 of a's second block
    assert cache._blocks["a"][1] != cache._blocks["b"][1]


def test_decoded_tokens_fill_blocks_that_are_keyed_too() -> None:
    cache = KvCache(SHAPE)
    tokens = [1, 2, 3]
    write(cache, "a", tokens)
    for token in (4, 5, 6, 7, 8):  # decode steps, one token each
        cache.reserve("a", len(tokens) + 1)
        keys, values = kv([*tokens, token], len(tokens), len(tokens) + 1)
        cache.append("a", keys, values, [token])
        tokens.append(token)
    cache.release("a")
    assert cache.cached_blocks == 2 and cache.used_blocks == 0
    assert write(cache, "b", [*tokens, 9]) == 8


def test_released_blocks_stay_cached_until_needed_then_go_oldest_first() -> None:
    cache = KvCache(SHAPE)  # 8 blocks
    write(cache, "a", [1] * 8 + [2])  # 3 blocks; 2 full ones keyed
    write(cache, "b", [3] * 8 + [4])
    a_blocks = cache._blocks["a"][:2]
    cache.release("a")  # a's tail first: its second block is the older
    cache.release("b")
    assert cache.cached_blocks == 4 and cache.free_blocks == 8 and cache.used_blocks == 0
    cache.reserve("big", 4 * 5)  # 5 blocks: 4 free ones, then the oldest cached one
    assert cache.stats.evictions == 1
    assert a_blocks[1] in cache._blocks["big"]  # a's tail went first ...
    assert write(cache, "again", [1] * 8 + [5]) == 4  # ... its head is still cached
    with pytest.raises(KvCacheFull):
        write(cache, "more", [7] * 12)  # 3 blocks, 2 left: nothing taken
    assert "more" not in cache.sequences()


def test_a_prompt_cached_whole_copies_its_last_block_before_writing_it() -> None:
    cache = KvCache(SHAPE)
    a = list(range(1, 9))  # exactly two blocks
    write(cache, "a", a)
    # The same prompt: its last token is computed again (its logits start the generation),
    # into a copy of the last block; the first block is shared.
    assert write(cache, "b", a) == 7
    assert cache.stats.copies == 1
    assert cache._blocks["b"][0] == cache._blocks["a"][0]
    assert cache._blocks["b"][1] != cache._blocks["a"][1]
    assert cache.refs[cache._blocks["a"][1]] == 1
    assert_holds(cache, "a", a)
    assert_holds(cache, "b", a)


def test_writing_into_a_shared_block_is_refused() -> None:
    cache = KvCache(SHAPE)
    write(cache, "a", [1, 2, 3, 4, 5])
    cache._lengths["a"] = 2  # as if it would write into its full, keyed first block
    keys, values = kv([1, 2, 3], 2, 3)
    with pytest.raises(RuntimeError, match="shared block"):
        cache.append("a", keys, values, [3])


def test_with_prefix_caching_off_nothing_is_kept_or_shared() -> None:
    cache = KvCache(SHAPE, prefix_caching=False)
    write(cache, "a", [1] * 9)
    assert write(cache, "b", [1] * 9) == 0
    cache.release("a")
    cache.release("b")
    assert cache.cached_blocks == 0 and len(cache._free) == 8
    assert cache.stats.hit_tokens == 0


@settings(max_examples=150, deadline=None)
@given(
    blocks=st.integers(4, 12),
    operations=st.lists(
        st.tuples(
            st.sampled_from(["admit", "grow", "release"]),
            st.integers(0, 2),  # which base prompt (for admit) or sequence (otherwise)
            st.lists(st.integers(0, 3), max_size=7),  # the rest of a prompt
            st.integers(0, 9),  # how many of the base's 9 tokens
        ),
        max_size=40,
    ),
)
def test_random_operations_never_corrupt_a_sequence(
    blocks: int, operations: list[tuple[str, int, list[int], int]]
) -> None:
    cache = KvCache(KvShape(layers=2, heads=1, head_dim=3, block_tokens=4, total_blocks=blocks))
    bases = [[1] * 9, [1] * 4 + [2] * 5, [3, 1, 4, 1, 5, 9, 2, 6, 5]]
    live: dict[str, list[int]] = {}
    for n, (op, pick, rest, keep) in enumerate(operations):
        names = sorted(live)
        try:
            if op == "admit":
                tokens = bases[pick][:keep] + rest or [7]
                write(cache, f"s{n}", tokens)
                live[f"s{n}"] = tokens
            elif op == "grow" and names:
                name = names[pick % len(names)]
                tokens = live[name]
                cache.reserve(name, len(tokens) + 1)
                token = rest[0] if rest else 0
                keys, values = kv([*tokens, token], len(tokens), len(tokens) + 1)
                cache.append(name, keys, values, [token])
                tokens.append(token)
            elif op == "release" and names:
                name = names[pick % len(names)]
                del live[name]
                cache.release(name)
        except KvCacheFull:
            pass  # nothing was taken; the live sequences are checked below all the same
        holders = [0] * blocks
        for name in live:
            for block in cache._blocks[name]:
                holders[block] += 1
        assert holders == cache.refs
        free, cached = set(cache._free), set(cache._cached)
        assert not free & cached and all(holders[b] == 0 for b in free | cached)
        assert len(free) + len(cached) + sum(1 for h in holders if h) == blocks
        for name, tokens in live.items():
            assert_holds(cache, name, tokens)
    for name in list(live):
        cache.release(name)
    assert cache.used_blocks == 0 and cache.free_blocks == blocks


def test_sharing_never_needs_more_blocks_than_computing() -> None:
    cache = KvCache(KvShape(layers=2, heads=1, head_dim=3, block_tokens=4, total_blocks=2))
    a = [1, 2, 3, 4]
    write(cache, "a", a)
    cache.release("a")
    # Copying the cached block would need a third block while the copy is made: the prompt
    # is computed again in the two there are (its block evicted) rather than wait forever.
    assert write(cache, "b", a) == 0
    assert cache.stats.copies == 0 and cache.stats.evictions == 1
    assert_holds(cache, "b", a)
