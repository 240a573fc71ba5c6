"""Benchmark telemetry: what model-server OTLP export costs the mesh, and the receiver's CPU.

1. The mesh of bench_mesh.py (two model servers, control plane, Envoy with one worker, header
   routing) with the servers' telemetry off, exporting every 1 s and every 0.2 s to the control
   plane's OTLP port; settings alternate within each round, servers restarted per setting on the
   same ports (nothing else changes).
2. In process: TelemetryStore.ingest of realistic export requests
   (model_server.observability.telemetry's builder), then the full gRPC path (start_receiver
   + grpc.aio clients), and as_json.

    .venv/bin/python bench/bench_telemetry.py [--rounds 2 --concurrency 16,64 --endpoints 100,1000]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import re
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import bench_mesh as bm
import bench_model_server as bms
import grpc
import numpy as np
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

from control_plane.telemetry.receiver import EXPORT_METHOD, start_receiver
from control_plane.telemetry.store import TelemetryStore
from model_server.demo_models import MODEL_NAME, build_demo_repository
from model_server.observability.metrics import ServerMetrics
from model_server.observability.telemetry import build_request

HOST = bms.HOST
SETTINGS: tuple[tuple[str, float | None], ...] = (
    ("telemetry off", None), ("export every 1 s", 1.0), ("export every 0.2 s", 0.2))  # fmt: skip


@dataclass
class MeshRun:
    setting: str
    sample: bm.Sample
    cp_cpu_pct: float  # control plane CPU over warm-up + timed run + counter reads


def server_cmd(models: Path, port: int, mport: int, otlp: int, interval: float | None) -> list[str]:
    cmd = [sys.executable, "-m", "model_server", "--model-repository", str(models), "--host", HOST,
           "--port", str(port), "--metrics-port", str(mport), "--models", MODEL_NAME]  # fmt: skip
    if interval is not None:
        cmd += ["--otlp-endpoint", f"{HOST}:{otlp}", "--telemetry-interval", str(interval)]
    return cmd


def mesh_part(args: argparse.Namespace, levels: list[int]) -> tuple[list[MeshRun], list[str]]:
    build_demo_repository(args.models)
    exe = bms.ensure_h2load()
    _, req = bms.make_request(1)
    payload = req.SerializeToString()
    notes: list[str] = []
    runs: list[MeshRun] = []
    with tempfile.TemporaryDirectory(prefix="bench-tel-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        (workdir / "frame.bin").write_bytes(b"\0" + len(payload).to_bytes(4, "big") + payload)
        ports = [(bm.free_port(), bm.free_port()) for _ in (1, 2)]
        listener, otlp = bm.free_port(), bm.free_port()
        topology = bm.write_topology(workdir / "topology.yaml", listener,
                                     [f"{HOST}:{p}" for p, _ in ports])  # fmt: skip
        cp_cmd = [sys.executable, "-m", "control_plane", "--topology", str(topology),
                  "--xds-port", "0", "--admin-port", "0", "--otlp-port", str(otlp)]  # fmt: skip
        cp_pid, xds_port, cp_admin = stack.enter_context(bms.start_server(
            bms.ServerSpec("control plane", cp_cmd, bm.CP_RE), workdir / "cp.log"))  # fmt: skip
        envoy_pid, envoy_admin = stack.enter_context(bm.start_envoy(workdir, xds_port))
        envoy, cp = bm.Admin(envoy_admin), bm.Admin(cp_admin or 0)
        bm.wait_for(lambda: envoy.call("/ready").strip() == "LIVE", 30, "Envoy /ready")
        healthy = re.compile(f"^{bm.CLUSTER}::.*::health_flags::healthy$", re.M)
        for rnd, (name, interval) in itertools.product(range(args.rounds), SETTINGS):
            with ExitStack() as servers_stack:
                servers = [servers_stack.enter_context(bms.start_server(
                    bms.ServerSpec(f"server {i}", server_cmd(args.models, p, m, otlp, interval),
                                   bms.LISTEN_RE, bms.READY_RE),
                    workdir / f"server{i}.log")) for i, (p, m) in enumerate(ports, 1)
                ]  # fmt: skip
                bm.wait_for(lambda: len(healthy.findall(envoy.call("/clusters"))) == 2, 30,
                            "2 healthy hosts")  # fmt: skip
                time.sleep(1.0)
                mesh = bm.Mesh(servers, envoy_pid, envoy_admin, cp_admin or 0, listener)
                for c in levels:
                    cpu0, t0 = bms.cpu_seconds(cp_pid) or 0.0, time.perf_counter()
                    s = bm.run_once(args, exe, mesh, (name, listener, True), c, workdir)
                    pct = ((bms.cpu_seconds(cp_pid) or 0.0) - cpu0) / (time.perf_counter() - t0)
                    runs.append(MeshRun(name, s, pct * 100))
                    print(f"round {rnd + 1} c{c} {name}: {bms.fmt_row(s.level)} | "
                          f"CP {pct:.1%}", flush=True)  # fmt: skip
                tel = json.loads(cp.call("/telemetry"))["endpoints"]
                seen = {k: round(v["interval_s"], 2) for k, v in tel.items()
                        if v["age_s"] < 3 * (interval or 1)}  # fmt: skip
                notes.append(f"round {rnd + 1} {name}: control plane /telemetry fresh endpoints "
                             f"(observed interval s): {seen or 'none'}")  # fmt: skip
        notes += [f"{f.name}: {ln}" for f in sorted(workdir.glob("*.log"))
                  for ln in f.read_text(errors="replace").splitlines()
                  if bm.PROBLEM_RE.search(ln)][:5]  # fmt: skip
    return runs, notes


def mesh_report(runs: list[MeshRun], levels: list[int]) -> None:
    print(
        "\n| concurrency | setting | QPS | p50 ms | p99 ms | non-OK | Envoy CPU ms/request | "
        "Envoy cores | servers CPU ms/request | control plane CPU % | QPS / off | p50 / off | "
        "p99 / off | servers CPU / off | QPS / off per round |\n" + "| --- " * 15 + "|"
    )
    for c in levels:

        def pick(name: str, c: int = c) -> list[MeshRun]:
            return [r for r in runs if r.setting == name and r.sample.level.concurrency == c]

        base_runs = pick(SETTINGS[0][0])
        base = bms.median_level([r.sample.level for r in base_runs])
        base_cpu = bms.median([r.sample.server_cpu_ms for r in base_runs])
        for name, _ in SETTINGS:
            group = pick(name)
            m = bms.median_level([r.sample.level for r in group])
            cpu = bms.median([r.sample.server_cpu_ms for r in group])
            cells = [cpu, bms.median([r.cp_cpu_pct for r in group]), m.qps / base.qps,
                     m.p50_ms / base.p50_ms, m.p99_ms / base.p99_ms, cpu / base_cpu]  # fmt: skip
            per_round = [r.sample.level.qps / b.sample.level.qps
                         for r, b in zip(group, base_runs, strict=True)]  # fmt: skip
            print(f"| {c} | {name} | {bms.fmt_row(m)} | " + " | ".join(f"{x:.2f}" for x in cells)
                  + " | " + ", ".join(f"{x:.2f}" for x in per_round) + " |")  # fmt: skip


def sample_registry() -> ServerMetrics:
    """A model server's registry after traffic to 2 versions (latency spread over buckets)."""
    m, rng = ServerMetrics(), np.random.default_rng(7)
    for version in ("1", "2"):
        m.publish_model_version(MODEL_NAME, version, "READY", "CPUExecutionProvider", None)
        m.model_load_time.labels(MODEL_NAME).observe(120)
        for latency in rng.lognormal(math.log(0.004), 0.8, 2000):
            m.request_duration.labels(MODEL_NAME, version).observe(float(latency))
        m.requests.labels(MODEL_NAME, version, "OK").inc(1995)
        m.requests.labels(MODEL_NAME, version, "UNAVAILABLE").inc(5)
    m.batch_size.labels(MODEL_NAME).observe(1)
    m.queue_depth.labels(MODEL_NAME).set(3)
    m.in_flight.set(4)
    m.memory_used.labels("cpu", "process").set(3e8)
    m.memory_total.labels("cpu", "process").set(8e9)
    m.draining.set(0)
    return m


def points_in(req: ExportMetricsServiceRequest) -> int:
    metrics = [m for rm in req.resource_metrics for sm in rm.scope_metrics for m in sm.metrics]
    return sum(len(getattr(m, str(m.WhichOneof("data"))).data_points) for m in metrics)


async def grpc_rounds(blobs: list[bytes], rounds: int) -> tuple[float, float]:
    """(whole-process CPU s, wall s) for ROUNDS of all blobs sent at once."""
    store = TelemetryStore()
    server, port = await start_receiver(store, None, HOST, 0)
    channels = [grpc.aio.insecure_channel(f"{HOST}:{port}") for _ in blobs]
    calls = [ch.unary_unary(EXPORT_METHOD, None, ExportMetricsServiceResponse.FromString)
             for ch in channels]  # fmt: skip
    await asyncio.gather(*(ch.channel_ready() for ch in channels))
    try:
        cpu0, t0 = bms.cpu_seconds(os.getpid()) or 0.0, time.perf_counter()
        for _ in range(rounds):
            answers = await asyncio.gather(
                *(call(b, timeout=60) for call, b in zip(calls, blobs, strict=True))
            )
            if bad := [a for a in answers if a.HasField("partial_success")][:1]:
                sys.exit(f"receiver partial success: {bad[0].partial_success}")
        cpu = (bms.cpu_seconds(os.getpid()) or 0.0) - cpu0
        wall = time.perf_counter() - t0
    finally:
        await asyncio.gather(*(ch.close() for ch in channels))
        await server.stop(0.5)
    snap = store.as_json(time.monotonic())["endpoints"]
    if len(snap) != len(blobs):
        sys.exit(f"receiver stored {len(snap)} endpoints, expected {len(blobs)}")
    return cpu, wall


def receiver_part(endpoint_counts: list[int], rounds: int) -> None:
    registry = sample_registry().registry
    one = build_request(registry, "127.0.0.1:1")
    sent, hist = points_in(one), one.resource_metrics[0].scope_metrics[0].metrics
    buckets = max(len(m.histogram.data_points[0].bucket_counts) for m in hist if m.HasField(
        "histogram"))  # fmt: skip
    accepted = TelemetryStore().ingest(one, 0.0).points
    print(f"\n## Receiver CPU: commit {bm.commit()}, nproc {os.cpu_count()}\n")
    print(f"One export request: {sent} data points sent, {accepted} accepted by the store "
          f"(the rest are metrics it does not use), {len(one.SerializeToString())} bytes, "
          f"largest histogram {buckets} buckets; {rounds} rounds, one request per endpoint "
          "per round, the receiver's clock advancing 1 s per round\n")  # fmt: skip
    print(
        "| endpoints | path | points sent / request | CPU s | CPU ms / 1,000 points sent | "
        "points sent / s (per CPU s) | CPU ms / request | wall s |\n" + "| --- " * 8 + "|"
    )
    for n in endpoint_counts:
        reqs = [build_request(registry, f"10.0.{i // 250}.{i % 250}:8001") for i in range(n)]
        blobs = [r.SerializeToString() for r in reqs]
        total = sent * n * rounds
        rows: list[tuple[str, float, float]] = []
        store, cpu0, t0 = TelemetryStore(), time.process_time(), time.perf_counter()
        for rnd in range(rounds):
            for r in reqs:
                store.ingest(r, float(rnd))
        rows.append(("TelemetryStore.ingest", time.process_time() - cpu0, time.perf_counter() - t0))
        store, cpu0, t0 = TelemetryStore(), time.process_time(), time.perf_counter()
        for rnd in range(rounds):
            for b in blobs:
                store.ingest(ExportMetricsServiceRequest.FromString(b), float(rnd))
        rows.append(("decode bytes + ingest", time.process_time() - cpu0, time.perf_counter() - t0))
        cpu, wall = asyncio.run(grpc_rounds(blobs, rounds))
        rows.append((f"gRPC: start_receiver + {n} grpc.aio clients, whole process", cpu, wall))
        for path, cpu, wall in rows:
            print(
                f"| {n} | {path} | {sent} | {cpu:.3f} | {cpu * 1e6 / total:.2f} | "
                f"{total / cpu:,.0f} | {cpu * 1e3 / (n * rounds):.3f} | {wall:.3f} |"
            )
        if n == max(endpoint_counts):
            times: list[tuple[float, float]] = []
            for _ in range(5):
                t0 = time.perf_counter()
                doc = store.as_json(float(rounds))
                t1 = time.perf_counter()
                json.dumps(doc)
                times.append(((t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3))
            a, d = (np.median([t[i] for t in times]) for i in (0, 1))
            print(f"\nas_json(now) for {len(doc['endpoints'])} endpoints: median {a:.1f} ms "
                  f"(+ json.dumps {d:.1f} ms; 5 calls)")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description="Benchmark model-server telemetry and the receiver.")
    p.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "infermesh-bench")
    p.add_argument("--concurrency", default="16,64", help="comma-separated client counts")
    p.add_argument("--duration", type=float, default=8.0, help="seconds per timed run")
    p.add_argument("--warmup", type=float, default=2.0, help="discarded seconds before each run")
    p.add_argument("--rounds", type=int, default=2, help="runs per setting, alternating")
    p.add_argument("--endpoints", default="100,1000", help="simulated endpoints (receiver)")
    p.add_argument("--receiver-rounds", type=int, default=10)
    p.add_argument("--skip-mesh", action="store_true")
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    load_avg = os.getloadavg()[0]
    runs, notes = ([], []) if args.skip_mesh else mesh_part(args, levels)
    if runs:
        print(f"\n## Cost of seeing, batch 1 via Envoy + header: commit {bm.commit()}, nproc "
              f"{os.cpu_count()}, load average at start {load_avg:.2f}")  # fmt: skip
        print(f"h2load -m 1 -t 1, {args.duration:g} s per run after a {args.warmup:g} s warm-up;"
              f" {args.rounds} rounds, settings alternating, servers restarted per setting; "
              "medians of the rounds; control plane CPU % over warm-up + run")  # fmt: skip
        mesh_report(runs, levels)
        print("\n" + "\n".join(notes))
    receiver_part([int(n) for n in args.endpoints.split(",")], args.receiver_rounds)
    bad = sum(sum(r.sample.level.non_ok.values()) + r.sample.level.failed for r in runs)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
