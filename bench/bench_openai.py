"""Benchmark the OpenAI API's overhead against ModelStreamInfer, for the same generation.

One model server serves the demo LM (``model_server.demo_lm``), and with ``--targets`` holding
``envoy`` a control plane and Envoy (authentication off, plaintext, one worker) route to it;
the same completion (the prompt ``abcabcabc``, whose greedy text is ASCII, ``--max-tokens``
tokens, greedy, never ending early) is asked for, one request at a time, from each target
(the server's own ports, or Envoy's listener: gRPC with ``x-model-name``, /v1 routed by the
body's ``model`` through the Lua filter), by:

- ``grpc_stream``: ModelStreamInfer over grpc.aio (one request per stream), the baseline;
- ``grpc_unary``: ModelInfer, the whole completion in one answer;
- ``v1_sse``: ``POST /v1/completions`` with ``stream: true``, read with httpx as server-sent
  events to ``[DONE]``;
- ``v1_whole``: ``POST /v1/completions`` without streaming (httpx);
- ``v1_openai``: the official ``openai`` client (AsyncOpenAI), streaming: what users run,
  its own parsing included.

Per request the client records the time to the first token (the first event or response
that carries text; for the whole answers, the answer) and the total. In a round the arms and
targets take turns request by request (the order rotates each round), ``--requests`` times
after ``--warmup`` discarded turns; per arm and round the medians are kept. Printed per target: per
arm, the median over rounds of the per-round medians, with the spread (min-max over rounds),
and the overhead against its gRPC twin in the same round (streams against ``grpc_stream``,
whole answers against ``grpc_unary``; median and spread); then what Envoy adds per arm.

    flock /tmp/infermesh-bench.lock .venv/bin/python bench/bench_openai.py \\
        [--rounds 8 --requests 20 --max-tokens 64 --targets server,envoy]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from pathlib import Path

import bench_mesh as bm
import bench_model_server as bms
import grpc
import httpx
import openai
import yaml
from bench_generation import prompt_request
from tritonclient.grpc import service_pb2_grpc

from infermesh.wire import MODEL_HEADER
from model_server.demo_lm import MODEL_NAME, build_demo_lm

PROMPT = "abcabcabc"
ARMS = ("grpc_stream", "grpc_unary", "v1_sse", "v1_whole", "v1_openai")
# Each arm's gRPC counterpart: the same generation, streamed or whole
TWIN = {"grpc_stream": "grpc_stream", "grpc_unary": "grpc_unary", "v1_sse": "grpc_stream",
        "v1_whole": "grpc_unary", "v1_openai": "grpc_stream"}  # fmt: skip
Timing = tuple[float, float]  # (first token s, total s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((bms.HOST, 0))
        return int(s.getsockname()[1])


def free_pair(offset: int = 2000) -> int:
    """A port P with P + ``offset`` free too (the REST twins' port offset)."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind((bms.HOST, port + offset))
            except OSError:
                continue
        return port


class Arms:
    """The five arms against one target: gRPC at ``grpc_port``, HTTP at ``http_port``."""

    def __init__(self, grpc_port: int, http_port: int, max_tokens: int, routed: bool) -> None:
        self.grpc_url = f"{bms.HOST}:{grpc_port}"
        self.base = f"http://{bms.HOST}:{http_port}/v1"
        self.max_tokens = max_tokens
        self.metadata = ((MODEL_HEADER, MODEL_NAME),) if routed else ()  # Envoy routes by it
        self.body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens}

    async def __aenter__(self) -> Arms:
        self.channel = grpc.aio.insecure_channel(self.grpc_url)
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.http = httpx.AsyncClient(timeout=60)
        self.openai = openai.AsyncOpenAI(base_url=self.base, api_key="unused", max_retries=0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.openai.close()
        await self.http.aclose()
        await self.channel.close()

    def arm(self, name: str) -> Callable[[], Awaitable[Timing]]:
        method: Callable[[], Awaitable[Timing]] = getattr(self, name)
        return method

    async def grpc_stream(self) -> Timing:
        sent, first = time.perf_counter(), None
        request = prompt_request(PROMPT.encode(), self.max_tokens)
        async for response in self.stub.ModelStreamInfer(iter([request]), metadata=self.metadata):
            if response.error_message:
                sys.exit(f"ModelStreamInfer failed: {response.error_message}")
            first = first or time.perf_counter()
        assert first is not None
        return first - sent, time.perf_counter() - sent

    async def grpc_unary(self) -> Timing:
        sent = time.perf_counter()
        await self.stub.ModelInfer(
            prompt_request(PROMPT.encode(), self.max_tokens), metadata=self.metadata
        )
        total = time.perf_counter() - sent
        return total, total

    async def v1_sse(self) -> Timing:
        sent, first, texts = time.perf_counter(), None, 0
        body = {**self.body, "stream": True}
        async with self.http.stream("POST", f"{self.base}/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if json.loads(line[6:])["choices"][0]["text"]:
                    first, texts = first or time.perf_counter(), texts + 1
        assert first is not None and texts == self.max_tokens, texts
        return first - sent, time.perf_counter() - sent

    async def v1_whole(self) -> Timing:
        sent = time.perf_counter()
        response = await self.http.post(f"{self.base}/completions", json=self.body)
        usage = response.json()["usage"]
        assert usage["completion_tokens"] == self.max_tokens, usage
        total = time.perf_counter() - sent
        return total, total

    async def v1_openai(self) -> Timing:
        sent, first = time.perf_counter(), None
        stream = await self.openai.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=self.max_tokens, stream=True
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                first = first or time.perf_counter()
        assert first is not None
        return first - sent, time.perf_counter() - sent


async def one_round(
    targets: dict[str, Arms], order: list[str], args: argparse.Namespace
) -> dict[str, Timing]:
    """Per "target:arm", the medians of its requests this round. The arms take turns request
    by request, so a neighbour's load lands on all of them alike."""
    calls = {name: targets[name.split(":")[0]].arm(name.split(":")[1]) for name in order}
    for _ in range(args.warmup):
        for call in calls.values():
            await call()
    timings: dict[str, list[Timing]] = {name: [] for name in order}
    for _ in range(args.requests):
        for name, call in calls.items():
            timings[name].append(await call())
    return {
        name: (statistics.median(t[0] for t in got), statistics.median(t[1] for t in got))
        for name, got in timings.items()
    }


async def run(
    ports: dict[str, tuple[int, int]], args: argparse.Namespace
) -> list[dict[str, Timing]]:
    """``ports``: per target, (gRPC port, HTTP port)."""
    results = []
    names = [f"{t}:{a}" for t in ports for a in ARMS]
    targets = {t: Arms(g, h, args.max_tokens, t == "envoy") for t, (g, h) in ports.items()}
    for arms in targets.values():
        await arms.__aenter__()
    try:
        for index in range(args.rounds):
            shift = index % len(names)
            medians = await one_round(targets, names[shift:] + names[:shift], args)
            results.append(medians)
            line = ", ".join(f"{n} {medians[n][1] * 1000:.1f}" for n in names)
            print(f"round {index + 1}/{args.rounds} (total ms, median): {line}", flush=True)
    finally:
        for arms in targets.values():
            await arms.__aexit__()
    return results


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def report(results: list[dict[str, Timing]], args: argparse.Namespace) -> None:
    print(
        f"\n## The OpenAI API against ModelStreamInfer: demo LM, {args.max_tokens} tokens, "
        f"greedy, one request at a time, {args.requests} requests per arm and round, "
        f"{args.rounds} rounds; median of the per-round medians (min-max over rounds), ms"
    )
    targets = args.targets.split(",")
    for target in targets:
        print(f"\n### {target}\n")
        print("| arm | first token | total | its gRPC twin | total - twin's "
              "| first token - twin's |")  # fmt: skip
        print("| --- | --- | --- | --- | --- | --- |")
        for arm in ARMS:
            name, twin = f"{target}:{arm}", f"{target}:{TWIN[arm]}"
            first = [r[name][0] * 1000 for r in results]
            total = [r[name][1] * 1000 for r in results]
            extra = [(r[name][1] - r[twin][1]) * 1000 for r in results]  # same round
            extra_first = [(r[name][0] - r[twin][0]) * 1000 for r in results]
            print(f"| {arm} | {spread(first)} | {spread(total)} | {TWIN[arm]} | "
                  f"{spread(extra)} | {spread(extra_first)} |")  # fmt: skip
    if len(targets) == 2:
        print("\n### what Envoy adds (envoy - server, same round)\n")
        print("| arm | first token | total |")
        print("| --- | --- | --- |")
        for arm in ARMS:
            first = [(r[f"envoy:{arm}"][0] - r[f"server:{arm}"][0]) * 1000 for r in results]
            total = [(r[f"envoy:{arm}"][1] - r[f"server:{arm}"][1]) * 1000 for r in results]
            print(f"| {arm} | {spread(first)} | {spread(total)} |")


def start_edge(stack: ExitStack, workdir: Path, server_port: int) -> int:
    """The control plane and Envoy in front of the server (stopped by ``stack``); the
    listener's port, once a /v1 completion goes through it."""
    listener = free_port()
    topology = workdir / "topology.yaml"
    topology.write_text(yaml.safe_dump({
        "listener": {"auth": {"mode": "off"}, "host": bms.HOST, "port": listener,
                     "health_check_interval_s": 0.5},
        "placement": {"poll_interval_s": 0.2, "timeout_s": 1.0},
        "models": [{"name": MODEL_NAME, "sla_p99_ms": 2000, "capacity_qps": 50,
                    "generative": True, "timeout_s": 30}],
        "endpoints": [{"address": f"{bms.HOST}:{server_port}"}],
    }))  # fmt: skip
    bm.start_plane_and_envoy(stack, workdir, topology)
    url = f"http://{bms.HOST}:{listener}/v1/completions"
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1}

    def routed() -> bool:
        try:
            return httpx.post(url, json=body, timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    bm.wait_for(routed, 30, "a /v1 completion through Envoy")
    return listener


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, default, words in (
        ("--rounds", 5, "rounds, each arm in turn"),
        ("--requests", 30, "timed requests per arm and round"),
        ("--warmup", 3, "discarded requests per arm and round"),
        ("--max-tokens", 64, "tokens per completion"),
    ):
        p.add_argument(flag, type=int, default=default, help=words)
    p.add_argument("--targets", default="server,envoy", help="server and/or envoy")
    p.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "bench-openai")
    args = p.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    build_demo_lm(args.models)
    port = free_pair()
    cmd = [sys.executable, "-m", "model_server", "--model-repository", str(args.models)]
    cmd += ["--host", bms.HOST, "--port", str(port), "--metrics-port", "0"]
    cmd += ["--models", MODEL_NAME, "--http-port", str(port + 2000)]
    spec = bms.ServerSpec("openai", cmd, bms.LISTEN_RE, bms.READY_RE)
    ports = {}
    with ExitStack() as stack:
        stack.enter_context(bms.start_server(spec, args.models / "server.log"))
        if "server" in args.targets:
            ports["server"] = (port, port + 2000)
        if "envoy" in args.targets:
            ports["envoy"] = (start_edge(stack, args.models, port),) * 2
        results = asyncio.run(run(ports, args))
    report(results, args)
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
