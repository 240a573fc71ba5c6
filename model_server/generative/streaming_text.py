"""A completion's text as it streams, from a byte-level vocabulary's tokens.

The demo LM's tokens are bytes (``generative.text``), so a UTF-8 character may span tokens, and
a stop sequence ends a generation only once all its bytes are generated: what is sent before
must not hold the start of one (OpenAI's text never holds the stop sequence).
"""

from __future__ import annotations

import codecs


class TextAssembler:
    """A completion's token bytes in, its text out, as it streams: what may be the start of a
    stop sequence is held back (OpenAI's text never holds the stop sequence), and a UTF-8
    character split over tokens (the vocabulary is byte level) waits for its last byte."""

    def __init__(self, stop_texts: tuple[str, ...]) -> None:
        self._stops = [s.encode() for s in stop_texts]
        self._held = b""
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, data: bytes) -> str:
        self._held += data
        keep = self._stop_prefix()
        ready = self._held[: len(self._held) - keep]
        self._held = self._held[len(self._held) - keep :]
        return self._decoder.decode(ready)

    def finish(self, stopped: bool) -> str:
        """What is left; ``stopped``: the generation ended on a stop sequence, dropped here."""
        held, self._held = self._held, b""
        if stopped:
            for stop in self._stops:
                if held.endswith(stop):
                    held = held[: len(held) - len(stop)]
                    break
        return self._decoder.decode(held, final=True)

    def _stop_prefix(self) -> int:
        """The longest tail of the held bytes that starts (or is) a stop sequence."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop), len(self._held)), longest, -1):
                if self._held.endswith(stop[:size]):
                    longest = size
                    break
        return longest


def incomplete_utf8_tail(data: bytes) -> int:
    """How many bytes at the end of ``data`` start a UTF-8 character that more bytes could
    still complete (0 to 3). Held back from a streamed response, every response's text is
    whole characters where the model made any, and the bytes, joined, are unchanged."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: the character's lead (or ASCII)
            need = 2 if 0xC2 <= byte <= 0xDF else 3 if 0xE0 <= byte <= 0xEF else 4
            return back if 0xC2 <= byte <= 0xF4 and back < need else 0
    return 0
