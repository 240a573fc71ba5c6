"""Continuous batching for a decoder (Optimum's input/output names) over the block KV cache.

``GenerationEngine.generate(request)`` yields one ``TokenEvent`` per generated token, the last
one flagged ``final``. One scheduler task on the event loop runs the model on a worker thread:

- **Admission** (``admission.py``): a waiting sequence joins when its prompt plus one token
  fits in the KV cache, FIFO; one whose leading blocks a sequence admitted in the same round
  is about to write waits a round, to share them. When it does not fit, the sequence waits
  (``when_full="wait"``) or is refused with RESOURCE_EXHAUSTED (``"reject"``: on arrival,
  counting what the sequences waiting need, or else when its turn comes). A running
  sequence's blocks are never taken.
- **Prefill**: a new sequence shares the cached blocks of its prompt's longest cached prefix
  (``KvCache.admit``, prefix caching) and computes only the rest, alone or with up to
  ``max_prefill_rows`` other new sequences in one run (``prefill.py``: grouped by length,
  left-padded past and new tokens); their keys/values go into their blocks and each first
  token is sampled from its row's last position.
- **Decode**: every running sequence advances one token per step, together: the last token of
  each, their cached keys/values gathered left-padded (or the step before's outputs, when the
  batch did not change: ``step_past.py``), an attention mask that hides the padding, and
  position ids that continue each sequence. New sequences are prefilled between steps.
- A sequence ends at EOS, ``max_tokens``, a stop sequence, or when its consumer goes away
  (client cancelled or disconnected); its blocks go back at once.

The model is any callable from Optimum's feeds (``input_ids``, ``attention_mask``,
``position_ids``, ``past_key_values.{i}.key/.value``) to its outputs (``logits``,
``present.{i}.key/.value``), e.g. an ONNX Runtime session's run.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import grpc
import numpy as np

from model_server.core.errors import InferenceError, InvalidInput
from model_server.generative.admission import admit, blocks_to_admit
from model_server.generative.kv_cache import KvCache, KvCacheFull
from model_server.generative.prefill import prefill_groups, prefill_inputs
from model_server.generative.sampling import ignored_at_greedy, sample
from model_server.generative.step_past import PastKeeper

log = logging.getLogger(__name__)

Feeds = dict[str, np.ndarray]
Decoder = Callable[[Feeds], Mapping[str, np.ndarray]]
# Runs a blocking call off the event loop (the model's worker thread).
Offload = Callable[[Callable[[], Mapping[str, np.ndarray]]], Awaitable[Mapping[str, np.ndarray]]]


class KvBudgetExhausted(InferenceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


@dataclass(frozen=True)
class GenerationRequest:
    prompt: tuple[int, ...]
    max_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: the whole vocabulary
    seed: int | None = None  # None: fresh entropy, so unseeded samples differ call to call
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens holding this much mass
    stop: tuple[tuple[int, ...], ...] = ()  # token sequences that end the generation

    def check(self, max_positions: int) -> None:
        if not self.prompt:
            raise InvalidInput("the prompt is empty")
        if self.max_tokens < 1:
            raise InvalidInput(f"max_tokens must be >= 1, got {self.max_tokens}")
        if len(self.prompt) + self.max_tokens > max_positions:
            raise InvalidInput(
                f"prompt ({len(self.prompt)} tokens) + max_tokens ({self.max_tokens}) exceeds "
                f"the model's {max_positions} positions"
            )
        if self.temperature < 0 or self.top_k < 0:
            raise InvalidInput("temperature and top_k must be >= 0")
        if not 0 < self.top_p <= 1:
            raise InvalidInput(f"top_p must be in (0, 1], got {self.top_p}")
        if (name := ignored_at_greedy(self.temperature, self.top_p, self.top_k)) is not None:
            raise InvalidInput(
                f"{name} narrows the tokens sampled from, but temperature is 0 (greedy, the "
                f"default): set temperature above 0 for {name} to have an effect"
            )
        if self.seed is not None and self.seed < 0:
            raise InvalidInput(f"seed must be >= 0, got {self.seed}")


@dataclass(frozen=True)
class TokenEvent:
    token: int
    index: int  # 0 for the first generated token
    final: bool
    finish_reason: str = ""  # on the final event: eos, length, stop, (or an error)


@dataclass(eq=False)
class _Sequence:
    name: str
    request: GenerationRequest
    events: asyncio.Queue[TokenEvent | BaseException]
    created: float
    rng: np.random.Generator
    generated: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    gone: bool = False  # the consumer went away
    done: bool = False  # its final event (or error) was sent

    @property
    def tokens(self) -> list[int]:
        """What the model has seen: the prompt and every token generated so far."""
        return [*self.request.prompt, *self.generated]


@dataclass
class GenerationStats:
    """Counts of what the engine decided (token timings go to ``observe``, the metrics)."""

    sequences_done: int = 0
    refused: int = 0
    preempted: int = 0
    decode_steps: int = 0


class GenerationEngine:
    def __init__(
        self,
        decoder: Decoder,
        cache: KvCache,
        offload: Offload,
        eos_token: int,
        max_positions: int,
        max_running: int = 32,
        when_full: str = "wait",
        max_prefill_rows: int = 1,
        clock: Callable[[], float] = time.monotonic,
        observe: Callable[[str, float], None] = lambda what, value: None,
    ) -> None:
        self._decoder = decoder
        self.cache = cache
        self._offload = offload
        self.eos_token = eos_token
        self.max_positions = max_positions
        self.max_running = max_running
        self.when_full = when_full
        self.max_prefill_rows = max_prefill_rows  # new sequences per prefill run (1: alone)
        self._clock = clock
        self._observe = observe  # ("ttft"|"tpot", s), ("token"|"decode_step_carried|gathered", 1)
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []
        self._names = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.step_past = PastKeeper(cache)  # a decode step's past: the last step's, or gathered
        self.stats = GenerationStats()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._schedule())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for sequence in [*self.running, *self.waiting]:
            self.cache.release(sequence.name)
            self._finish(
                sequence, InferenceError("the model is unloading", grpc.StatusCode.UNAVAILABLE)
            )
        self.running, self.waiting = [], deque()

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenEvent, None]:
        """The tokens of one sequence as they are made; the last event is ``final``."""
        request.check(self.max_positions)
        total = self.cache.shape.total_blocks
        longest = self.cache.blocks_for(len(request.prompt) + request.max_tokens)
        if longest > total:
            self.stats.refused += 1
            raise KvBudgetExhausted(
                f"the sequence may need {longest} KV blocks, more than the cache's {total}"
            )
        if self.when_full == "reject":  # room for it beside what the waiting ones will take
            waiting = [s.tokens for s in self.waiting if not s.gone]  # a gone one takes none
            promised = sum(blocks_to_admit(self.cache, tokens) for tokens in waiting)
            if blocks_to_admit(self.cache, request.prompt) + promised > self.cache.free_blocks:
                self.stats.refused += 1
                raise self._full(request.prompt, promised)
        sequence = _Sequence(
            f"seq-{next(self._names)}", request, asyncio.Queue(), self._clock(),
            np.random.default_rng(request.seed),
        )  # fmt: skip
        self.waiting.append(sequence)
        self._wake.set()
        try:
            while True:
                event = await sequence.events.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if event.final:
                    return
        finally:
            if not sequence.done:  # cancelled or disconnected: its blocks go back next step
                sequence.gone = True
                self._wake.set()

    # -- the scheduler ----------------------------------------------------------------------
    async def _schedule(self) -> None:
        while True:
            admitted: list[_Sequence] = []
            try:
                self._drop_gone()
                self._wake.clear()
                admitted = self._admit()
                computed = [len(s.tokens) - self.cache.length(s.name) for s in admitted]
                for group in prefill_groups(computed, self.max_prefill_rows):
                    await self._prefill([admitted[i] for i in group])
                if self.running:
                    await self._decode()
                elif not admitted:
                    await self._wake.wait()
            except Exception as exc:  # a bug, not the model's error: its sequences fail
                self._fail([*admitted, *self.running], exc)  # (the waiting ones go on)

    def _fail(
        self, sequences: list[_Sequence], exc: Exception, what: str = "the generation engine failed"
    ) -> None:
        error = InferenceError(f"{what}: {exc!r}")
        for sequence in dict.fromkeys(sequences):
            if sequence in self.running:
                self.running.remove(sequence)
            self.cache.release(sequence.name)
            if not sequence.done:
                self._finish(sequence, error)

    def _admit(self) -> list[_Sequence]:
        slots, reject = self.max_running - len(self.running), self.when_full == "reject"
        admitted, refused = admit(self.waiting, self.cache, slots, reject)
        for sequence in refused:  # blocks went between its arrival and now
            self.stats.refused += 1
            self._finish(sequence, self._full(sequence.request.prompt, 0))
        return admitted

    def _full(self, prompt: tuple[int, ...], promised: int) -> KvBudgetExhausted:
        needed, free = blocks_to_admit(self.cache, prompt), self.cache.free_blocks
        waiting = f" ({promised} for sequences waiting)" if promised else ""
        return KvBudgetExhausted(
            f"KV cache full: the prompt needs {needed} blocks, {free} free of "
            f"{self.cache.shape.total_blocks}{waiting}; retry later"
        )

    def _drop_gone(self) -> None:
        for sequence in [s for s in self.running if s.gone]:
            self.running.remove(sequence)
            self.cache.release(sequence.name)
        self.waiting = deque(s for s in self.waiting if not s.gone)

    async def _prefill(self, group: list[_Sequence]) -> None:
        """One run for ``group``'s uncached tokens (more than the prompt if resumed)."""
        self.step_past.forget()  # the next decode step's batch has new rows
        names = [s.name for s in group]
        cached = [self.cache.length(name) for name in names]
        rows = [s.tokens[done:] for s, done in zip(group, cached, strict=True)]
        keys, values, past = self.cache.gather(names)
        ids, mask, positions = prefill_inputs(rows, cached, past)
        feeds = self._feeds(ids, mask, positions, keys, values)
        try:
            outputs = await self._offload(lambda: self._decoder(feeds))
        except Exception as exc:
            for sequence in group:
                self.cache.release(sequence.name)
                self._finish(sequence, InferenceError(f"prefill failed: {exc}"))
            return
        layers = self.cache.shape.layers
        for row, (sequence, tokens) in enumerate(zip(group, rows, strict=True)):
            new = slice(ids.shape[1] + past - len(tokens), None)  # its last columns
            self.cache.append(
                sequence.name,
                [outputs[f"present.{i}.key"][row, :, new] for i in range(layers)],
                [outputs[f"present.{i}.value"][row, :, new] for i in range(layers)],
                tokens,
            )
            self.running.append(sequence)
            self._emit(sequence, outputs["logits"][row, -1])

    async def _decode(self) -> None:
        batch = [s for s in self.running if not s.gone]
        if not batch:
            return
        for sequence in list(batch):  # room for the token this step adds
            try:
                self.cache.reserve(sequence.name, self.cache.length(sequence.name) + 1)
            except KvCacheFull:
                batch.remove(sequence)  # waits for a block this step (others finish first)
        if not batch:  # nobody can grow: the newest gives its blocks back and starts over later
            self._preempt(self.running[-1])
            return
        names = tuple(s.name for s in batch)
        lengths = np.array([self.cache.length(n) for n in names], dtype=np.int64)
        past = self.step_past.past(names, lengths)
        last = np.array([[s.generated[-1]] for s in batch], dtype=np.int64)
        feeds = self._feeds(last, past.mask, lengths[:, None], past.keys, past.values)
        self.stats.decode_steps += 1
        self._observe("decode_step_carried" if past.carried else "decode_step_gathered", 1.0)
        try:
            outputs = await self._offload(lambda: self._decoder(feeds))
        except Exception as exc:
            for sequence in batch:
                self.running.remove(sequence)
                self.cache.release(sequence.name)
                self._finish(sequence, InferenceError(f"decode step failed: {exc}"))
            return
        layers = range(self.cache.shape.layers)
        keys = [outputs[f"present.{i}.key"] for i in layers]
        values = [outputs[f"present.{i}.value"] for i in layers]
        if not any(s.gone for s in batch):  # a gone row appends nothing: the next step gathers
            self.step_past.keep(names, lengths, past, (keys, values))
        for row, sequence in enumerate(batch):
            if sequence.gone:
                continue
            new_keys = [k[row, :, -1:] for k in keys]
            new_values = [v[row, :, -1:] for v in values]
            self.cache.append(sequence.name, new_keys, new_values, sequence.generated[-1:])
            self._emit(sequence, outputs["logits"][row, -1])

    def _preempt(self, sequence: _Sequence) -> None:
        """Frees a running sequence's blocks; it waits first in line and is prefilled again
        with everything it has generated (recomputed, never corrupted)."""
        self.running.remove(sequence)
        self.cache.release(sequence.name)
        self.waiting.appendleft(sequence)
        self.stats.preempted += 1
        self.step_past.forget()

    def _feeds(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        position_ids: np.ndarray,
        keys: list[np.ndarray],
        values: list[np.ndarray],
    ) -> Feeds:
        feeds = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
        }
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            feeds[f"past_key_values.{i}.key"] = k
            feeds[f"past_key_values.{i}.value"] = v
        return feeds

    # -- tokens -----------------------------------------------------------------------------
    def _emit(self, sequence: _Sequence, logits: np.ndarray) -> None:
        try:
            token = sample(logits, sequence.request, sequence.rng)
        except Exception as exc:  # one request's sampling fails that request alone, never
            log.exception("sampling failed for one sequence")  # the batch it ran in
            self._fail([sequence], exc, "sampling failed")
            return
        now = self._clock()
        if sequence.first_token_at is None:
            sequence.first_token_at = now
            self._observe("ttft", now - sequence.created)
        sequence.generated.append(token)
        self._observe("token", 1.0)
        reason = self._finish_reason(sequence)
        event = TokenEvent(token, len(sequence.generated) - 1, bool(reason), reason)
        sequence.events.put_nowait(event)
        sequence.done = bool(reason)
        if reason:
            count = len(sequence.generated)
            if count > 1:
                self._observe("tpot", (now - sequence.first_token_at) / (count - 1))
            self.stats.sequences_done += 1
            self.running.remove(sequence)
            self.cache.release(sequence.name)

    def _finish_reason(self, sequence: _Sequence) -> str:
        generated, request = sequence.generated, sequence.request
        if generated[-1] == self.eos_token:
            return "eos"
        for stop in request.stop:
            if stop and tuple(generated[-len(stop) :]) == stop:
                return "stop"
        return "length" if len(generated) >= request.max_tokens else ""

    def _finish(self, sequence: _Sequence, error: BaseException) -> None:
        sequence.done = True
        sequence.events.put_nowait(error)
