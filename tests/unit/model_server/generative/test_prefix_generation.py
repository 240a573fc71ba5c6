"""Generation with prefix caching on equals generation with it off: random prompts sharing
prefixes, random KV budgets that force evictions and preemptions, prefills batched or alone;
with the exact decoder of test_generation (every token checked against recomputation) and
with the demo LM on ONNX Runtime."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model_server.demo_lm import build_demo_lm, output_names
from model_server.generative.engine import Decoder, GenerationEngine, GenerationRequest
from model_server.generative.kv_cache import KvCache, KvShape, PrefixStats
from model_server.generative.lm_reference import DEFAULT_CONFIG, EOS_ID
from model_server.generative.step_past import PastKeeper
from tests.unit.model_server.generative.test_generation import EOS, expected_tokens, fake_decoder

Waves = list[list[GenerationRequest]]


class AlwaysGather(PastKeeper):
    """Gathers every decode step's past from the pool, never reusing the last step's outputs."""

    def keep(self, *args: Any) -> None:
        pass


async def run_waves(
    decoder: Decoder,
    shape: KvShape,
    eos: int,
    waves: Waves,
    prefix: bool,
    rows: int,
    running: int,
    carry: bool = True,
) -> tuple[list[list[int]], PrefixStats, int]:
    """Each wave's requests together, one wave after the other: their tokens, the cache's
    prefix counters and the preemptions. ``carry`` False: every step gathers."""
    pool = ThreadPoolExecutor(max_workers=1)
    loop = asyncio.get_running_loop()
    cache = KvCache(shape, prefix_caching=prefix)
    engine = GenerationEngine(
        decoder, cache, lambda job: loop.run_in_executor(pool, job), eos, 512,
        max_running=running, max_prefill_rows=rows,
    )  # fmt: skip
    if not carry:
        engine.step_past = AlwaysGather(cache)
    engine.start()

    async def tokens(request: GenerationRequest) -> list[int]:
        return [event.token async for event in engine.generate(request)]

    out: list[list[int]] = []
    try:
        for wave in waves:  # a stuck engine fails the test rather than hang it
            out += await asyncio.wait_for(asyncio.gather(*(tokens(r) for r in wave)), 20)
    finally:
        await engine.stop()
        pool.shutdown()
    assert cache.used_blocks == 0 and cache.sequences() == []  # nothing held ...
    assert cache.free_blocks == shape.total_blocks  # ... and every cached block reclaimable
    return out, cache.stats, engine.stats.preempted


def prompts(base_tokens: st.SearchStrategy[int], longest: int) -> st.SearchStrategy[Waves]:
    """Waves of requests whose prompts start with one of three random bases."""

    @st.composite
    def build(draw: st.DrawFn) -> Waves:
        bases = [draw(st.lists(base_tokens, min_size=1, max_size=longest)) for _ in range(3)]
        request = st.builds(
            lambda base, keep, rest, n: GenerationRequest(
                tuple(bases[base][:keep] + rest) or (1,), max_tokens=n
            ),
            st.integers(0, 2),
            st.integers(0, longest),
            st.lists(base_tokens, max_size=6),
            st.integers(1, 8),
        )
        return draw(st.lists(st.lists(request, min_size=1, max_size=5), min_size=1, max_size=3))

    return build()


def budget(waves: Waves, block_tokens: int, extra: int) -> int:
    """The fewest blocks that fit the longest sequence, plus ``extra``."""
    longest = max(len(r.prompt) + r.max_tokens for wave in waves for r in wave)
    return -(-longest // block_tokens) + extra


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    waves=prompts(st.integers(0, 48), 14),
    extra=st.integers(0, 6),
    rows=st.integers(1, 4),
    running=st.integers(1, 6),
)
def test_outputs_are_the_same_with_the_cache_on_and_off(
    waves: Waves, extra: int, rows: int, running: int
) -> None:
    shape = KvShape(1, 1, 2, block_tokens=4, total_blocks=budget(waves, 4, extra))
    on, _, _ = asyncio.run(run_waves(fake_decoder, shape, EOS, waves, True, rows, running))
    off, stats, _ = asyncio.run(run_waves(fake_decoder, shape, EOS, waves, False, rows, running))
    expected = [expected_tokens(r.prompt, r.max_tokens) for wave in waves for r in wave]
    assert on == expected and off == expected
    assert stats.hit_tokens == 0


def test_shared_prefixes_hit_evict_and_preempt_without_changing_a_token() -> None:
    base = tuple(range(1, 30))
    first = [GenerationRequest((*base, i), max_tokens=12) for i in range(3)]
    later = [GenerationRequest((*base[:20], 40 + i), max_tokens=12) for i in range(4)]
    # 4 sequences of 11 blocks, up to 7 shared (a wave waits for its first prefill): 14 blocks
    # are still too few for all of them to grow, so some are preempted.
    shape = KvShape(1, 1, 2, block_tokens=4, total_blocks=14)
    waves = [first, later, first]
    on, stats, preempted = asyncio.run(run_waves(fake_decoder, shape, EOS, waves, True, 4, 4))
    assert on == [expected_tokens(r.prompt, 12) for wave in waves for r in wave]
    assert stats.hit_tokens >= 7 * 16 and stats.evictions > 0 and preempted > 0


@pytest.fixture(scope="module")
def demo_lm(tmp_path_factory: pytest.TempPathFactory) -> Decoder:
    path = build_demo_lm(tmp_path_factory.mktemp("lm"))
    session = ort.InferenceSession(str(Path(path)), providers=["CPUExecutionProvider"])
    names = output_names(DEFAULT_CONFIG.layers)

    def decode(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, session.run(names, dict(feeds)), strict=True))

    return decode


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    waves=prompts(st.integers(32, 126), 40),
    extra=st.integers(0, 12),
    rows=st.integers(1, 4),
)
def test_the_demo_lm_generates_the_same_with_the_cache_on_and_off(
    demo_lm: Decoder, waves: Waves, extra: int, rows: int
) -> None:
    c = DEFAULT_CONFIG
    shape = KvShape(c.layers, c.heads, c.head_dim, 8, budget(waves, 8, extra))
    on, _, _ = asyncio.run(run_waves(demo_lm, shape, EOS_ID, waves, True, rows, 4))
    off, _, _ = asyncio.run(run_waves(demo_lm, shape, EOS_ID, waves, False, rows, 4))
    gathered, _, _ = asyncio.run(
        run_waves(demo_lm, shape, EOS_ID, waves, True, rows, 4, carry=False)
    )
    assert on == off == gathered  # nor with each step's past gathered from the pool
