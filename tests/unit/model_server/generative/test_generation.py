"""Continuous batching over the block KV cache, with a decoder whose answers prove the plumbing.

The fake decoder's next token is (sum of every token seen + how many) mod 49, computed from the
keys/values it is given (past and new) under the attention mask: a wrongly gathered, padded or
positioned cache changes the answer, and a position id that does not continue the sequence
makes it answer EOS (49).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import pytest

from model_server.core.errors import InferenceError, InvalidInput
from model_server.generative.engine import (
    GenerationEngine,
    GenerationRequest,
    KvBudgetExhausted,
    TokenEvent,
)
from model_server.generative.kv_cache import KvCache, KvShape
from model_server.generative.sampling import sample

VOCAB, EOS = 50, 49


def fake_decoder(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    ids, mask, positions = feeds["input_ids"], feeds["attention_mask"], feeds["position_ids"]
    batch, n = ids.shape
    new_k = np.stack([ids, positions], axis=-1).astype(np.float32)[:, None]  # [b, 1, n, 2]
    new_v = np.stack([ids, np.ones_like(ids)], axis=-1).astype(np.float32)[:, None]
    keys = np.concatenate([feeds["past_key_values.0.key"], new_k], axis=2)
    values = np.concatenate([feeds["past_key_values.0.value"], new_v], axis=2)
    past = keys.shape[2] - n
    logits = np.zeros((batch, n, VOCAB), np.float32)
    for b in range(batch):
        for q in range(n):
            seen = mask[b, : past + q + 1].astype(bool)
            total = values[b, 0, : past + q + 1][seen].sum(axis=0)  # (sum of ids, count)
            expected_position = total[1] - 1
            good = positions[b, q] == expected_position
            logits[b, q, int(total[0] + total[1]) % EOS if good else EOS] = 10.0
    return {"logits": logits, "present.0.key": keys, "present.0.value": values}


def expected_tokens(prompt: tuple[int, ...], count: int) -> list[int]:
    seen, out = list(prompt), []
    for _ in range(count):
        token = (sum(seen) + len(seen)) % EOS
        out.append(token)
        seen.append(token)
    return out


def engine(blocks: int = 64, when_full: str = "wait", **kw: Any) -> GenerationEngine:
    pool = ThreadPoolExecutor(max_workers=1)
    loop = asyncio.get_running_loop()
    cache = KvCache(KvShape(layers=1, heads=1, head_dim=2, block_tokens=4, total_blocks=blocks))
    e = GenerationEngine(
        fake_decoder, cache, lambda job: loop.run_in_executor(pool, job), EOS, 256,
        when_full=when_full, **kw,
    )  # fmt: skip
    e.start()
    return e


async def collect(e: GenerationEngine, request: GenerationRequest) -> list[TokenEvent]:
    return [event async for event in e.generate(request)]


async def test_one_sequence_generates_what_recomputation_would() -> None:
    e = engine()
    events = await collect(e, GenerationRequest((3, 1, 4), max_tokens=6))
    assert [ev.token for ev in events] == expected_tokens((3, 1, 4), 6)
    assert [ev.final for ev in events] == [False] * 5 + [True]
    assert events[-1].finish_reason == "length"
    assert e.cache.used_blocks == 0
    await e.stop()


async def test_concurrent_sequences_of_different_lengths_batch_correctly() -> None:
    e = engine()
    prompts = [tuple(range(1, n + 1)) for n in (1, 5, 9, 2, 13)]
    results = await asyncio.gather(*(collect(e, GenerationRequest(p, 8)) for p in prompts))
    for prompt, events in zip(prompts, results, strict=True):
        assert [ev.token for ev in events] == expected_tokens(prompt, 8), prompt
    assert e.cache.used_blocks == 0 and e.stats.sequences_done == 5
    await e.stop()


async def test_a_steady_batch_decodes_from_the_last_steps_outputs_without_a_gather() -> None:
    """Sequences of different lengths, one of them ending early: steps whose batch did not
    change reuse the last step's keys and values (the fake decoder checks every column and
    position); a step after a sequence left gathers again from the pool."""
    observed: dict[str, float] = {}
    e = engine(observe=lambda what, n: observed.update({what: observed.get(what, 0) + n}))
    prompts = [tuple(range(1, n + 1)) for n in (3, 7, 10)]
    budgets = (12, 12, 5)
    gathers = 0
    gather = e.cache.gather

    def counted(names: list[str]) -> Any:
        nonlocal gathers
        gathers += 1
        return gather(names)

    e.cache.gather = counted  # type: ignore[method-assign,assignment]
    results = await asyncio.gather(
        *(collect(e, GenerationRequest(p, n)) for p, n in zip(prompts, budgets, strict=True))
    )
    for prompt, n, events in zip(prompts, budgets, results, strict=True):
        assert [ev.token for ev in events] == expected_tokens(prompt, n), prompt
    steps, carried = e.stats.decode_steps, observed["decode_step_carried"]
    assert steps >= 11 and carried >= steps - 4, (steps, carried)
    assert gathers == steps - carried + 3  # and one per prefill
    assert observed["decode_step_gathered"] == steps - carried  # the metric's other series
    await e.stop()


async def test_stop_sequences_and_eos_end_early() -> None:
    e = engine()
    full = expected_tokens((7,), 6)
    events = await collect(e, GenerationRequest((7,), 6, stop=(tuple(full[2:4]),)))
    assert [ev.token for ev in events] == full[:4] and events[-1].finish_reason == "stop"
    await e.stop()


async def test_a_consumer_that_leaves_gives_its_blocks_back() -> None:
    e = engine()
    stream = e.generate(GenerationRequest((1, 2, 3), max_tokens=40))
    assert (await anext(stream)).index == 0
    await stream.aclose()  # the client went away
    other = await collect(e, GenerationRequest((5,), 3))  # the engine goes on ...
    assert [ev.token for ev in other] == expected_tokens((5,), 3)
    assert e.cache.used_blocks == 0  # ... and nothing leaked
    await e.stop()


async def test_when_full_new_sequences_wait_and_running_ones_finish() -> None:
    e = engine(blocks=6)  # 24 tokens of cache
    requests = [GenerationRequest((i + 1,) * 6, max_tokens=10) for i in range(4)]  # 16 each
    results = await asyncio.gather(*(collect(e, r) for r in requests))
    for request, events in zip(requests, results, strict=True):
        assert [ev.token for ev in events] == expected_tokens(request.prompt, 10)
    # Two start together (2 blocks each) and cannot both grow to 4: one is preempted and
    # recomputed later, and its tokens are still right.
    assert e.stats.preempted >= 1
    assert e.cache.used_blocks == 0
    await e.stop()


async def test_when_full_new_sequences_may_be_refused_instead() -> None:
    e = engine(blocks=6, when_full="reject")
    first = e.generate(GenerationRequest((1,) * 14, max_tokens=8))  # 4 blocks at first
    await anext(first)
    with pytest.raises(KvBudgetExhausted, match="KV cache full") as raised:
        await collect(e, GenerationRequest((2,) * 12, max_tokens=4))
    assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    rest = [ev async for ev in first]
    assert rest[-1].final and e.stats.refused == 1
    await e.stop()


async def test_requests_that_can_never_fit_or_make_sense_are_refused() -> None:
    e = engine(blocks=2)
    with pytest.raises(KvBudgetExhausted, match="more than the cache's 2"):
        await collect(e, GenerationRequest((1,) * 6, max_tokens=6))
    for bad, words in [
        (GenerationRequest(()), "the prompt is empty"),
        (GenerationRequest((1,), max_tokens=0), "max_tokens must be >= 1"),
        (GenerationRequest((1,) * 250, max_tokens=10), "exceeds the model's 256 positions"),
        (GenerationRequest((1,), temperature=-1), "must be >= 0"),
    ]:
        with pytest.raises(InvalidInput, match=words):
            await collect(e, bad)
    await e.stop()


def test_sampling_greedy_temperature_and_top_k() -> None:
    logits = np.array([0.0, 5.0, 4.9, -3.0])
    rng = np.random.default_rng(0)
    assert sample(logits, GenerationRequest((1,)), rng) == 1
    picks = {
        sample(logits, GenerationRequest((1,), temperature=1.0, top_k=2), rng) for _ in range(200)
    }
    assert picks == {1, 2}
    tied = np.array([5.0, 5.0, 5.0, 5.0, 0.0, 0.0])  # fp16 or quantized logits tie often
    for k, expected in ((1, {0}), (2, {0, 1})):
        request = GenerationRequest((1,), temperature=1.0, top_k=k)
        assert {sample(tied, request, rng) for _ in range(200)} == expected
    again = [
        sample(logits, GenerationRequest((1,), temperature=2.0), np.random.default_rng(3))
        for _ in range(5)
    ]
    assert again == [
        sample(logits, GenerationRequest((1,), temperature=2.0), np.random.default_rng(3))
        for _ in range(5)
    ]


def test_a_tiny_temperature_samples_the_most_likely_token_instead_of_nan() -> None:
    """Logits over 1e-320 overflow to infinities; inf - inf was NaN, and rng.choice raised."""
    logits = np.array([0.0, 5.0, 4.9, -3.0], np.float32)
    for temperature in (1e-320, 5e-324, 1e-300):
        request = GenerationRequest((1,), temperature=temperature, top_p=0.5, top_k=3)
        assert sample(logits, request, np.random.default_rng(0)) == 1


async def test_a_tiny_temperature_does_not_fail_the_sequences_beside_it() -> None:
    e = engine()
    tiny, plain = await asyncio.gather(
        collect(e, GenerationRequest((3, 1, 4), max_tokens=6, temperature=1e-320)),
        collect(e, GenerationRequest((2, 7), max_tokens=6)),
    )
    assert [ev.token for ev in tiny] == expected_tokens((3, 1, 4), 6)  # the greedy choice
    assert [ev.token for ev in plain] == expected_tokens((2, 7), 6)


async def test_a_sampling_error_fails_its_own_sequence_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whatever one request's parameters do to sampling, the batch it ran in goes on."""
    import model_server.generative.engine as engine_module

    real = engine_module.sample

    def broken_for_one(logits: np.ndarray, request: GenerationRequest, rng: Any) -> int:
        if request.temperature == 0.5:
            raise ValueError("probabilities contain NaN")
        return real(logits, request, rng)

    monkeypatch.setattr(engine_module, "sample", broken_for_one)
    e = engine(blocks=8)
    bad, good = await asyncio.gather(
        collect(e, GenerationRequest((3, 1, 4), max_tokens=6, temperature=0.5)),
        collect(e, GenerationRequest((2, 7), max_tokens=6)),
        return_exceptions=True,
    )
    assert isinstance(bad, InferenceError) and "sampling failed" in bad.message
    assert not isinstance(good, BaseException)
    assert [ev.token for ev in good] == expected_tokens((2, 7), 6)
    assert e.cache.free_blocks == 8  # the failed sequence's blocks went back


async def test_unseeded_samples_differ_and_seeded_ones_repeat() -> None:
    """Without a seed each sequence draws fresh entropy (it was seed 0: every unseeded call
    sampled the same text); with one, the same seed gives the same tokens."""
    e = engine()

    async def tokens(seed: int | None) -> list[int]:
        request = GenerationRequest((3, 1, 4), max_tokens=32, temperature=3.0, seed=seed)
        return [ev.token for ev in await collect(e, request)]

    unseeded = {tuple(await tokens(None)) for _ in range(3)}
    assert len(unseeded) > 1  # each token is the likeliest with p 0.36 at this temperature
    assert await tokens(7) == await tokens(7)


def test_top_p_or_top_k_at_temperature_zero_is_refused_not_ignored() -> None:
    for request, name in [
        (GenerationRequest((1,), top_p=0.5), "top_p"),
        (GenerationRequest((1,), top_k=2), "top_k"),
    ]:
        with pytest.raises(InvalidInput, match=f"^{name} narrows"):
            request.check(64)
    GenerationRequest((1,), top_p=1.0, top_k=0).check(64)  # the neutral values pass
    GenerationRequest((1,), temperature=0.7, top_p=0.5, top_k=2).check(64)


async def test_a_failed_scheduler_fails_its_sequences_instead_of_leaving_them_waiting() -> None:
    pool = ThreadPoolExecutor(max_workers=1)
    loop = asyncio.get_running_loop()
    cache = KvCache(KvShape(layers=1, heads=1, head_dim=2, block_tokens=4, total_blocks=8))

    def no_cache_outputs(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"logits": fake_decoder(feeds)["logits"]}  # a decoder without present.*

    e = GenerationEngine(
        no_cache_outputs, cache, lambda job: loop.run_in_executor(pool, job), EOS, 256
    )
    e.start()
    with pytest.raises(InferenceError, match="the generation engine failed"):
        await collect(e, GenerationRequest((1, 2), max_tokens=3))
    assert e.cache.used_blocks == 0
    await e.stop()
