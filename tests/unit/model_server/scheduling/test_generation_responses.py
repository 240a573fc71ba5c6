"""A completion's streamed responses: one per token, each text whole UTF-8 characters.

tritonclient's users decode each ModelStreamInfer response's ``text_output`` on its own; with a
byte-level vocabulary a character the model makes over several tokens must not be split.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from tritonclient.grpc import service_pb2

from model_server.generative.engine import GenerationRequest, TokenEvent
from model_server.generative.streaming_text import incomplete_utf8_tail
from model_server.scheduling.schedulers import GenerationScheduler, Prepared, Ticket


class ScriptedEngine:
    """Yields the given tokens as the engine would, the last one final."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.waiting: list[Any] = []

    async def generate(self, work: Any) -> AsyncIterator[TokenEvent]:
        for index, token in enumerate(self.tokens):
            final = index == len(self.tokens) - 1
            yield TokenEvent(token, index, final, "length" if final else "")


async def texts(tokens: list[int]) -> list[bytes]:
    scheduler = GenerationScheduler(ScriptedEngine(tokens), "lm", 1, 257)  # type: ignore[arg-type]
    work = GenerationRequest(tuple(tokens))  # what the scripted engine ignores
    prepared = Prepared(service_pb2.ModelInferRequest(model_name="lm"), work, 1)
    responses = scheduler.responses(prepared, Ticket(0, None, 0.0))
    return [bytes(r.raw_output_contents[0][4:]) async for r in responses]


async def test_a_character_made_over_several_tokens_arrives_whole() -> None:
    made = "aé€😀b".encode()  # 1, 2, 3 and 4 bytes
    got = await texts(list(made))
    assert len(got) == len(made)  # still one response per token
    assert b"".join(got) == made  # nothing lost, nothing reordered
    assert [t.decode() for t in got if t] == ["a", "é", "€", "😀", "b"]


async def test_bytes_that_never_complete_a_character_still_arrive() -> None:
    made = [0xC3, ord("x"), 0xE2, 0x82]  # a lead byte cut short; a character the end cuts off
    got = await texts(made)
    assert got == [b"", b"\xc3x", b"", b"\xe2\x82"]  # held, then sent as made; the end flushes


def test_the_incomplete_tail() -> None:
    assert [incomplete_utf8_tail(b) for b in (b"", b"a", b"\xc3", b"\xc3\xa9", b"\xe2\x82")] == [
        0, 0, 1, 0, 2,
    ]  # fmt: skip
    assert incomplete_utf8_tail(b"\xf0\x9f\x98") == 3 and incomplete_utf8_tail(b"\x80") == 0
    assert incomplete_utf8_tail(b"\xff") == 0 and incomplete_utf8_tail(b"\xc0") == 0  # never
