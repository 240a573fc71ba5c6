"""Benchmark prefix affinity against least_request and round robin, side by side in one run.

Each arm is a fresh mesh on free 127.0.0.1 ports: three model servers with the demo LM
(prefix caching on, ``--kv-blocks`` KV blocks each), the control plane (telemetry-driven
weights on, as shipped) and Envoy with one worker, stopped by PID at the end. The arms differ
only in how Envoy picks a server for the demo LM:

- ``affinity``: ``affinity: {mode: prefix, one_request_streams: true, hash_balance_factor:
  --factor}``: Maglev over the weighted endpoints, keyed on the prompt's first 8 KV blocks,
  which the edge's Lua reads from each ModelStreamInfer message;
- ``least_request`` and ``round_robin``: the listener's ``lb_policy``, no affinity.

Workload (bench_prefix_cache's): ``--system-prompts`` prompts of ``--prefix-bytes`` bytes,
each request one of them at random and a short unique question, ``--max-tokens`` tokens,
greedy, one request per stream (``x-model-name`` header), ``--streams`` client tasks sending
back to back over one grpc.aio channel to Envoy. Phases: a discarded warm-up, the timed
``--duration`` s, then the hot phase (``--hot-duration`` s, ``--hot-share`` of requests on
one prompt).

Per arm: TTFT P50/P90 (send to first token), output tokens/s, the pool's prefix-cache hit
rate (hit over looked-up prompt tokens, from the servers' metrics across the window), each
server's share of the requests (Envoy's per-host ``rq_total``), and in the hot phase the
largest server's load over the mean: of requests, and of requests in flight (Envoy's
``rq_active`` sampled every 0.2 s), which is what ``hash_balance_factor`` bounds; and the
servers' CPU per output token with the client's and Envoy's cores (they share the host, so
tokens/s is not the servers' alone).
``--rounds`` rounds, the arms in turn in each; medians with [min-max]. Then the targets: TTFT
P90 <= 0.5x least_request's, tokens/s >= 1.3x, hot-phase max/mean load <= 1.5.

    flock /tmp/infermesh-bench.lock .venv/bin/python bench/bench_affinity.py --rounds 3
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
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bench_mesh as bm
import bench_model_server as bms
import grpc
import numpy as np
import yaml
from bench_generation import prompt_request
from bench_prefix_cache import (
    add_workload_arguments,
    build_lm,
    busy_s,
    prefix_counters,
    system_prompts,
)
from tritonclient.grpc import service_pb2_grpc

from infermesh import event_loop

MODEL = "demo_lm"
ARMS = ("affinity", "least_request", "round_robin")
FIELDS = "rq_total|rq_active|health_flags"
HOST_RE = re.compile(rf"^model:{MODEL}::127\.0\.0\.1:(\d+)::({FIELDS})::(.*)$", re.M)
METADATA = (("x-model-name", MODEL),)


def repository(root: Path, kv_blocks: int, args: argparse.Namespace) -> Path:
    root = build_lm(root, args)
    config = root / MODEL / "config.pbtxt"
    text = re.sub(r"parameters \{.*\}\n", "", config.read_text())
    text += f'parameters {{ key: "kv_cache_blocks" value {{ string_value: "{kv_blocks}" }} }}\n'
    config.write_text(text)
    return root


def write_topology(path: Path, arm: str, listener: int, otlp: int, ports: list[int],
                   args: argparse.Namespace) -> None:  # fmt: skip
    model: dict[str, Any] = {"name": MODEL, "sla_p99_ms": 5000, "capacity_qps": 100,
                             "generative": True}  # fmt: skip
    routing: dict[str, float] = {}
    if args.hysteresis is not None:  # every arm: weights move only on larger changes
        routing["hysteresis"] = args.hysteresis
    if args.kv_full_at is not None:  # every arm: when a nearly full KV cache loses score
        routing["kv_full_at"] = args.kv_full_at
    if routing:
        model["routing"] = routing
    factor = args.factor
    if arm == "affinity":
        model["affinity"] = {"mode": "prefix", "one_request_streams": True,
                             "hash_balance_factor": factor}  # fmt: skip
    data = {
        "listener": {"auth": {"mode": "off"}, "host": bms.HOST, "port": listener,
                     "health_check_interval_s": 0.5,
                     "lb_policy": "round_robin" if arm == "round_robin" else "least_request"},
        "placement": {"poll_interval_s": 0.2, "timeout_s": 1.0},
        "telemetry": {"host": bms.HOST, "port": otlp},
        "models": [model],
        "endpoints": [{"address": f"{bms.HOST}:{p}"} for p in ports],
    }  # fmt: skip
    path.write_text(yaml.safe_dump(data))


def hosts(envoy: bm.Admin) -> dict[int, dict[str, str]]:
    """Per server port: rq_total, rq_active and health_flags of the model's cluster."""
    found: dict[int, dict[str, str]] = {}
    for port, key, value in HOST_RE.findall(envoy.call("/clusters")):
        found.setdefault(int(port), {})[key] = value
    return found


@dataclass
class Mesh:
    servers: list[tuple[int, int, int | None]]  # pid, gRPC port, metrics port
    listener: int
    envoy: bm.Admin
    envoy_pid: int
    ports: list[int] = field(default_factory=list)

    def cpu_s(self) -> float:
        """CPU seconds of this process, the servers and Envoy (not the control plane)."""
        return sum(self.cpu_by_part())

    def cpu_by_part(self) -> tuple[float, float, float]:
        """CPU seconds of (this process: the client, the three servers, Envoy)."""
        servers = sum(bms.cpu_seconds(pid) or 0.0 for pid, _, _ in self.servers)
        return sum(os.times()[:2]), servers, bms.cpu_seconds(self.envoy_pid) or 0.0


@contextmanager
def mesh(args: argparse.Namespace, arm: str, workdir: Path) -> Iterator[Mesh]:
    otlp, listener = bm.free_port(), bm.free_port()
    with ExitStack() as stack:
        servers = []
        for i in (1, 2, 3):
            cmd = [sys.executable, "-m", "model_server", "--model-repository", str(args.models),
                   "--host", bms.HOST, "--port", "0", "--metrics-port", "0", "--models", MODEL,
                   "--otlp-endpoint", f"{bms.HOST}:{otlp}",
                   "--telemetry-interval", "0.2", "--event-loop", args.event_loop]  # fmt: skip
            spec = bms.ServerSpec(f"server {i}", cmd, bms.LISTEN_RE, bms.READY_RE)
            servers.append(stack.enter_context(bms.start_server(spec, workdir / f"s{i}.log")))
        ports = [p for _, p, _ in servers]
        topology = workdir / "topology.yaml"
        write_topology(topology, arm, listener, otlp, ports, args)
        _, envoy_pid, envoy_admin = bm.start_plane_and_envoy(stack, workdir, topology)
        envoy = bm.Admin(envoy_admin)

        def healthy() -> bool:
            found = hosts(envoy)
            return all(found.get(p, {}).get("health_flags") == "healthy" for p in ports)

        bm.wait_for(healthy, 60, "three healthy servers in Envoy")
        yield Mesh(servers, listener, envoy, envoy_pid, ports)


@dataclass
class Window:
    start: float
    end: float
    tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)


async def client(stub: service_pb2_grpc.GRPCInferenceServiceStub, seed: int,
                 choose: Callable[[random.Random], bytes], args: argparse.Namespace,
                 window: Window) -> None:  # fmt: skip
    rng, index = random.Random(seed), 0
    while time.monotonic() < window.end:
        index += 1
        prompt = choose(rng) + f" User {seed}.{index}: why?".encode()
        sent, first = time.monotonic(), None
        request = prompt_request(prompt, args.max_tokens)
        async for response in stub.ModelStreamInfer(iter([request]), metadata=METADATA):
            now = time.monotonic()
            if response.error_message:
                sys.exit(f"generation failed: {response.error_message}")
            first = now if first is None else first
            if window.start <= now <= window.end:
                window.tokens += 1
        if first is not None and window.start <= sent <= window.end:
            window.ttft_s.append(first - sent)


class ActiveSampler(threading.Thread):
    """Envoy's rq_active per server every 0.2 s, while ``stop`` is unset."""

    def __init__(self, envoy_port: int) -> None:
        super().__init__(daemon=True)
        self.envoy, self.stop = bm.Admin(envoy_port), threading.Event()
        self.samples: list[dict[int, int]] = []

    def run(self) -> None:
        while not self.stop.wait(0.2):
            found = hosts(self.envoy)
            self.samples.append({p: int(v.get("rq_active", 0)) for p, v in found.items()})


@dataclass
class Phase:
    window: Window
    requests: dict[int, int]  # per server port, over the window
    in_flight: dict[int, float]  # mean requests in flight per server port
    hits: float = 0.0
    lookups: float = 0.0


def run_phase(m: Mesh, args: argparse.Namespace, choose: Callable[[random.Random], bytes],
              warmup: float, duration: float) -> Phase:  # fmt: skip
    async def go() -> Phase:
        async with grpc.aio.insecure_channel(f"{bms.HOST}:{m.listener}") as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            start = time.monotonic() + warmup
            window = Window(start, start + duration)
            tasks = asyncio.gather(*(client(stub, i + 1, choose, args, window)
                                     for i in range(args.streams)))  # fmt: skip
            await asyncio.sleep(warmup)
            before = hosts(m.envoy), [prefix_counters(s[2] or 0) for s in m.servers]
            sampler = ActiveSampler(m.envoy.conn.port)
            sampler.start()
            await asyncio.sleep(duration)
            sampler.stop.set()
            after = hosts(m.envoy), [prefix_counters(s[2] or 0) for s in m.servers]
            await tasks
        requests = {p: int(after[0][p]["rq_total"]) - int(before[0][p]["rq_total"])
                    for p in m.ports}  # fmt: skip
        active = {p: float(np.mean([s.get(p, 0) for s in sampler.samples] or [0]))
                  for p in m.ports}  # fmt: skip
        hits = sum(a[0] - b[0] for a, b in zip(after[1], before[1], strict=True))
        lookups = sum(a[1] - b[1] for a, b in zip(after[1], before[1], strict=True))
        return Phase(window, requests, active, hits, lookups)

    return asyncio.run(go())


@dataclass(frozen=True)
class Row:
    arm: str
    ttft_p50_ms: float
    ttft_p90_ms: float
    tokens_per_s: float
    hit_rate: float
    shares: tuple[float, ...]  # each server's share of the requests, largest first
    hot_max_over_mean: float  # requests, hot phase
    hot_active_max_over_mean: float  # requests in flight, hot phase
    hot_hit_rate: float
    others_cores: float
    # the servers' CPU per output token, and the client's and Envoy's cores, in the main phase:
    # on this host they share two cores, so tokens/s is not the servers' alone
    server_cpu_ms_per_token: float
    client_cores: float
    envoy_cores: float


def over_mean(values: dict[int, float] | dict[int, int]) -> float:
    mean = sum(values.values()) / len(values) if values else 0.0
    return max(values.values()) / mean if mean > 0 else float("nan")


def run_arm(args: argparse.Namespace, arm: str) -> Row:
    prompts = system_prompts(args.system_prompts, args.prefix_bytes)

    def uniform(rng: random.Random) -> bytes:
        return rng.choice(prompts)

    def hot(rng: random.Random) -> bytes:
        return prompts[0] if rng.random() < args.hot_share else rng.choice(prompts[1:])

    with tempfile.TemporaryDirectory(prefix=f"bench-affinity-{arm}-") as tmp, \
            mesh(args, arm, Path(tmp)) as m:  # fmt: skip
        busy, own, parts = busy_s(), m.cpu_s(), m.cpu_by_part()
        main = run_phase(m, args, uniform, args.warmup, args.duration)
        others = (busy_s() - busy) - (m.cpu_s() - own)
        client, servers, envoy = (b - a for a, b in zip(parts, m.cpu_by_part(), strict=True))
        timed = args.warmup + args.duration  # what the CPU counters span
        hot_phase = run_phase(m, args, hot, 1.0, args.hot_duration)
    ttft = np.array(main.window.ttft_s or [np.nan]) * 1000
    total = sum(main.requests.values()) or 1
    return Row(
        arm, float(np.percentile(ttft, 50)), float(np.percentile(ttft, 90)),
        main.window.tokens / args.duration, main.hits / main.lookups if main.lookups else 0.0,
        tuple(sorted((r / total for r in main.requests.values()), reverse=True)),
        over_mean(hot_phase.requests), over_mean(hot_phase.in_flight),
        hot_phase.hits / hot_phase.lookups if hot_phase.lookups else 0.0,
        # the host's busy cores minus this client's, the servers' and Envoy's, over the main
        # phase (the control plane's are counted as others')
        max(0.0, others / timed),
        # tokens of the timed window only, CPU over warm-up and window: the warm-up's tokens
        # at the window's rate
        1000 * servers / max(1.0, main.window.tokens * timed / args.duration),
        client / timed, envoy / timed,
    )  # fmt: skip


def spread(values: list[float], fmt: str) -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-" \
           f"{fmt.format(max(values))}]"  # fmt: skip


COLUMNS = (("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"), ("TTFT p90 ms", "ttft_p90_ms", "{:.0f}"),
           ("tokens/s", "tokens_per_s", "{:.0f}"), ("hit rate", "hit_rate", "{:.2f}"),
           ("hot: max/mean requests", "hot_max_over_mean", "{:.2f}"),
           ("hot: max/mean in flight", "hot_active_max_over_mean", "{:.2f}"),
           ("hot: hit rate", "hot_hit_rate", "{:.2f}"),
           ("servers' CPU ms/token", "server_cpu_ms_per_token", "{:.2f}"),
           ("client cores", "client_cores", "{:.2f}"),
           ("Envoy cores", "envoy_cores", "{:.2f}"))  # fmt: skip


def report(rows: list[Row], args: argparse.Namespace) -> None:
    print(f"\n## Affinity, demo LM on 3 servers ({args.kv_blocks} KV blocks each): "
          f"{args.system_prompts} system prompts of {args.prefix_bytes} bytes, {args.streams} "
          f"streams, {args.max_tokens} tokens, {args.duration:g} s timed, hot phase "
          f"{args.hot_duration:g} s at {args.hot_share:.0%} one prompt; {args.rounds} rounds: "
          "median [min-max]\n")  # fmt: skip
    print("| arm | " + " | ".join(c[0] for c in COLUMNS) + " | server shares |")
    print("| --- " * (len(COLUMNS) + 2) + "|")
    medians: dict[str, dict[str, float]] = {}
    for arm in args.arms:
        mine = [r for r in rows if r.arm == arm]
        cells = [spread([getattr(r, key) for r in mine], fmt) for _, key, fmt in COLUMNS]
        shares = " / ".join(f"{statistics.median(r.shares[i] for r in mine):.2f}" for i in range(3))
        print(f"| {arm} | " + " | ".join(cells) + f" | {shares} |")
        medians[arm] = {key: statistics.median(getattr(r, key) for r in mine)
                        for _, key, _ in COLUMNS}  # fmt: skip
    if "affinity" in medians and "least_request" in medians:
        a, lr = medians["affinity"], medians["least_request"]
        p90, tps = a["ttft_p90_ms"] / lr["ttft_p90_ms"], a["tokens_per_s"] / lr["tokens_per_s"]
        hot = a["hot_active_max_over_mean"]
        print(f"\ntargets: TTFT p90 affinity/least_request {p90:.2f}x (<= 0.5: "
              f"{'MET' if p90 <= 0.5 else 'NOT MET'}); tokens/s {tps:.2f}x (>= 1.3: "
              f"{'MET' if tps >= 1.3 else 'NOT MET'}); hot phase max/mean in flight {hot:.2f}, "
              f"requests {a['hot_max_over_mean']:.2f} (<= 1.5: "
              f"{'MET' if max(hot, a['hot_max_over_mean']) <= 1.5 else 'NOT MET'})")  # fmt: skip
        pairs = list(zip([r for r in rows if r.arm == "affinity"],
                         [r for r in rows if r.arm == "least_request"], strict=True))  # fmt: skip
        for name, key, met in (("TTFT p90", "ttft_p90_ms", lambda x: x <= 0.5),
                               ("tokens/s", "tokens_per_s", lambda x: x >= 1.3)):  # fmt: skip
            ratios = [getattr(mine, key) / getattr(theirs, key) for mine, theirs in pairs]
            print(f"per round, affinity/least_request {name}: "
                  f"{', '.join(f'{x:.2f}' for x in ratios)} (met in "
                  f"{sum(map(met, ratios))} of {len(ratios)})")  # fmt: skip
        cpu = a["server_cpu_ms_per_token"] / lr["server_cpu_ms_per_token"]
        print(f"the servers' CPU per output token, affinity/least_request: {cpu:.2f}x (what "
              "tokens/s would gain where the servers had the cores to themselves)")  # fmt: skip
    print(f"other processes on the host (cores, median): "
          f"{statistics.median(r.others_cores for r in rows):.2f}")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default=",".join(ARMS), help=f"of {','.join(ARMS)}")
    p.add_argument("--rounds", type=int, default=3)
    add_workload_arguments(p, streams=32, duration=12.0, warmup=4.0)
    p.add_argument("--hot-duration", type=float, default=6.0)
    p.add_argument("--hot-share", type=float, default=0.8)
    p.add_argument("--factor", type=int, default=125, help="hash_balance_factor")
    p.add_argument("--event-loop", default="auto", choices=event_loop.CHOICES,
                   help="the model servers' --event-loop")  # fmt: skip
    p.add_argument(
        "--hysteresis",
        type=float,
        default=None,
        help="the model's routing.hysteresis, every arm (default: the product's)",
    )
    p.add_argument(
        "--kv-full-at",
        type=float,
        default=None,
        help="the model's routing.kv_full_at, every arm (default: the product's, 0.8; 1: off)",
    )
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=160,
        help="KV blocks per server (16 tokens each); 8 prompts need 208: 160 holds about 5, "
        "so the pool holds every prompt and no server holds all",
    )
    p.add_argument("--models", type=Path,
                   default=Path(tempfile.gettempdir()) / "bench-affinity")  # fmt: skip
    args = p.parse_args()
    args.arms = args.arms.split(",")
    args.models = repository(args.models, args.kv_blocks, args)
    rows = []
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    for i in range(args.rounds):
        for arm in args.arms:
            row = run_arm(args, arm)
            rows.append(row)
            print(f"round {i + 1}/{args.rounds} {arm}: TTFT p50 {row.ttft_p50_ms:.0f} ms, p90 "
                  f"{row.ttft_p90_ms:.0f} ms, {row.tokens_per_s:.0f} tokens/s, hit rate "
                  f"{row.hit_rate:.2f}, shares {[round(s, 2) for s in row.shares]}, hot max/mean "
                  f"{row.hot_max_over_mean:.2f} requests, {row.hot_active_max_over_mean:.2f} in "
                  f"flight, others {row.others_cores:.2f} cores; servers' CPU "
                  f"{row.server_cpu_ms_per_token:.2f} ms/token, client {row.client_cores:.2f} "
                  f"cores, Envoy {row.envoy_cores:.2f}", flush=True)  # fmt: skip
    report(rows, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
