"""Benchmark generation: continuous batching against one sequence at a time, on the demo LM.

Two servers serve the same demo decoder (``model_server.demo_lm``), differing only in the
config parameter ``max_running_sequences``: 32 (continuous batching: every running sequence
advances one token per step, together) and 1 (one sequence at a time; the others wait). For
each number of concurrent streams (``--streams``, default 1, 8, 32) each server is started
fresh, then that many client tasks (grpc.aio, one channel) each stream sequences back to back
for ``--duration`` seconds after a discarded warm-up: a prompt of a few bytes, ``--max-tokens``
tokens, greedy. Per sequence the client records the time to its first token (TTFT, from the
request's send) and the mean time per output token after the first (TPOT). Reported per
server and level: generated tokens/s over the timed window (every token received in it),
sequences completed, TTFT and TPOT P50/P99, and the ratio continuous/sequential. Rounds
alternate the two servers (``--rounds``) and the medians are printed.

    .venv/bin/python bench/bench_generation.py [--streams 1,8,32 --duration 8 --rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import bench_model_server as bms
import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from model_server.demo_lm import build_demo_lm

MODEL = "demo_lm"
MODES = {"continuous": 32, "sequential": 1}  # max_running_sequences


@dataclass
class Sample:
    tokens: int = 0  # received inside the timed window
    sequences: int = 0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)


def repository(root: Path, running: int) -> Path:
    target = root / f"running-{running}"
    build_demo_lm(target, force=False)
    config = target / MODEL / "config.pbtxt"
    text = config.read_text()
    if "max_running_sequences" not in text:
        text += (
            f'parameters {{ key: "max_running_sequences" value {{ string_value: "{running}" }} }}\n'
        )
        config.write_text(text)
    return target


def prompt_request(prompt: bytes, max_tokens: int) -> service_pb2.ModelInferRequest:
    """A demo LM request: one BYTES prompt (length-prefixed, as Triton's raw form) and
    ``max_tokens``."""
    message = service_pb2.ModelInferRequest(model_name=MODEL)
    tensor = message.inputs.add(name="text_input", datatype="BYTES")
    tensor.shape.append(1)
    message.raw_input_contents.append(len(prompt).to_bytes(4, "little") + prompt)
    message.parameters["max_tokens"].int64_param = max_tokens
    return message


def request(index: int, max_tokens: int) -> service_pb2.ModelInferRequest:
    return prompt_request(f"Story {index}: ".encode(), max_tokens)


async def client(
    stub: service_pb2_grpc.GRPCInferenceServiceStub,
    seed: int,
    max_tokens: int,
    window: tuple[float, float],
    sample: Sample,
) -> None:
    start, end = window
    index = seed * 1_000_000
    while time.monotonic() < end:
        index += 1
        sent = time.monotonic()
        first: float | None = None
        last = sent
        count = 0
        async for response in stub.ModelStreamInfer(iter([request(index, max_tokens)])):
            now = time.monotonic()
            if response.error_message:
                sys.exit(f"generation failed: {response.error_message}")
            first = now if first is None else first
            last, count = now, count + 1
            if start <= now <= end:
                sample.tokens += 1
        if first is None or not start <= sent <= end:
            continue  # a warm-up sequence, or one that started after the window
        sample.sequences += 1
        sample.ttft_s.append(first - sent)
        if count > 1:
            sample.tpot_s.append((last - first) / (count - 1))


async def measure(port: int, streams: int, args: argparse.Namespace) -> Sample:
    sample = Sample()
    async with grpc.aio.insecure_channel(f"{bms.HOST}:{port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        start = time.monotonic() + args.warmup
        window = (start, start + args.duration)
        await asyncio.gather(
            *(client(stub, i + 1, args.max_tokens, window, sample) for i in range(streams))
        )
    return sample


@dataclass(frozen=True)
class Row:
    mode: str
    streams: int
    tokens_per_s: float
    sequences: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float


def percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1000) if values else float("nan")


def run_once(repo: Path, mode: str, streams: int, args: argparse.Namespace, log: Path) -> Row:
    cmd = [sys.executable, "-m", "model_server", "--model-repository", str(repo)]
    cmd += ["--host", bms.HOST, "--port", "0", "--metrics-port", "0", "--models", MODEL]
    spec = bms.ServerSpec(mode, cmd, bms.LISTEN_RE, bms.READY_RE)
    with ExitStack() as stack:
        _, port, _ = stack.enter_context(bms.start_server(spec, log))
        sample = asyncio.run(measure(port, streams, args))
    return Row(
        mode, streams, sample.tokens / args.duration, sample.sequences,
        percentile_ms(sample.ttft_s, 50), percentile_ms(sample.ttft_s, 99),
        percentile_ms(sample.tpot_s, 50), percentile_ms(sample.tpot_s, 99),
    )  # fmt: skip


def median_row(rows: list[Row]) -> Row:
    def med(name: str) -> float:
        return float(statistics.median(getattr(r, name) for r in rows))

    return Row(
        rows[0].mode, rows[0].streams, med("tokens_per_s"), int(med("sequences")),
        med("ttft_p50_ms"), med("ttft_p99_ms"), med("tpot_p50_ms"), med("tpot_p99_ms"),
    )  # fmt: skip


def rounds(args: argparse.Namespace, root: Path) -> Iterator[Row]:
    repos = {mode: repository(root, running) for mode, running in MODES.items()}
    for streams in [int(s) for s in args.streams.split(",")]:
        for i in range(args.rounds):
            for mode, repo in repos.items():
                row = run_once(repo, mode, streams, args, root / f"{mode}.log")
                print(
                    f"streams {streams} round {i + 1}/{args.rounds} {mode}: "
                    f"{row.tokens_per_s:,.0f} tokens/s, TTFT p50 {row.ttft_p50_ms:.1f} ms, "
                    f"TPOT p50 {row.tpot_p50_ms:.2f} ms",
                    flush=True,
                )
                yield row


def report(rows: list[Row], args: argparse.Namespace) -> None:
    print(
        f"\n## Generation on the demo LM: {args.max_tokens} tokens per sequence, greedy, "
        f"{args.duration:g} s per run, {args.rounds} rounds, medians\n"
    )
    print("| streams | mode | tokens/s | sequences | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms "
          "| TPOT p99 ms |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    medians: dict[tuple[int, str], Row] = {}
    for key in sorted({(r.streams, r.mode) for r in rows}, key=lambda k: (k[0], k[1])):
        m = medians[key] = median_row([r for r in rows if (r.streams, r.mode) == key])
        print(
            f"| {m.streams} | {m.mode} | {m.tokens_per_s:,.0f} | {m.sequences} | "
            f"{m.ttft_p50_ms:.1f} | {m.ttft_p99_ms:.1f} | {m.tpot_p50_ms:.2f} | "
            f"{m.tpot_p99_ms:.2f} |"
        )
    print("\n| streams | tokens/s continuous / sequential | TTFT p99 ratio |")
    print("| --- | --- | --- |")
    for streams in sorted({r.streams for r in rows}):
        c, s = medians[(streams, "continuous")], medians[(streams, "sequential")]
        print(
            f"| {streams} | {c.tokens_per_s / s.tokens_per_s:.2f} | "
            f"{c.ttft_p99_ms / s.ttft_p99_ms:.2f} |"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", default="1,8,32", help="comma-separated concurrent streams")
    p.add_argument("--duration", type=float, default=8.0, help="timed seconds per run")
    p.add_argument("--warmup", type=float, default=2.0, help="discarded seconds first")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "bench-lm")
    args = p.parse_args()
    args.models.mkdir(parents=True, exist_ok=True)
    report(list(rounds(args, args.models)), args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
