"""Admission: identical prompts arriving together share their blocks (the second waits one
round for the first's prefill), FIFO, and ``kv_when_full: reject`` refuses instead of making
a request wait, counting what the waiting sequences need and nothing for departed ones.

The engine's offload runs each model call on the event loop after a hook, so a test can act
at a chosen point: a client leaving during the first prefill, a request arriving between
another's check and admission."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from model_server.core.errors import InferenceError
from model_server.generative.engine import (
    Decoder,
    GenerationEngine,
    GenerationRequest,
    KvBudgetExhausted,
)
from model_server.generative.kv_cache import KvCache, KvShape
from tests.unit.model_server.generative.test_generation import EOS, expected_tokens, fake_decoder

Hook = Callable[[int], Awaitable[None]]  # called with the model call's number, from 1


def make(
    blocks: int,
    decoder: Decoder = fake_decoder,
    hook: Hook | None = None,
    prefix: bool = True,
    **kw: Any,
) -> GenerationEngine:
    cache = KvCache(KvShape(1, 1, 2, block_tokens=4, total_blocks=blocks), prefix_caching=prefix)
    calls = 0

    async def offload(job: Callable[[], Mapping[str, np.ndarray]]) -> Mapping[str, np.ndarray]:
        nonlocal calls
        calls += 1
        if hook is not None:
            await hook(calls)
        return job()

    engine = GenerationEngine(decoder, cache, offload, EOS, 256, **kw)
    engine.start()
    return engine


async def tokens(engine: GenerationEngine, request: GenerationRequest) -> list[int]:
    stream = engine.generate(request)
    return await asyncio.wait_for(_drain(stream), 10)  # a stuck engine fails, not hangs


async def _drain(stream: Any) -> list[int]:
    return [event.token async for event in stream]


async def arrive(engine: GenerationEngine, request: GenerationRequest) -> asyncio.Task[list[int]]:
    """A request's task, once the engine has it waiting (or has answered it)."""
    before = len(engine.waiting)
    task = asyncio.create_task(tokens(engine, request))
    for _ in range(10):
        await asyncio.sleep(0)
        if task.done() or len(engine.waiting) > before:
            break
    return task


async def burst(
    requests: list[GenerationRequest], prefix: bool
) -> tuple[list[list[int]], int, list[str], int]:
    """The requests arriving together: their tokens, the most blocks held at a model call,
    the order the cache admitted them in and the prompt tokens it had cached."""
    engine, peak, order = make(32, prefix=prefix), 0, []
    admit, decoder = engine.cache.admit, engine._decoder

    def admitting(sequence: str, tokens: Sequence[int], room: int) -> int:
        order.append(sequence)
        return admit(sequence, tokens, room)

    def counting(feeds: dict[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        nonlocal peak
        peak = max(peak, engine.cache.used_blocks)
        return decoder(feeds)

    engine.cache.admit = admitting  # type: ignore[method-assign]
    engine._decoder = counting
    results = await asyncio.gather(*(tokens(engine, r) for r in requests))
    await engine.stop()
    return results, peak, order, engine.cache.stats.hit_tokens


async def test_identical_prompts_arriving_together_share_the_first_ones_blocks() -> None:
    """Three streams of one 13-token prompt (3 full blocks and a token) and another prompt
    among them: the first computes the prompt, the other two wait for its prefill and share
    its 3 full blocks, the other prompt does not pass them, and every token is what the
    cache off gives."""
    prompt, other = tuple(range(1, 14)), tuple(range(20, 27))
    requests = [GenerationRequest(p, max_tokens=3) for p in (prompt, prompt, other, prompt)]
    on, peak_on, order, hits = await burst(requests, prefix=True)
    off, peak_off, _, _ = await burst(requests, prefix=False)
    assert on == off == [expected_tokens(r.prompt, 3) for r in requests]
    assert order == ["seq-0", "seq-1", "seq-2", "seq-3"]  # FIFO
    assert hits == 2 * 12  # both later copies: 3 blocks each
    # Blocks held at the busiest model call: with the cache on, the 4 of the first copy, 1 of
    # each later one and the other prompt's 2; off, 4 per copy and the other's 3 (its decode
    # step 2 comes while they all still run).
    assert (peak_on, peak_off) == (4 + 1 + 1 + 2, 4 + 4 + 4 + 3)


@pytest.mark.parametrize("first", ["fails", "leaves"])
async def test_a_sequence_waiting_for_a_prefix_goes_on_whatever_became_of_the_first(
    first: str,
) -> None:
    """The first's prefill fails (nothing is cached: the second computes the prompt itself) or
    its client leaves during it (its blocks were written: the second shares them)."""
    prompt = tuple(range(1, 14))
    calls = 0

    def decoder(feeds: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        nonlocal calls
        calls += 1
        if calls == 1 and first == "fails":
            raise RuntimeError("the model failed")
        return fake_decoder(feeds)

    async def hook(call: int) -> None:
        if call == 1 and first == "leaves":
            leaving.cancel()
            await asyncio.gather(leaving, return_exceptions=True)  # it has left

    engine = make(32, decoder, hook)
    leaving = asyncio.create_task(tokens(engine, GenerationRequest(prompt, 3)))
    staying = asyncio.create_task(tokens(engine, GenerationRequest(prompt, 3)))
    outcome = (await asyncio.gather(leaving, return_exceptions=True))[0]
    assert await staying == expected_tokens(prompt, 3)
    if first == "fails":
        assert isinstance(outcome, InferenceError) and "prefill failed" in outcome.message
        assert engine.cache.stats.hit_tokens == 0
    else:
        assert isinstance(outcome, asyncio.CancelledError)
        assert engine.cache.stats.hit_tokens == 12
    assert engine.cache.used_blocks == 0
    await engine.stop()


async def test_reject_counts_what_requests_arriving_together_need() -> None:
    """Two requests arriving in one tick both run when their blocks fit together (before, the
    second was refused whenever the first was still waiting), and the second is refused at
    once when they do not."""
    engine = make(8, when_full="reject")
    small = [GenerationRequest((i,) * 9, max_tokens=3) for i in (1, 2)]  # 3 blocks each
    assert await asyncio.gather(*(tokens(engine, r) for r in small)) == [
        expected_tokens(r.prompt, 3) for r in small
    ]
    large = [GenerationRequest((i,) * 18, max_tokens=3) for i in (3, 4)]  # 5 blocks each
    done, refused = await asyncio.gather(
        *(tokens(engine, r) for r in large), return_exceptions=True
    )
    assert done == expected_tokens(large[0].prompt, 3)
    assert isinstance(refused, KvBudgetExhausted) and "KV cache full" in refused.message
    assert "(5 for sequences waiting)" in refused.message and engine.stats.refused == 1
    await engine.stop()


async def test_reject_ignores_a_waiting_sequence_whose_client_left() -> None:
    """One running sequence (``max_running`` 1), one waiting whose client left: a new request
    fits beside the running one and is served, not refused for the departed one."""
    tasks: list[asyncio.Task[list[int]]] = []
    later = GenerationRequest((3,) * 11, max_tokens=4)  # 3 blocks, as the departed one

    async def hook(call: int) -> None:
        if call == 1:  # the first sequence's prefill
            tasks.append(await arrive(engine, GenerationRequest((2,) * 11, max_tokens=4)))
            tasks[0].cancel()
            await asyncio.gather(tasks[0], return_exceptions=True)
            tasks.append(await arrive(engine, later))

    engine = make(6, hook=hook, when_full="reject", max_running=1)
    first = await tokens(engine, GenerationRequest((1,) * 5, max_tokens=6))
    assert first == expected_tokens((1,) * 5, 6)
    assert await tasks[1] == expected_tokens(later.prompt, 4)
    assert tasks[0].cancelled() and engine.stats.refused == 0
    await engine.stop()


async def test_reject_refuses_a_sequence_whose_blocks_went_before_its_admission() -> None:
    """B arrives during C's prefill and needs every free block; the decode step after that
    prefill gives the running A its second block first. B is refused, not left waiting."""
    tasks: list[asyncio.Task[list[int]]] = []
    c = GenerationRequest((2,) * 7, max_tokens=4)  # 2 blocks, then 3
    b = GenerationRequest((3,) * 11, max_tokens=2)  # 3 blocks: all that is free then
    waited: list[bool] = []  # each passed the check on arrival

    async def hook(call: int) -> None:
        if call in (1, 3):  # A's prefill, then C's (after A's first decode step)
            tasks.append(await arrive(engine, c if call == 1 else b))
            waited.append(not tasks[-1].done())

    engine = make(6, hook=hook, when_full="reject")
    a = await tokens(engine, GenerationRequest((1,) * 3, max_tokens=6))  # 1 block, then 2
    assert a == expected_tokens((1,) * 3, 6)
    assert await tasks[0] == expected_tokens(c.prompt, 4)
    with pytest.raises(KvBudgetExhausted, match="KV cache full"):
        await tasks[1]
    assert waited == [True, True]
    assert engine.stats.refused == 1 and engine.cache.used_blocks == 0
    await engine.stop()


async def test_reject_never_refuses_a_preempted_sequence() -> None:
    """Two sequences that cannot both grow: the newer is preempted and, when it does not fit
    again at once, waits for its blocks (it has streamed tokens) instead of being refused."""
    engine = make(4, when_full="reject")  # 16 tokens
    requests = [GenerationRequest((i,) * 3, max_tokens=12) for i in (1, 2)]  # 4 blocks each
    results = await asyncio.gather(*(tokens(engine, r) for r in requests))
    assert results == [expected_tokens(r.prompt, 12) for r in requests]
    assert engine.stats.preempted >= 1 and engine.stats.refused == 0
    await engine.stop()
