"""One Scheduler interface in front of every way a model version runs work, as in Triton core.

A request reaches its version's scheduler resolved (the version chosen once, a fallback
applied), admitted by the serving gate and counted. The scheduler then does two things:

- ``prepare`` checks and converts the request for this kind of model (tensors against the
  model's inputs, or a generation's text and parameters), raising INVALID_ARGUMENT naming
  the field;
- ``responses`` runs it and yields its answers: one for a tensor model, one per token for a
  generative one (``streams``).

Three schedulers exist, and ``ModelVersion.load`` picks one, once:
- ``DirectScheduler``: the version's execution slots (its instance_group count of threads);
- ``BatchingScheduler``: the dynamic batcher (priority queues, deadlines, preferred sizes);
- ``GenerationScheduler``: the generation engine (continuous batching over a paged KV cache).

The deadline is the sooner of the gRPC deadline and the ``timeout`` parameter, counted from
when the call arrived (``Ticket``). The batcher and the generation engine end a request past
it with DEADLINE_EXCEEDED, whether it waits or (a completion) runs; direct execution has no
queue of its own to expire, and gRPC cancels a call past its deadline there (one still
waiting for a slot then never runs).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np
from tritonclient.grpc import service_pb2

from model_server.core.model_config import ModelSpec
from model_server.core.validation import DecodedRequest, decode_request, encode_response
from model_server.generative.engine import GenerationEngine, GenerationRequest
from model_server.generative.streaming_text import incomplete_utf8_tail
from model_server.generative.text import BYTE_VOCAB, parse_generation, text_response
from model_server.scheduling.batching import DeadlineExceeded, DynamicBatcher, QueueFull

W = TypeVar("W")


@dataclass(frozen=True, slots=True)
class Ticket:
    """How a prepared request is to be run: its priority and the time it has."""

    priority: int  # 0: the model's default
    timeout_s: float | None  # None: no deadline
    received_at: float  # time.monotonic() when the call arrived: timeouts count from here

    @property
    def deadline(self) -> float | None:
        return None if self.timeout_s is None else self.received_at + self.timeout_s


@dataclass(frozen=True, slots=True)
class Prepared(Generic[W]):
    """A request checked and converted for its scheduler."""

    request: service_pb2.ModelInferRequest
    work: W
    rows: int  # samples in the request (a completion is one)


class Scheduler(Protocol[W]):
    """What the service asks of a model version's scheduler."""

    streams: bool  # more than one response per request (Triton's decoupled models)

    @property
    def queued(self) -> int:
        """Requests waiting in this scheduler's own queue (not yet running)."""
        ...

    def prepare(
        self, request: service_pb2.ModelInferRequest, max_request_bytes: int
    ) -> Prepared[W]: ...

    def responses(
        self, prepared: Prepared[W], ticket: Ticket
    ) -> AsyncIterator[service_pb2.ModelInferResponse]: ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...


RunTensors = Callable[[DecodedRequest, Ticket], Awaitable[list[np.ndarray]]]


class _TensorScheduler:
    """Tensors in, tensors out: decode, run, encode. Subclasses say how it runs."""

    streams = False

    def __init__(self, spec: ModelSpec, version: int) -> None:
        self.spec = spec
        self.version = version

    @property
    def queued(self) -> int:
        return 0

    def prepare(
        self, request: service_pb2.ModelInferRequest, max_request_bytes: int
    ) -> Prepared[DecodedRequest]:
        decoded = decode_request(request, self.spec, max_request_bytes)
        return Prepared(request, decoded, decoded.batch)

    async def responses(
        self, prepared: Prepared[DecodedRequest], ticket: Ticket
    ) -> AsyncIterator[service_pb2.ModelInferResponse]:
        decoded = prepared.work
        arrays = await self.run(decoded, ticket)
        yield encode_response(prepared.request, self.spec, self.version, decoded.outputs, arrays)

    async def run(self, decoded: DecodedRequest, ticket: Ticket) -> list[np.ndarray]:
        raise NotImplementedError

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


class DirectScheduler(_TensorScheduler):
    """Each request on the next free execution slot; those beyond the slots wait in the
    slots' queue (the version counts them), and one whose client leaves while it waits never
    runs. The deadline is the client's: gRPC cancels a call past it."""

    def __init__(
        self,
        spec: ModelSpec,
        version: int,
        execute: Callable[[Sequence[str], dict[str, np.ndarray], int], Awaitable[list[np.ndarray]]],
    ) -> None:
        super().__init__(spec, version)
        self._execute = execute

    async def run(self, decoded: DecodedRequest, ticket: Ticket) -> list[np.ndarray]:
        return await self._execute(decoded.outputs, decoded.feeds, decoded.batch)


class BatchingScheduler(_TensorScheduler):
    """Requests joined into batches by the dynamic batcher, by priority, within deadlines."""

    def __init__(
        self,
        spec: ModelSpec,
        version: int,
        batcher: DynamicBatcher,
        on_refused: Callable[[str], None],
    ) -> None:
        super().__init__(spec, version)
        self.batcher = batcher
        self._on_refused = on_refused  # "queue_full" or "deadline"

    @property
    def queued(self) -> int:
        return self.batcher.queued

    async def run(self, decoded: DecodedRequest, ticket: Ticket) -> list[np.ndarray]:
        try:
            return await self.batcher.submit(
                decoded.feeds, decoded.outputs, decoded.batch, ticket.priority,
                ticket.timeout_s, ticket.received_at,
            )  # fmt: skip
        except (QueueFull, DeadlineExceeded) as exc:
            self._on_refused("queue_full" if isinstance(exc, QueueFull) else "deadline")
            raise

    def start(self) -> None:
        self.batcher.start()

    async def stop(self) -> None:
        await self.batcher.stop()


class GenerationScheduler:
    """A completion through the generation engine: one response per token, the last one
    final. Past its deadline the completion ends with DEADLINE_EXCEEDED and its sequence
    leaves the engine (its KV blocks go back at the next step)."""

    streams = True

    def __init__(self, engine: GenerationEngine, model: str, version: int, bos: int) -> None:
        self.engine = engine
        self.model = model
        self.version = version
        self._bos = bos

    @property
    def queued(self) -> int:
        return len(self.engine.waiting)

    def prepare(
        self, request: service_pb2.ModelInferRequest, max_request_bytes: int
    ) -> Prepared[GenerationRequest]:
        generation, _ = parse_generation(request, self._bos, self.engine.max_positions)
        return Prepared(request, generation, 1)

    async def responses(
        self, prepared: Prepared[GenerationRequest], ticket: Ticket
    ) -> AsyncIterator[service_pb2.ModelInferResponse]:
        deadline = ticket.deadline
        events = self.engine.generate(prepared.work)
        held = b""  # the start of a character split over tokens (the vocabulary is bytes)
        try:
            while True:
                try:
                    if deadline is None:
                        event = await anext(events)
                    else:
                        async with asyncio.timeout(deadline - time.monotonic()):
                            event = await anext(events)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise DeadlineExceeded(
                        f"model {prepared.request.model_name!r}: the completion passed its "
                        f"deadline ({ticket.timeout_s:g} s)"
                    ) from None
                # One response per token, each text whole UTF-8 characters: tritonclient's
                # users decode every response's text_output on its own.
                data = held + (bytes([event.token]) if event.token < BYTE_VOCAB else b"")
                keep = 0 if event.final else incomplete_utf8_tail(data)
                text, held = data[: len(data) - keep], data[len(data) - keep :]
                yield text_response(
                    prepared.request, self.model, self.version, text, event.final,
                    event.finish_reason,
                )  # fmt: skip
                if event.final:
                    return
        finally:
            await events.aclose()

    def start(self) -> None:
        self.engine.start()

    async def stop(self) -> None:
        await self.engine.stop()
