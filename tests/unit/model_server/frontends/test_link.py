"""The private channel end to end in one process: a front end's EngineLink and the engine's
connection on the two ends of a real Unix socket pair, with a real pool file. The engine's
inference service is a small echo (the channel's bookkeeping is what is tested here; the
integration tests run the real service behind it). Every INFER gets exactly one RESULT, and
no pool slot or pending request outlives its request: after 2**32 requests, with more
tensors than a frame counts, and with a CANCEL that arrives in the same read as its INFER."""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry, Counter
from tritonclient.grpc import service_pb2

from model_server.frontends import wire
from model_server.frontends.channel import EngineChannel, _Connection
from model_server.frontends.link import Answered, EngineLink
from model_server.frontends.pool import FrontendPool
from tests.support import wait_for_async

POOL_BYTES = 1 << 20


class EchoService:
    """Answers each request with its inputs as outputs, after ``delay_s``."""

    def __init__(self) -> None:
        self.delay_s = 0.0
        self.calls = 0

    async def infer(
        self, request: Any, metadata: Sequence[tuple[str, Any]], timeout_s: float | None
    ) -> service_pb2.ModelInferResponse:
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        response = service_pb2.ModelInferResponse(model_name=request.model_name)
        response.raw_output_contents.extend(bytes(part) for part in request.raw_input_contents)
        return response


@dataclass
class Channel:
    link: EngineLink
    pool: FrontendPool
    engine: EngineChannel
    service: EchoService
    front_socket: socket.socket


@pytest.fixture
async def channel(tmp_path: Path) -> AsyncIterator[Channel]:
    loop = asyncio.get_running_loop()
    front, back = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    service = EchoService()
    requests = Counter("requests", "by front end", ["frontend"], registry=CollectorRegistry())
    engine = EngineChannel(service, tmp_path, lambda index, pid: None, requests)  # type: ignore[arg-type]
    await loop.create_unix_connection(lambda: engine_connection(engine), sock=back)
    pool = FrontendPool(tmp_path, "pool-0", POOL_BYTES)
    _, link = await loop.create_unix_connection(lambda: EngineLink(pool, lambda: None), sock=front)
    link.send(wire.hello(wire.Hello(0, 1, pool.size, "pool-0")))
    yield Channel(link, pool, engine, service, front)
    link.close()
    await engine.close()


def engine_connection(engine: EngineChannel) -> asyncio.Protocol:
    return _Connection(engine)


def request(*inputs: bytes) -> service_pb2.ModelInferRequest:
    message = service_pb2.ModelInferRequest(model_name="echo")
    for index, _ in enumerate(inputs):
        message.inputs.add(name=f"x{index}", datatype="UINT8", shape=[1])
    message.raw_input_contents.extend(inputs)
    return message


def outputs(answer: Answered) -> list[bytes]:
    """The outputs as the client gets them; the link's decoded copy, when it made one, agrees."""
    sent = service_pb2.ModelInferResponse.FromString(answer.body)
    assert answer.response is None or answer.response == sent
    return list(sent.raw_output_contents)


async def test_request_ids_wrap_at_the_wires_u32_and_skip_those_in_flight(
    channel: Channel,
) -> None:
    """On the code before, request 2**32 raised struct.error (answered INVALID_ARGUMENT) and
    leaked its slot, and so did every request after it."""
    channel.service.delay_s = 0.2
    channel.link._ids = itertools.count(wire.MAX_REQUEST_ID)  # the last id before the wrap
    held = asyncio.create_task(channel.link.infer(request(b"held"), (), None))
    await wait_for_async(lambda: len(channel.link._pending) == 1, 5, "the first request sent")
    channel.link._ids = itertools.count(wire.MAX_REQUEST_ID)  # again: that id is in flight
    channel.service.delay_s = 0.0
    answer = await channel.link.infer(request(b"next"), (), None)
    assert outputs(answer) == [b"next"]
    assert outputs(await held) == [b"held"]
    assert channel.pool.slots.taken == 0 and not channel.link._pending


async def test_more_inputs_than_a_frame_counts_cross_in_the_message_not_the_pool(
    channel: Channel,
) -> None:
    """65,536 inputs overflowed the frame's u16 count after a slot was taken: the request
    failed and its slot was never freed (two such requests emptied a 16 MiB pool)."""
    many = [b"x"] * (wire.MAX_TENSORS + 1)
    answer = await channel.link.infer(request(*many), (), None)
    assert len(outputs(answer)) == len(many)
    assert channel.pool.slots.taken == 0
    assert outputs(await channel.link.infer(request(b"ok"), (), None)) == [b"ok"]


async def test_a_request_that_cannot_be_sent_frees_its_slot(channel: Channel) -> None:
    """Any failure between taking the slot and sending the frame frees the slot (only the
    engine's absence did before); a header key that is not a string stands in for one."""
    bad_metadata: Any = ((object(), "v"),)
    with pytest.raises(AttributeError):
        await channel.link.infer(request(b"x"), bad_metadata, None)
    assert channel.pool.slots.taken == 0 and not channel.link._pending


async def test_a_cancel_in_the_same_read_as_its_infer_still_gets_one_result(
    channel: Channel,
) -> None:
    """The engine cancelled the task before its first step, so none of its handlers ran: no
    RESULT was sent (the front end's slot and pending request leaked) and the engine kept
    the task's entry forever."""
    connection = next(iter(channel.engine.connections))
    frames: list[wire.Result] = []
    reader = wire.FrameReader()
    channel.link.data_received = lambda data: frames.extend(  # type: ignore[method-assign]
        wire.parse_result(body) for body in reader.feed(data)
    )
    message = wire.Infer(7, None, -1, 0, (), (), request(b"x").SerializeToString())
    channel.front_socket.sendall(wire.infer(message) + wire.cancel(7))  # one write, one read
    await wait_for_async(lambda: len(frames) == 1, 5, "a RESULT for request 7")
    assert (frames[0].request_id, frames[0].code) == (7, grpc.StatusCode.CANCELLED)
    assert not connection.tasks and channel.service.calls == 0
    # A CANCEL that comes once the request runs is answered by the request itself, once.
    channel.service.delay_s = 0.5
    message = wire.Infer(8, None, -1, 0, (), (), request(b"y").SerializeToString())
    channel.front_socket.sendall(wire.infer(message))
    await wait_for_async(lambda: channel.service.calls == 1, 5, "request 8 running")
    channel.front_socket.sendall(wire.cancel(8))
    await wait_for_async(lambda: len(frames) == 2, 5, "a RESULT for request 8")
    assert (frames[1].request_id, frames[1].code) == (8, grpc.StatusCode.CANCELLED)
    await asyncio.sleep(0)
    assert len(frames) == 2 and not connection.tasks
