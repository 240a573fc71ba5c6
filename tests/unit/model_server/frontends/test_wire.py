"""The private channel's frames: every kind round-trips, a stream cut anywhere gives the same
frames, and what does not parse is refused, never guessed at."""

from __future__ import annotations

import math

import grpc
import pytest

from model_server.frontends import wire

METADATA = (("x-priority", "1"), ("trace-bin", b"\x00\xff"), ("empty", ""))


def test_infer_round_trips() -> None:
    sent = wire.Infer(7, 1.5, 8192, 16384, (12288, 4), METADATA, b"\x0a\x05model")
    [body] = wire.FrameReader().feed(wire.infer(sent))
    assert wire.kind_of(body) == (wire.Kind.INFER, 7)
    assert wire.parse_infer(body) == sent


def test_infer_without_timeout_or_slot() -> None:
    sent = wire.Infer(1, None, -1, 0, (), (), b"")
    assert wire.parse_infer(wire.FrameReader().feed(wire.infer(sent))[0]) == sent


def test_result_round_trips_every_status() -> None:
    for code in grpc.StatusCode:
        sent = wire.Result(3, code, (40, 8), "déjà".encode())
        got = wire.parse_result(wire.FrameReader().feed(wire.result(sent))[0])
        assert got == sent and got.message == "déjà"


def test_hello_and_cancel() -> None:
    reader = wire.FrameReader()
    hello = wire.Hello(2, 4242, 1 << 24, "pool-2-4242")
    bodies = reader.feed(wire.hello(hello) + wire.cancel(9) + wire.frame(wire.Kind.READY, 4242))
    assert wire.parse_hello(bodies[0]) == hello
    assert wire.kind_of(bodies[1]) == (wire.Kind.CANCEL, 9)
    assert wire.kind_of(bodies[2]) == (wire.Kind.READY, 4242)


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_a_stream_cut_anywhere_gives_the_same_frames(chunk: int) -> None:
    frames = [wire.infer(wire.Infer(i, 0.25 * i, -1, 0, (), METADATA, bytes(i * 10)))
              for i in range(1, 6)]  # fmt: skip
    stream = b"".join(frames)
    reader = wire.FrameReader()
    bodies = []
    for at in range(0, len(stream), chunk):
        bodies += reader.feed(stream[at : at + chunk])
    assert [wire.parse_infer(b).request_id for b in bodies] == [1, 2, 3, 4, 5]
    assert wire.parse_infer(bodies[2]).timeout_s == 0.75


def test_bad_frames_are_refused() -> None:
    with pytest.raises(wire.WireError, match="frame of 2 bytes"):
        wire.FrameReader().feed(b"\x02\x00\x00\x00xx")
    with pytest.raises(wire.WireError, match="unknown frame kind"):
        wire.kind_of(wire.frame(99, 1)[4:])  # type: ignore[arg-type]
    good = wire.infer(wire.Infer(1, None, -1, 0, (5, 6), METADATA, b""))[4:]
    with pytest.raises(wire.WireError):
        wire.parse_infer(good[:12])  # cut inside the lengths
    with pytest.raises(wire.WireError, match="left over"):
        wire.decode_metadata(wire.encode_metadata(METADATA) + b"x")
    with pytest.raises(wire.WireError, match="status code"):
        wire.parse_result(wire.frame(wire.Kind.RESULT, 1, b"\xc8\x00\x00")[4:])


def test_nan_is_the_only_no_timeout() -> None:
    assert math.isnan(float("nan"))
    sent = wire.Infer(1, 0.0, -1, 0, (), (), b"")
    assert wire.parse_infer(wire.FrameReader().feed(wire.infer(sent))[0]).timeout_s == 0.0
