"""Benchmark prefix caching on a shared-prefix workload: the demo LM with the cache on and off.

Servers serve the same demo decoder (``model_server.demo_lm``), differing only in config
parameters: ``on`` (prefix caching, the default), ``off`` (``prefix_caching: false``),
``on-batched`` and ``off-batched`` (the same, with up to 8 new sequences prefilled in one
run: ``max_prefill_sequences: 8``; ``--modes`` picks them). The workload is a chat
service's: ``--system-prompts`` system prompts of ``--prefix-bytes`` bytes (400: 401 tokens
with BOS), each request one of them (chosen at random) followed by a short unique question,
``--max-tokens`` tokens, greedy. ``--streams`` client tasks (grpc.aio, one channel) send
requests back to back for ``--duration`` seconds after a discarded warm-up; every server
starts fresh for every run.

Per run: TTFT P50/P90 (send to first token), generated tokens/s over the window, completed
sequences, and the server's prefix-cache hit rate over the window (``prefix_cache_hit_tokens``
over ``prefix_cache_lookup_tokens`` from its metrics endpoint, read at the window's ends), and
how many cores other processes on the host used meanwhile (all busy CPU time minus this
process's and the server's). Rounds alternate the modes; medians with the min-max spread.

    flock /tmp/infermesh-bench.lock .venv/bin/python bench/bench_prefix_cache.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import bench_model_server as bms
import grpc
import numpy as np
from bench_generation import prompt_request
from tritonclient.grpc import service_pb2_grpc

from model_server.demo_lm import build_demo_lm
from model_server.generative.lm_reference import DEFAULT_CONFIG, LmConfig

MODEL = "demo_lm"
MODES = {
    "on": {"prefix_caching": "true"},
    "off": {"prefix_caching": "false"},
    "on-batched": {"prefix_caching": "true", "max_prefill_sequences": "8"},
    "off-batched": {"prefix_caching": "false", "max_prefill_sequences": "8"},
}
WORDS = ("the", "of", "and", "model", "server", "cache", "token", "block", "prefix", "system",
         "user", "answer", "question")  # fmt: skip


@dataclass
class Sample:
    tokens: int = 0  # received inside the timed window
    sequences: int = 0
    ttft_s: list[float] = field(default_factory=list)


def build_lm(root: Path, args: argparse.Namespace) -> Path:
    """The demo LM of --lm-width/--lm-layers under ``root``; returns the repository root.

    One folder per shape: ``build_demo_lm(force=False)`` keeps a model file that exists.
    """
    config = LmConfig(width=args.lm_width, layers=args.lm_layers)
    target = root / f"lm-w{config.width}-l{config.layers}"
    build_demo_lm(target, config, force=False)
    return target


def repository(root: Path, mode: str, args: argparse.Namespace) -> Path:
    target = build_lm(root / mode, args)
    config = target / MODEL / "config.pbtxt"
    text = re.sub(r"parameters \{.*\}\n", "", config.read_text())
    for key, value in MODES[mode].items():
        text += f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}\n'
    config.write_text(text)
    return target


def system_prompts(count: int, size: int) -> list[bytes]:
    rng = random.Random(20261203)
    prompts = []
    for i in range(count):
        words = [f"System prompt {i}:"]
        while len(" ".join(words)) < size:
            words.append(rng.choice(WORDS))
        prompts.append(" ".join(words)[:size].encode())
    return prompts


async def client(
    stub: service_pb2_grpc.GRPCInferenceServiceStub,
    seed: int,
    prefixes: list[bytes],
    args: argparse.Namespace,
    window: tuple[float, float],
    sample: Sample,
) -> None:
    start, end = window
    rng = random.Random(seed)
    index = 0
    while time.monotonic() < end:
        index += 1
        prompt = rng.choice(prefixes) + f" User {seed}.{index}: why?".encode()
        sent = time.monotonic()
        first: float | None = None
        async for response in stub.ModelStreamInfer(
            iter([prompt_request(prompt, args.max_tokens)])
        ):
            now = time.monotonic()
            if response.error_message:
                sys.exit(f"generation failed: {response.error_message}")
            first = now if first is None else first
            if start <= now <= end:
                sample.tokens += 1
        if first is not None and start <= sent <= end:
            sample.sequences += 1
            sample.ttft_s.append(first - sent)


def prefix_counters(metrics_port: int) -> tuple[float, float]:
    """(hit tokens, looked-up tokens) from the server's Prometheus text."""
    url = f"http://{bms.HOST}:{metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()

    def read(name: str) -> float:
        found = re.search(rf'^{name}_total\{{model="{MODEL}"\}} (\S+)$', text, re.M)
        return float(found[1]) if found else 0.0

    return read("prefix_cache_hit_tokens"), read("prefix_cache_lookup_tokens")


def busy_s() -> float:
    """Seconds of CPU every core of the host spent busy since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Row:
    mode: str
    tokens_per_s: float
    sequences: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    hit_rate: float
    others_cores: float  # other processes' CPU over the window, in cores


async def measure(
    mode: str, port: int, metrics_port: int, pid: int, args: argparse.Namespace
) -> Row:
    sample = Sample()
    prefixes = system_prompts(args.system_prompts, args.prefix_bytes)
    async with grpc.aio.insecure_channel(f"{bms.HOST}:{port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        start = time.monotonic() + args.warmup
        window = (start, start + args.duration)
        clients = asyncio.gather(
            *(client(stub, i + 1, prefixes, args, window, sample) for i in range(args.streams))
        )
        await asyncio.sleep(args.warmup)
        before = prefix_counters(metrics_port), busy_s(), own_cpu(pid)
        await asyncio.sleep(args.duration)
        after = prefix_counters(metrics_port), busy_s(), own_cpu(pid)
        await clients
    hits, lookups = (a - b for a, b in zip(after[0], before[0], strict=True))
    others = (after[1] - before[1]) - (after[2] - before[2])
    ttft = np.array(sample.ttft_s) * 1000 if sample.ttft_s else np.array([np.nan])
    return Row(
        mode, sample.tokens / args.duration, sample.sequences,
        float(np.percentile(ttft, 50)), float(np.percentile(ttft, 90)),
        hits / lookups if lookups else 0.0, max(0.0, others / args.duration),
    )  # fmt: skip


def own_cpu(server_pid: int) -> float:
    """CPU seconds of this process and the server."""
    times = os.times()
    return times.user + times.system + (bms.cpu_seconds(server_pid) or 0.0)


def run_once(repo: Path, mode: str, args: argparse.Namespace, log: Path) -> Row:
    cmd = [sys.executable, "-m", "model_server", "--model-repository", str(repo)]
    cmd += ["--host", bms.HOST, "--port", "0", "--metrics-port", "0", "--models", MODEL]
    spec = bms.ServerSpec(mode, cmd, bms.LISTEN_RE, bms.READY_RE)
    with ExitStack() as stack:
        pid, port, metrics_port = stack.enter_context(bms.start_server(spec, log))
        assert metrics_port is not None
        return asyncio.run(measure(mode, port, metrics_port, pid, args))


def spread(rows: list[Row], name: str, fmt: str) -> str:
    values = [getattr(r, name) for r in rows]
    middle = statistics.median(values)
    return f"{fmt.format(middle)} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def report(rows: list[Row], args: argparse.Namespace) -> None:
    print(
        f"\n## Prefix caching, demo LM: {args.system_prompts} system prompts of "
        f"{args.prefix_bytes} bytes, {args.streams} streams, {args.max_tokens} tokens per "
        f"request, greedy, {args.duration:g} s per run, {args.rounds} rounds: median "
        "(min-max)\n"
    )
    print("| mode | TTFT p50 ms | TTFT p90 ms | tokens/s | sequences | hit rate | "
          "other processes, cores |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    medians: dict[str, dict[str, float]] = {}
    for mode in [m for m in MODES if m in args.modes]:
        mine = [r for r in rows if r.mode == mode]
        medians[mode] = {
            n: statistics.median(getattr(r, n) for r in mine)
            for n in ("ttft_p50_ms", "ttft_p90_ms", "tokens_per_s")
        }
        print(
            f"| {mode} | {spread(mine, 'ttft_p50_ms', '{:.1f}')} | "
            f"{spread(mine, 'ttft_p90_ms', '{:.1f}')} | {spread(mine, 'tokens_per_s', '{:,.0f}')} "
            f"| {spread(mine, 'sequences', '{:.0f}')} | {spread(mine, 'hit_rate', '{:.2f}')} | "
            f"{spread(mine, 'others_cores', '{:.2f}')} |"
        )
    if "on" in medians and "off" in medians:
        on, off = medians["on"], medians["off"]
        print(
            f"\non / off: TTFT p50 {on['ttft_p50_ms'] / off['ttft_p50_ms']:.2f}x, "
            f"TTFT p90 {on['ttft_p90_ms'] / off['ttft_p90_ms']:.2f}x, "
            f"tokens/s {on['tokens_per_s'] / off['tokens_per_s']:.2f}x"
        )


def add_workload_arguments(
    p: argparse.ArgumentParser, streams: int, duration: float, warmup: float
) -> None:
    """The shared-prefix workload's options (bench_affinity runs the same workload)."""
    p.add_argument("--streams", type=int, default=streams, help="concurrent client streams")
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--prefix-bytes", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--duration", type=float, default=duration, help="timed seconds per run")
    p.add_argument("--warmup", type=float, default=warmup, help="discarded seconds first")
    # A wider or deeper demo LM makes a prefill cost more next to the per-token path, as a
    # real LLM's does; the default is the shipped demo LM.
    p.add_argument("--lm-width", type=int, default=DEFAULT_CONFIG.width, help="demo LM width")
    p.add_argument("--lm-layers", type=int, default=DEFAULT_CONFIG.layers, help="its layers")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default=",".join(MODES), help=f"of {','.join(MODES)}")
    add_workload_arguments(p, streams=16, duration=10.0, warmup=3.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "bench-prefix")
    args = p.parse_args()
    args.modes = args.modes.split(",")
    args.models.mkdir(parents=True, exist_ok=True)
    repos = {mode: repository(args.models, mode, args) for mode in args.modes}
    rows = []
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    for i in range(args.rounds):
        for mode, repo in repos.items():
            row = run_once(repo, mode, args, args.models / f"{mode}.log")
            rows.append(row)
            print(
                f"round {i + 1}/{args.rounds} {mode}: TTFT p50 {row.ttft_p50_ms:.1f} ms, "
                f"p90 {row.ttft_p90_ms:.1f} ms, {row.tokens_per_s:,.0f} tokens/s, hit rate "
                f"{row.hit_rate:.2f}, other processes {row.others_cores:.2f} cores",
                flush=True,
            )
    report(rows, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
