"""The block KV cache: reservations under a budget, exact data round trips, no leaks."""

from __future__ import annotations

import random

import numpy as np
import pytest

from model_server.generative.kv_cache import KvCache, KvCacheFull, KvShape

SHAPE = KvShape(layers=2, heads=2, head_dim=3, block_tokens=4, total_blocks=8)


def tokens(seed: int, n: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    keys = [rng.random((2, n, 3), dtype=np.float32) for _ in range(2)]
    values = [rng.random((2, n, 3), dtype=np.float32) for _ in range(2)]
    return keys, values


def test_blocks_follow_the_length_and_come_back() -> None:
    cache = KvCache(SHAPE)
    cache.reserve("a", 5)  # two blocks of four
    assert (cache.used_blocks, cache.free_blocks) == (2, 6)
    cache.reserve("a", 8)  # still two
    assert cache.used_blocks == 2
    cache.reserve("a", 9)
    assert cache.used_blocks == 3
    assert cache.release("a") == 3 and cache.used_blocks == 0
    assert cache.release("a") == 0  # twice is harmless


def test_a_reservation_that_does_not_fit_takes_nothing() -> None:
    cache = KvCache(SHAPE)
    cache.reserve("a", 20)  # five blocks
    with pytest.raises(KvCacheFull, match="b: needs 4 more KV blocks, 3 free of 8"):
        cache.reserve("b", 16)
    assert cache.used_blocks == 5 and "b" not in cache.sequences()
    with pytest.raises(KvCacheFull):
        cache.reserve("a", 36)  # a running sequence that cannot grow keeps what it has
    assert cache.used_blocks == 5 and cache.length("a") == 0


def test_gather_returns_what_was_appended_left_padded() -> None:
    cache = KvCache(SHAPE)
    ka, va = tokens(1, 6)
    kb, vb = tokens(2, 3)
    cache.reserve("a", 6)
    cache.reserve("b", 3)
    cache.append("a", [k[:, :5] for k in ka], [v[:, :5] for v in va])  # a prefill ...
    cache.append("a", [k[:, 5:] for k in ka], [v[:, 5:] for v in va])  # ... then one token
    cache.append("b", kb, vb)
    keys, values, longest = cache.gather(["a", "b"])
    assert longest == 6 and keys[0].shape == (2, 2, 6, 3)
    for layer in range(2):
        np.testing.assert_array_equal(keys[layer][0], ka[layer])
        np.testing.assert_array_equal(values[layer][0], va[layer])
        np.testing.assert_array_equal(keys[layer][1, :, 3:], kb[layer])  # padded on the left
        assert not keys[layer][1, :, :3].any()


def test_append_past_the_reservation_is_refused() -> None:
    cache = KvCache(SHAPE)
    cache.reserve("a", 4)
    k, v = tokens(3, 5)
    with pytest.raises(KvCacheFull, match="past its reservation"):
        cache.append("a", k, v)
    assert cache.length("a") == 0


def test_a_thousand_sequences_leave_no_block_behind() -> None:
    cache = KvCache(SHAPE)
    rng = random.Random(7)
    live: list[str] = []
    for i in range(1000):
        name = f"s{i}"
        try:
            cache.reserve(name, rng.randint(1, 12))
            live.append(name)
        except KvCacheFull:
            pass
        if live and rng.random() < 0.6:  # finished, cancelled or disconnected: all the same
            cache.release(live.pop(rng.randrange(len(live))))
        held = sum(cache.blocks_for(1) for _ in live)  # at least a block each
        assert cache.used_blocks >= held
        assert cache.used_blocks + cache.free_blocks == SHAPE.total_blocks
    for name in list(cache.sequences()):
        cache.release(name)
    assert cache.used_blocks == 0 and cache.sequences() == []


def test_padding_is_zero_when_every_block_holds_data() -> None:
    cache = KvCache(SHAPE)  # 8 blocks of 4 tokens
    ka, va = tokens(4, 28)
    kb, vb = tokens(5, 3)
    cache.reserve("a", 28)  # seven blocks
    cache.reserve("b", 3)  # the eighth: no block is left empty
    cache.append("a", ka, va)
    cache.append("b", kb, vb)
    keys, values, longest = cache.gather(["b", "a"])
    assert longest == 28 and keys[1].shape == (2, 2, 28, 3)
    for layer in range(2):
        np.testing.assert_array_equal(keys[layer][1], ka[layer])
        np.testing.assert_array_equal(values[layer][0, :, 25:], vb[layer])
        assert not keys[layer][0, :, :25].any() and not values[layer][0, :, :25].any()
