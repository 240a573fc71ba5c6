"""Benchmark the model server with h2load sending raw gRPC ModelInfer frames.

Same method as the peer figures (bench_peers.py): one pre-encoded ModelInfer frame,
h2load over h2c with ``-m 1`` (one stream per client), a discarded warm-up run, then a timed
run per concurrency level; QPS and percentiles from h2load's per-request log. h2load only
checks the HTTP status, so correctness comes from a grpcio call checked against onnxruntime
and from the server's own ``inference_requests_total{code=...}`` counter.

``--baseline`` runs bench/naive_server.py (the naive reference server) and the model
server alternately, a fresh process of each per round and level, and reports medians across
rounds and the ratios ours/naive: on a noisy host only side-by-side figures compare.
``--baseline-source DIR`` makes the baseline the model server of another source tree instead
(a ``git worktree`` of an earlier commit, run with ``PYTHONPATH=DIR``): a before/after of a
change, side by side in one run.

    .venv/bin/python bench/bench_model_server.py --duration 10 [--batch 8 --concurrency 16]
    .venv/bin/python bench/bench_model_server.py --baseline --concurrency 1,16 --rounds 3
    git worktree add /tmp/before REV
    .venv/bin/python bench/bench_model_server.py --baseline --baseline-source /tmp/before
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
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

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


def stat_cpu_seconds(stat: Path) -> float:
    """User + system CPU seconds from a /proc ``stat`` file (a process's or one thread's)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def cpu_seconds(pid: int | None) -> float | None:
    return None if pid is None else stat_cpu_seconds(Path(f"/proc/{pid}/stat"))


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
    source: Path | None = None  # another source tree (PYTHONPATH), for a before/after


def server_specs(models: Path, before: Path | None = None) -> tuple[ServerSpec, ServerSpec]:
    """Our server and the baseline (bench/naive_server.py, or our server from the source tree
    ``before``), each on a free 127.0.0.1 port."""
    ours = [sys.executable, "-m", "model_server", "--model-repository", str(models), "--host", HOST]
    ours += ["--port", "0", "--metrics-port", "0", "--models", MODEL_NAME]
    if before is not None:
        return ServerSpec("ours", ours, LISTEN_RE, READY_RE), ServerSpec(
            "before", ours, LISTEN_RE, READY_RE, source=before
        )
    naive = [sys.executable, str(Path(__file__).with_name("naive_server.py")), "--port", "0"]
    naive += ["--model", str(latest_model(models))]
    return ServerSpec("ours", ours, LISTEN_RE, READY_RE), ServerSpec("naive", naive, NAIVE_RE)


def latest_model(models: Path) -> Path:
    latest = max(int(p.name) for p in (models / MODEL_NAME).iterdir() if p.name.isdigit())
    return models / MODEL_NAME / str(latest) / "model.onnx"


@contextmanager
def start_server(spec: ServerSpec, log_path: Path) -> Iterator[tuple[int, int, int | None]]:
    """Yield (pid, grpc_port, metrics_port) of a fresh server on 127.0.0.1; SIGTERM at exit."""
    env, cwd = None, None
    if spec.source is not None:  # that tree's packages first, and run from it
        env, cwd = {**os.environ, "PYTHONPATH": str(spec.source)}, spec.source
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(spec.cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
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
                print(f"{spec.name} server still running 30 s after SIGTERM; killing it")
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
    shown = resp.model_version or f"{version} (none reported)"
    return f"grpc OK, version {shown}, max |server - onnxruntime| = {err:.2g}"


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
    log.unlink(missing_ok=True)  # h2load appends to --log-file: never count an earlier run
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
    problems: list[str]


def measure(
    args: argparse.Namespace, spec: ServerSpec, exe: str, levels: list[int], workdir: Path,
    x: np.ndarray, req: service_pb2.ModelInferRequest,
) -> Run:  # fmt: skip
    """Starts the server (unless --url names a running one) and measures it at ``levels``."""
    log, mport = workdir / f"{spec.name}.log", None
    with ExitStack() as stack:
        if args.url:
            pid, port = None, loopback_port(args.url)
            mport = loopback_port(args.metrics_url) if args.metrics_url else port + 1000
        else:
            pid, port, mport = stack.enter_context(start_server(spec, log))
        metrics_url = None if mport is None else f"http://{HOST}:{mport}/metrics"
        check = check_correctness(f"{HOST}:{port}", req, x, args.models)
        url = f"http://{HOST}:{port}{METHOD}"
        results = [run_level(args, exe, url, c, workdir, pid, metrics_url) for c in levels]
    lines = log.read_text(errors="replace").splitlines() if pid else []
    problems = [ln for ln in lines if re.search(r" (ERROR|CRITICAL) |Traceback", ln)]
    return Run(spec.name, results, check, problems)


def baseline(args: argparse.Namespace, exe: str, levels: list[int], workdir: Path,
             x: np.ndarray, req: service_pb2.ModelInferRequest) -> list[Run]:  # fmt: skip
    """Ours then the baseline, --rounds times per level, each a fresh process on a free port."""
    runs = []
    for c in levels:
        for i in range(args.rounds):
            for spec in server_specs(args.models, args.baseline_source):
                runs.append(run := measure(args, spec, exe, [c], workdir, x, req))
                print(f"c{c} round {i + 1}/{args.rounds} {spec.name}: {fmt_row(run.levels[0])}")
    return runs


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "n/a" if value is None or math.isnan(value) else format(value, spec)


def fmt_row(r: Level) -> str:
    bad = ", ".join(f"{k} {v:g}" for k, v in r.non_ok.items() if k != "n/a")
    bad = bad or ("n/a" if "n/a" in r.non_ok else "0")  # n/a: no metrics (naive, --url)
    row = [fmt(r.qps, ",.0f"), fmt(r.p50_ms, ".2f"), fmt(r.p99_ms, ".2f"), bad]
    return " | ".join([*row, fmt(r.cpu_ms_per_request), fmt(r.server_cores, ".2f")])


def median(values: list[float | None]) -> float:
    real = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.median(real)) if real else math.nan


def median_level(levels: list[Level]) -> Level:
    """Medians of the rates across rounds; counts (requests, failures, non-OK codes) summed."""
    non_ok: dict[str, float] = {}
    for lv in levels:
        for code, n in lv.non_ok.items():
            non_ok[code] = non_ok.get(code, 0.0) + n
    changes: dict[str, Any] = {
        k: sum(getattr(lv, k) for lv in levels) for k in ("requests", "failed", "cancelled_at_stop")
    }
    for k in ("qps", "p50_ms", "p99_ms", "cpu_ms_per_request", "server_cores"):
        changes[k] = median([getattr(lv, k) for lv in levels])
    return replace(levels[0], non_ok=non_ok, **changes)


def ratios(runs: list[Run], c: int, key: str, other: str) -> tuple[float, list[float]]:
    """ours/other of the medians, and per round (each ours run against the other's after it)."""
    at_c = [r for r in runs if r.levels[0].concurrency == c]
    ours, theirs = ([getattr(r.levels[0], key) or math.nan for r in at_c if r.server == s]
                    for s in ("ours", other))  # fmt: skip
    return median(ours) / median(theirs), [o / n for o, n in zip(ours, theirs, strict=True)]


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
    p.add_argument(
        "--baseline-source", type=Path,
        help="with --baseline: our server from this source tree (an earlier commit) instead",
    )  # fmt: skip
    p.add_argument("--json", type=Path, help="write machine-readable results here")
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if args.baseline_source and not args.baseline:
        sys.exit("--baseline-source names the baseline: it needs --baseline")
    if args.baseline_source and not (args.baseline_source / "model_server").is_dir():
        sys.exit(f"--baseline-source {args.baseline_source}: no model_server/ there")
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
            spec = server_specs(args.models)[0]
            spec = replace(spec, name="running server") if args.url else spec
            runs = [measure(args, spec, exe, levels, workdir, x, req)]

    servers = list(dict.fromkeys(r.server for r in runs))
    table = [(s, median_level([lv for r in runs if r.server == s for lv in r.levels
              if lv.concurrency == c])) for c in levels for s in servers]  # fmt: skip
    other = "before" if args.baseline_source else "naive"
    title = f"model server vs {other} baseline" if args.baseline else "model server"
    print(f"\n## {title}, batch {args.batch}: commit {commit}, nproc {nproc}")
    print(f"h2load -m 1 -t 1, {args.duration:g} s per level after a {args.warmup:g} s warm-up")
    if args.baseline:
        print(f"{args.rounds} rounds per level, ours then {other}, each a fresh process; medians "
              "of the rounds, counts summed")  # fmt: skip
    for s in servers:
        print(f"correctness ({s}): {next(r.check for r in runs if r.server == s)}")
    print(f"onnxruntime floor (in process, 1 thread, batch {args.batch}): {floor:.3f} ms per batch")
    first = "| concurrency | server " if args.baseline else "| concurrency "
    print(f"\n{first}| QPS | p50 ms | p99 ms | non-OK | server CPU ms/request | cores |")
    print("| --- " * (7 + args.baseline) + "|")
    for s, r in table:
        print(f"| {r.concurrency} | " + (f"{s} | " if args.baseline else "") + fmt_row(r) + " |")
    summary = {}
    if args.baseline:
        print(f"\n| concurrency | QPS ours/{other} | CPU/request ours/{other} "
              "| per round (QPS; CPU) |")  # fmt: skip
        print("| --- | --- | --- | --- |")
        for c in levels:
            (q, qs) = ratios(runs, c, "qps", other)
            (u, us) = ratios(runs, c, "cpu_ms_per_request", other)
            summary[f"c{c}"] = {"qps_ratio": q, "cpu_per_request_ratio": u}
            rounds = ", ".join(f"{a:.2f}" for a in qs) + "; " + ", ".join(f"{b:.2f}" for b in us)
            print(f"| {c} | {q:.2f} | {u:.2f} | {rounds} |")
    print()
    for s, r in table:
        print(f"{s} c{r.concurrency}: {r.requests} OK, {r.failed} HTTP failures, "
              f"{r.cancelled_at_stop:g} cancelled by h2load at stop")  # fmt: skip
    problems = [f"{r.server}: {ln}" for r in runs for ln in r.problems]
    if problems:
        print(f"server log: {len(problems)} error lines, first: {problems[0]}")
    results = [lv for r in runs for lv in r.levels]
    if args.json:
        out = {
            "commit": commit, "nproc": nproc, "batch": args.batch, "duration_s": args.duration,
            "warmup_s": args.warmup, "ort_floor_ms": floor, "correctness": runs[0].check,
            "levels": [asdict(r) for _, r in table], "server_errors": problems,
        }  # fmt: skip
        if args.baseline:
            out |= {"rounds": args.rounds, "runs": [asdict(r) for r in runs], "ratios": summary}
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    bad_total = sum(v for r in results for v in r.non_ok.values() if v == v)
    return 1 if bad_total or any(r.failed for r in results) or problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
