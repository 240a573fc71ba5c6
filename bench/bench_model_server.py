"""Benchmark the model server with h2load sending raw gRPC ModelInfer frames.

Same method as the peer figures in shared/docs/PEERS.md: one pre-encoded ModelInfer frame,
h2load over h2c with ``-m 1`` (one stream per client), a discarded warm-up run, then a timed
run per concurrency level; QPS and percentiles from h2load's per-request log. h2load only
checks the HTTP status, so correctness comes from a grpcio call checked against onnxruntime
and from the server's own ``inference_requests_total{code=...}`` counter.

``--baseline`` runs bench/naive_server.py (the naive reference of PEERS.md) and the model
server alternately, a fresh process of each per round and level, and reports medians across
rounds and the ratios ours/naive: on a noisy host only side-by-side figures compare.

    .venv/bin/python bench/bench_model_server.py --duration 10 [--batch 8 --concurrency 16]
    .venv/bin/python bench/bench_model_server.py --baseline --concurrency 1,16 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2, service_pb2_grpc

from model_server.demo_models import MODEL_NAME, build_demo_repository

HOST = "127.0.0.1"
LISTEN_RE = re.compile(r"listening: grpc=127\.0\.0\.1:(\d+) metrics=127\.0\.0\.1:(\d+)")
READY_RE = re.compile(r"startup loading done: ready=(\w+)")
NAIVE_RE = re.compile(r"listening on 127\.0\.0\.1:(\d+)")
METHOD = "/inference.GRPCInferenceService/ModelInfer"


@dataclass
class Level:
    concurrency: int
    requests: int  # HTTP 200 responses in the timed window
    failed: int  # streams h2load logged with another status
    qps: float
    p50_ms: float
    p99_ms: float
    non_ok: dict[str, float]  # server-side non-OK codes, h2load's stop-time cancels excluded
    cancelled_at_stop: float  # in-flight streams h2load resets when -D ends (at most C)
    cpu_ms_per_request: float | None
    server_cores: float | None


def sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "n/a"


def ensure_h2load() -> str:
    if path := shutil.which("h2load"):
        return path
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print("h2load not found; running: apt-get install -y nghttp2-client", flush=True)
        subprocess.run(["apt-get", "install", "-y", "nghttp2-client"], check=False)
        if path := shutil.which("h2load"):
            return path
    sys.exit("h2load not found: install the Debian package nghttp2-client (needs root)")


def make_request(batch: int) -> tuple[np.ndarray, service_pb2.ModelInferRequest]:
    x = np.random.default_rng(1234).standard_normal((batch, 3, 32, 32)).astype(np.float32)
    req = service_pb2.ModelInferRequest(model_name=MODEL_NAME)
    req.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    req.outputs.add(name="probs")
    req.raw_input_contents.append(x.tobytes())
    return x, req


def cpu_seconds(pid: int | None) -> float | None:
    if pid is None:
        return None
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def settled_counts(metrics_url: str | None) -> dict[str, float] | None:
    """Non-OK request counts by code, read once the server has no request in flight."""
    if metrics_url is None:
        return None
    deadline = time.monotonic() + 15
    while True:
        try:
            with urllib.request.urlopen(metrics_url, timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            return None
        counts: dict[str, float] = {}
        in_flight = 0.0
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "inference_in_flight_requests":
                    in_flight += s.value
                elif s.name == "inference_requests_total" and s.labels.get("code") != "OK":
                    counts[s.labels["code"]] = counts.get(s.labels["code"], 0.0) + s.value
        if in_flight == 0 or time.monotonic() > deadline:
            return counts
        time.sleep(0.02)


@dataclass(frozen=True)
class ServerSpec:
    name: str
    cmd: list[str]
    listen: re.Pattern[str]  # group 1: gRPC port; group 2 (if any): metrics port
    ready: re.Pattern[str] | None = None  # group 1 must read "True"


def our_server(models: Path) -> ServerSpec:
    cmd = [sys.executable, "-m", "model_server", "--model-repository", str(models), "--host", HOST]
    cmd += ["--port", "0", "--metrics-port", "0", "--models", MODEL_NAME]
    return ServerSpec("ours", cmd, LISTEN_RE, READY_RE)


def naive_server(models: Path) -> ServerSpec:
    script = Path(__file__).with_name("naive_server.py")
    cmd = [sys.executable, str(script), "--model", str(latest_model(models)), "--port", "0"]
    return ServerSpec("naive", cmd, NAIVE_RE)


def latest_model(models: Path) -> Path:
    latest = max(int(p.name) for p in (models / MODEL_NAME).iterdir() if p.name.isdigit())
    return models / MODEL_NAME / str(latest) / "model.onnx"


@contextmanager
def start_server(spec: ServerSpec, log_path: Path) -> Iterator[tuple[int, int, int | None]]:
    """Yield (pid, grpc_port, metrics_port) of a fresh server on 127.0.0.1; SIGTERM at exit."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(spec.cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            text = log_path.read_text(errors="replace")
            listen = spec.listen.search(text)
            ready = spec.ready.search(text) if spec.ready else listen
            if listen and ready:
                if spec.ready and ready[1] != "True":
                    sys.exit(f"{spec.name} server started but is not ready:\n{text[-3000:]}")
                break
            if proc.poll() is not None:
                sys.exit(f"{spec.name} server exited with {proc.returncode}:\n{text[-3000:]}")
            if time.monotonic() > deadline:
                sys.exit(f"{spec.name} server not ready within 180 s:\n{text[-3000:]}")
            time.sleep(0.05)
        yield proc.pid, int(listen[1]), int(listen[2]) if spec.listen.groups > 1 else None
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                print(f"{spec.name} server still running 30 s after SIGTERM; killing it", flush=True)
                proc.kill()
                proc.wait()
        if proc.returncode != 0:
            print(f"{spec.name} server exit code after SIGTERM: {proc.returncode}")


def check_correctness(
    target: str, req: service_pb2.ModelInferRequest, x: np.ndarray, models: Path
) -> str:
    with grpc.insecure_channel(target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            resp = stub.ModelInfer(req, timeout=30)
        except grpc.RpcError as exc:
            sys.exit(f"correctness check: ModelInfer failed: {exc.code()} {exc.details()}")
    got = np.frombuffer(resp.raw_output_contents[0], dtype=np.float32).reshape(x.shape[0], 10)
    version = resp.model_version or latest_model(models).parent.name  # naive: no version
    model_file = models / MODEL_NAME / version / "model.onnx"
    sess = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    want = sess.run(["probs"], {"input": x})[0]
    err = float(np.max(np.abs(got - want)))
    if err > 1e-5:
        sys.exit(f"correctness check FAILED: max |server - onnxruntime| = {err:.3g}")
    return f"grpc OK, version {resp.model_version}, max |server - onnxruntime| = {err:.2g}"


def ort_floor_ms(models: Path, x: np.ndarray) -> float:
    """Median ms per batch of onnxruntime in this process, one thread, latest version."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    path = latest_model(models)
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    times = []
    for i in range(220):
        t0 = time.perf_counter()
        sess.run(["probs"], {"input": x})
        if i >= 20:  # the first runs warm the arena and caches
            times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def h2load(exe: str, url: str, data: Path, clients: int, seconds: float, log: Path) -> None:
    cmd = [exe, "-c", str(clients), "-m", "1", "-t", "1", "-D", f"{round(seconds * 1000)}ms"]
    cmd += ["-d", str(data), "-H", "content-type: application/grpc", "-H", "te: trailers"]
    out = subprocess.run([*cmd, "--log-file", str(log), url], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"h2load failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")


def run_level(
    args: argparse.Namespace, exe: str, url: str, c: int, workdir: Path, pid: int | None,
    metrics_url: str | None,
) -> Level:  # fmt: skip
    data = workdir / "frame.bin"
    h2load(exe, url, data, c, args.warmup, workdir / "warmup.log")  # discarded
    before = settled_counts(metrics_url)
    cpu0 = cpu_seconds(pid)
    log = workdir / f"c{c}.log"
    h2load(exe, url, data, c, args.duration, log)
    cpu1 = cpu_seconds(pid)
    after = settled_counts(metrics_url)
    rows = [line.split("\t") for line in log.read_text().splitlines() if line.strip()]
    lat_ms = np.array([float(r[2]) / 1e3 for r in rows if r[1] == "200"])
    ok = len(lat_ms)
    non_ok: dict[str, float] = {"n/a": float("nan")}
    if before is not None and after is not None:
        non_ok = {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}
    cancelled = non_ok.pop("CANCELLED", 0.0) if non_ok.get("CANCELLED", 0.0) <= c else 0.0
    cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
    return Level(
        concurrency=c,
        requests=ok,
        failed=len(rows) - ok,
        qps=ok / args.duration,
        p50_ms=float(np.percentile(lat_ms, 50)) if ok else float("nan"),
        p99_ms=float(np.percentile(lat_ms, 99)) if ok else float("nan"),
        non_ok=non_ok,
        cancelled_at_stop=cancelled,
        cpu_ms_per_request=cpu * 1e3 / ok if cpu is not None and ok else None,
        server_cores=cpu / args.duration if cpu is not None else None,
    )


def loopback_port(url: str) -> int:
    m = re.fullmatch(r"(?:https?://)?(?:127\.0\.0\.1|localhost):(\d+)(?:/metrics)?/?", url)
    if m is None:
        sys.exit(f"--url/--metrics-url must be 127.0.0.1:PORT (loopback only), got {url!r}")
    return int(m[1])


@dataclass
class Run:
    """One server process measured at some levels: results, correctness line, log errors."""

    server: str
    levels: list[Level]
    check: str
    problems: list[str] = field(default_factory=list)


@contextmanager
def target(
    args: argparse.Namespace, spec: ServerSpec, log: Path
) -> Iterator[tuple[int | None, int, str | None]]:
    """(server pid or None, gRPC port, metrics URL or None) of the server under test."""
    if args.url:
        port = loopback_port(args.url)
        mport = loopback_port(args.metrics_url) if args.metrics_url else port + 1000
        yield None, port, f"http://{HOST}:{mport}/metrics"
        return
    with start_server(spec, log) as (pid, port, mport):
        yield pid, port, None if mport is None else f"http://{HOST}:{mport}/metrics"


def measure(
    args: argparse.Namespace, spec: ServerSpec, exe: str, levels: list[int], workdir: Path,
    x: np.ndarray, req: service_pb2.ModelInferRequest,
) -> Run:  # fmt: skip
    log = workdir / f"{spec.name}.log"
    with target(args, spec, log) as (pid, port, metrics_url):
        check = check_correctness(f"{HOST}:{port}", req, x, args.models)
        url = f"http://{HOST}:{port}{METHOD}"
        results = [run_level(args, exe, url, c, workdir, pid, metrics_url) for c in levels]
    lines = log.read_text(errors="replace").splitlines() if pid else []
    problems = [ln for ln in lines if re.search(r" (ERROR|CRITICAL) |Traceback", ln)]
    return Run(spec.name, results, check, problems)


def fmt_cpu(value: float | None) -> str:
    return "n/a" if value is None or value != value else f"{value:.3f}"


def median(values: list[float | None]) -> float:
    real = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.median(real)) if real else float("nan")


def baseline(args: argparse.Namespace, exe: str, levels: list[int], workdir: Path,
             x: np.ndarray, req: service_pb2.ModelInferRequest) -> list[Run]:  # fmt: skip
    """Ours and naive alternately, --rounds times per level, a fresh process each time."""
    specs = (our_server(args.models), naive_server(args.models))
    runs = []
    for c in levels:
        for i in range(args.rounds):
            for spec in specs:
                run = measure(args, spec, exe, [c], workdir, x, req)
                lv = run.levels[0]
                print(f"c{c} round {i + 1}/{args.rounds} {spec.name}: {lv.qps:,.0f} QPS, "
                      f"p50 {lv.p50_ms:.2f} ms, CPU {fmt_cpu(lv.cpu_ms_per_request)} ms/request",
                      flush=True)  # fmt: skip
                runs.append(run)
    return runs


def print_baseline(runs: list[Run], levels: list[int]) -> dict[str, object]:
    def of(server: str, c: int) -> list[Level]:
        return [r.levels[0] for r in runs if r.server == server and r.levels[0].concurrency == c]

    print("\n| concurrency | server | QPS | p50 ms | p99 ms | server CPU ms/request | cores |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    summary: dict[str, object] = {}
    for c in levels:
        for server in ("ours", "naive"):
            lv = of(server, c)
            med = {k: median([getattr(v, k) for v in lv]) for k in asdict(lv[0]) if k not in
                   ("concurrency", "non_ok")}  # fmt: skip
            summary[f"{server}_c{c}"] = med
            row = [f"{med['qps']:,.0f}", f"{med['p50_ms']:.2f}", f"{med['p99_ms']:.2f}"]
            row += [fmt_cpu(med["cpu_ms_per_request"]), f"{med['server_cores']:.2f}"]
            print(f"| {c} | {server} | " + " | ".join(row) + " |")
    print("\n| concurrency | QPS ours/naive | CPU per request ours/naive | per-round QPS ratios "
          "| per-round CPU ratios |")  # fmt: skip
    print("| --- | --- | --- | --- | --- |")
    for c in levels:
        ours, naive = of("ours", c), of("naive", c)
        qps = [o.qps / n.qps for o, n in zip(ours, naive, strict=True)]
        cpu = [(o.cpu_ms_per_request or math.nan) / (n.cpu_ms_per_request or math.nan)
               for o, n in zip(ours, naive, strict=True)]  # fmt: skip
        q_ratio = median([o.qps for o in ours]) / median([n.qps for n in naive])
        c_ratio = median([o.cpu_ms_per_request for o in ours]) / median(
            [n.cpu_ms_per_request for n in naive]
        )
        summary[f"ratio_c{c}"] = {"qps": q_ratio, "cpu_per_request": c_ratio}
        per_q, per_c = ", ".join(f"{v:.2f}" for v in qps), ", ".join(f"{v:.2f}" for v in cpu)
        print(f"| {c} | {q_ratio:.2f} | {c_ratio:.2f} | {per_q} | {per_c} |")
    print("\nratios are of the medians; per-round ratios pair each ours run with the naive run "
          "right after it")  # fmt: skip
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description="Benchmark the model server with h2load (gRPC).")
    p.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "infermesh-bench")
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated client counts")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per level")
    p.add_argument("--warmup", type=float, default=2.0, help="discarded seconds before each level")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--url", help="benchmark a running server at 127.0.0.1:PORT instead")
    p.add_argument("--metrics-url", help="with --url: its metrics port (default gRPC port + 1000)")
    p.add_argument("--baseline", action="store_true", help="alternate with bench/naive_server.py")
    p.add_argument("--rounds", type=int, default=3, help="with --baseline: runs per server/level")
    p.add_argument("--json", type=Path, help="write machine-readable results here")
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if args.baseline and args.url:
        sys.exit("--baseline starts both servers itself; it does not take --url")
    for url in (args.url, args.metrics_url):
        if url:
            loopback_port(url)  # exits unless it is 127.0.0.1
    if not (args.models / MODEL_NAME / "config.pbtxt").exists():
        print(f"building demo repository in {args.models}", flush=True)
    build_demo_repository(args.models)
    exe = ensure_h2load()
    commit = sh(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"])
    nproc = sh(["nproc"])
    x, req = make_request(args.batch)
    floor = ort_floor_ms(args.models, x)

    with tempfile.TemporaryDirectory(prefix="bench-ms-") as tmp:
        workdir = Path(tmp)
        payload = req.SerializeToString()
        (workdir / "frame.bin").write_bytes(b"\0" + len(payload).to_bytes(4, "big") + payload)
        if args.baseline:
            runs = baseline(args, exe, levels, workdir, x, req)
        else:
            runs = [measure(args, our_server(args.models), exe, levels, workdir, x, req)]

    title = "model server vs naive baseline" if args.baseline else "model server"
    print(f"\n## {title}, batch {args.batch}: commit {commit}, nproc {nproc}")
    print(f"h2load -m 1 -t 1, {args.duration:g} s per level after a {args.warmup:g} s warm-up")
    if args.baseline:
        print(f"{args.rounds} rounds per level, ours then naive, each a fresh process; medians")
    for server in dict.fromkeys(r.server for r in runs):
        print(f"correctness ({server}): {next(r.check for r in runs if r.server == server)}")
    print(f"onnxruntime floor (in process, 1 thread, batch {args.batch}): {floor:.3f} ms per batch")
    results = [lv for r in runs for lv in r.levels]
    problems = [ln for r in runs for ln in r.problems]
    summary = print_baseline(runs, levels) if args.baseline else None
    if not args.baseline:
        print("\n| concurrency | QPS | p50 ms | p99 ms | non-OK | server CPU ms/request |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in results:
            bad = ", ".join(f"{k} {v:g}" for k, v in r.non_ok.items()) or "0"
            row = [f"{r.qps:,.0f}", f"{r.p50_ms:.2f}", f"{r.p99_ms:.2f}", bad]
            print(f"| {r.concurrency} | " + " | ".join([*row, fmt_cpu(r.cpu_ms_per_request)]) + " |")
    print()
    for run in runs:
        for r in run.levels:
            cores = "" if r.server_cores is None else f", server used {r.server_cores:.2f} cores"
            bad = ", ".join(f"{k} {v:g}" for k, v in r.non_ok.items() if k != "n/a")
            print(f"{run.server} c{r.concurrency}: {r.requests} OK, {r.failed} HTTP failures, "
                  f"{r.cancelled_at_stop:g} cancelled by h2load at stop{cores}"
                  + (f", non-OK {bad}" if bad else ""))  # fmt: skip
    if problems:
        print(f"server log: {len(problems)} error lines, first: {problems[0]}")
    if args.json:
        out = {
            "commit": commit, "nproc": nproc, "batch": args.batch, "duration_s": args.duration,
            "warmup_s": args.warmup, "ort_floor_ms": floor, "correctness": runs[0].check,
            "levels": [asdict(r) for r in results], "server_errors": problems,
        }  # fmt: skip
        if args.baseline:
            out["rounds"] = args.rounds
            out["runs"] = [asdict(r) for r in runs]
            out["summary"] = summary
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    bad_total = sum(v for r in results for v in r.non_ok.values() if v == v)
    return 1 if bad_total or any(r.failed for r in results) or problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
