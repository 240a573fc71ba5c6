"""Benchmark InferMesh's model server against the servers a user would pick instead.

Every server serves the same file, version 2 of the demo classifier
(``classifier/2/model.onnx``: input ``input`` FP32 [-1,3,32,32], output ``probs`` FP32
[-1,10]) with ONNX Runtime, one intra-op thread, behind the KServe v2 gRPC ``ModelInfer``
interface, so one pre-encoded gRPC frame drives them all:

- InferMesh model server, dynamic batching on (config.pbtxt ``dynamic_batching``), and
  unbatched for reference;
- InferMesh through the mesh: the batched model server behind the control plane and Envoy
  (``bench_mesh.py``'s processes), routed by the ``x-model-name: classifier`` header;
- PyTriton (nvidia-pytriton: a real Triton server, its dynamic batcher);
- KServe's Python model server (no server-side batching exists there; async ``predict``
  with onnxruntime offloaded to a thread, the best of its options measured);
- MLServer (adaptive batching, ``parallel_workers=0``).

Each peer runs a small script from bench/peers/ with the python of its own virtualenv
under ``$TMPDIR/infermesh-peers/<peer>`` (``--setup`` creates them; idempotent). Load is
bench_model_server.py's: h2load raw gRPC, ``-m 1 -t 1``, a discarded warm-up then a timed run
per concurrency level, QPS and p50/p99 from h2load's per-request log. h2load only checks the
HTTP status (a gRPC error is HTTP 200), so before and after every level a handful of requests
go through grpcio and must come back gRPC OK with outputs equal (1e-5) to onnxruntime run here
on the same file; InferMesh's own non-OK counter is read too. Every server is a fresh process
per round (``--rounds``, servers in turn within a round); the table shows medians.

Wrap measurements in the machine's benchmark lock (2 shared cores):

    .venv/bin/python bench/bench_peers.py --setup
    flock /tmp/infermesh-bench.lock .venv/bin/python bench/bench_peers.py --measure \\
        --json /tmp/peers.json
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
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path

import bench_mesh as mesh
import bench_model_server as bms
import grpc
import numpy as np
import onnxruntime as ort
from tritonclient.grpc import service_pb2, service_pb2_grpc

from model_server.demo_models import MODEL_NAME, build_demo_repository

HOST = bms.HOST
HERE = Path(__file__).resolve().parent
ROOT = Path(tempfile.gettempdir()) / "infermesh-peers"
READY_RE = re.compile(r"PEER READY grpc=127\.0\.0\.1:(\d+)")
VERSION = "2"  # the model file every server serves
PROBES = 5  # grpcio requests before and after each level

# Each peer's virtualenv: pinned to the versions measured (onnxruntime = ours).
PEER_REQUIREMENTS: dict[str, list[str]] = {
    "pytriton": ["nvidia-pytriton==0.7.0", f"onnxruntime=={ort.__version__}", "numpy<2"],
    "kserve": ["kserve==0.21.0", f"onnxruntime=={ort.__version__}", "numpy"],
    "mlserver": ["mlserver==1.7.1", "uvloop<0.22", f"onnxruntime=={ort.__version__}", "numpy"],
}
REPORTED = ("nvidia-pytriton", "kserve", "mlserver", "onnxruntime", "uvloop", "grpcio", "numpy")


@dataclass(frozen=True)
class Server:
    key: str
    label: str
    peer: str | None = None  # a bench/peers/ script in that virtualenv; None: InferMesh
    peer_args: tuple[str, ...] = ()  # extra flags for the peer script
    delay_us: int | None = None  # InferMesh dynamic_batching delay; None: --delay-us; -1: off
    frontends: int = 1  # InferMesh --frontends
    event_loop: str = "auto"  # InferMesh's and the naive server's --event-loop
    memo: bool = False  # the naive server's --memo: no model work, grpc.aio's ceiling


SERVERS = [
    Server("infermesh", "InferMesh, dynamic batching"),
    Server("infermesh-envoy", "InferMesh via Envoy, dynamic batching"),
    Server("infermesh-d500", "InferMesh, dynamic batching, 500 us delay", delay_us=500),
    Server("infermesh-unbatched", "InferMesh, no batching", delay_us=-1),
    Server("infermesh-before", "InferMesh from --before-source, dynamic batching"),
    Server("infermesh-f2", "InferMesh, dynamic batching, --frontends 2", frontends=2),
    Server("infermesh-f4", "InferMesh, dynamic batching, --frontends 4", frontends=4),
    Server(
        "infermesh-asyncio",
        "InferMesh, dynamic batching, asyncio's event loop",
        event_loop="asyncio",
    ),
    Server(
        "naive", "naive grpc.aio + ORT in a thread (bench/naive_server.py)", event_loop="asyncio"
    ),
    Server("naive-uvloop", "naive grpc.aio + ORT in a thread, on uvloop", event_loop="uvloop"),
    Server(
        "grpc-floor",
        "grpc.aio answering from memory, no model (naive_server.py --memo)",
        event_loop="asyncio",
        memo=True,
    ),
    Server(
        "grpc-floor-uvloop",
        "grpc.aio answering from memory, no model, on uvloop",
        event_loop="uvloop",
        memo=True,
    ),
    Server("pytriton", "PyTriton, dynamic batcher", "pytriton"),
    Server("pytriton-d0", "PyTriton, dynamic batcher, 0 us delay", "pytriton", ("--delay-us", "0")),
    Server("kserve", "KServe, async predict in a thread (no batching)", "kserve"),
    Server("mlserver", "MLServer, adaptive batching, parallel_workers=0", "mlserver"),
]
BY_KEY = {s.key: s for s in SERVERS}


@dataclass
class Target:
    """A started server: where h2load goes, and what tells about its health."""

    port: int
    header: bool  # send x-model-name (through Envoy)
    pid: int | None  # model server process whose CPU is counted (InferMesh only)
    metrics_url: str | None  # InferMesh's inference_requests_total


@dataclass
class Sample:
    server: str
    round: int
    level: bms.Level
    probes: int
    probe_errors: dict[str, int] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------
# --setup: one virtualenv per peer
# ---------------------------------------------------------------------------------------


def venv_python(peer: str) -> Path:
    return ROOT / peer / "bin" / "python"


def installed_versions(peer: str) -> dict[str, str]:
    out = subprocess.run([str(venv_python(peer)), "-m", "pip", "list", "--format", "json"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return {p["name"].lower(): p["version"] for p in json.loads(out)}


def setup_peer(peer: str) -> dict[str, str]:
    """Creates/updates ROOT/<peer> unless its marker already lists the same requirements."""
    marker, reqs = ROOT / peer / "infermesh-setup.json", PEER_REQUIREMENTS[peer]
    if marker.exists() and json.loads(marker.read_text()).get("requirements") == reqs:
        print(f"{peer}: up to date ({ROOT / peer})", flush=True)
    else:
        if not venv_python(peer).exists():
            print(f"{peer}: creating virtualenv {ROOT / peer}", flush=True)
            subprocess.run([sys.executable, "-m", "venv", str(ROOT / peer)], check=True)
        print(f"{peer}: pip install {' '.join(reqs)}", flush=True)
        subprocess.run([str(venv_python(peer)), "-m", "pip", "install", "-q", *reqs], check=True)
        marker.write_text(json.dumps({"requirements": reqs}) + "\n")
    versions = installed_versions(peer)
    return {k: versions[k] for k in REPORTED if k in versions}


def setup(peers: list[str]) -> dict[str, dict[str, str]]:
    ROOT.mkdir(parents=True, exist_ok=True)
    out = {peer: setup_peer(peer) for peer in peers}
    for peer, versions in out.items():
        print(f"{peer}: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    return out


# ---------------------------------------------------------------------------------------
# Starting the servers
# ---------------------------------------------------------------------------------------


def write_repository(path: Path, batched: bool, delay_us: int, instances: int) -> Path:
    """The demo repository; config.pbtxt with dynamic_batching (and instances) if batched."""
    build_demo_repository(path)
    config = path / MODEL_NAME / "config.pbtxt"
    text = re.sub(r"count: \d+", f"count: {instances}", config.read_text())
    if batched:
        text += f"dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}\n"
    config.write_text(text)
    return path


def model_server_spec(repo: Path, name: str, source: Path | None = None,
                      frontends: int = 1, loop: str = "auto") -> bms.ServerSpec:  # fmt: skip
    cmd = [sys.executable, "-m", "model_server", "--model-repository", str(repo), "--host", HOST,
           "--port", "0", "--metrics-port", "0", "--models", MODEL_NAME]  # fmt: skip
    if frontends > 1:
        cmd += ["--frontends", str(frontends)]
    if loop != "auto":
        cmd += ["--event-loop", loop]
    return bms.ServerSpec(name, cmd, bms.LISTEN_RE, bms.READY_RE, source=source)


@contextmanager
def start_infermesh(repo: Path, log: Path, source: Path | None = None,
                    frontends: int = 1, loop: str = "auto") -> Iterator[Target]:  # fmt: skip
    spec = model_server_spec(repo, "InferMesh", source, frontends, loop)
    with bms.start_server(spec, log) as (pid, port, mport):
        yield Target(port, False, pid, f"http://{HOST}:{mport}/metrics")


@contextmanager
def start_naive(model: Path, log: Path, loop: str, memo: bool) -> Iterator[Target]:
    """bench/naive_server.py: ModelInfer only, no checks, metrics or batching (its CPU counted)."""
    cmd = [sys.executable, str(HERE / "naive_server.py"), "--port", "0", "--model", str(model),
           "--event-loop", loop] + (["--memo"] if memo else [])  # fmt: skip
    with bms.start_server(bms.ServerSpec("naive", cmd, bms.NAIVE_RE), log) as (pid, port, _):
        yield Target(port, False, pid, None)


@contextmanager
def start_envoy_mesh(repo: Path, workdir: Path) -> Iterator[Target]:
    """One batched model server, the control plane and Envoy, as bench_mesh.py runs them."""
    with ExitStack() as stack:
        spec = model_server_spec(repo, "InferMesh (behind Envoy)")
        pid, port, mport = stack.enter_context(bms.start_server(spec, workdir / "ms.log"))
        listener = mesh.free_port()
        topology = mesh.write_topology(workdir / "topology.yaml", listener, [f"{HOST}:{port}"])
        cp_cmd = [sys.executable, "-m", "control_plane", "--topology", str(topology),
                  "--xds-port", "0", "--admin-port", "0"]  # fmt: skip
        cp_spec = bms.ServerSpec("control plane", cp_cmd, mesh.CP_RE)
        _, xds_port, _ = stack.enter_context(bms.start_server(cp_spec, workdir / "cp.log"))
        _, envoy_admin = stack.enter_context(mesh.start_envoy(workdir, xds_port))
        admin = mesh.Admin(envoy_admin)
        mesh.wait_for(lambda: admin.call("/ready").strip() == "LIVE", 30, "Envoy /ready")
        healthy = re.compile(f"^{mesh.CLUSTER}::.*::health_flags::healthy$", re.M)
        mesh.wait_for(lambda: len(healthy.findall(admin.call("/clusters"))) == 1, 30,
                      "a healthy host in Envoy")  # fmt: skip
        yield Target(listener, True, pid, f"http://{HOST}:{mport}/metrics")


def peer_command(args: argparse.Namespace, peer: str, model: Path) -> list[str]:
    cmd = [str(venv_python(peer)), str(HERE / "peers" / f"{peer}_server.py"), "--onnx",
           str(model), "--grpc-port", str(mesh.free_port()), "--rest-port",
           str(mesh.free_port())]  # fmt: skip
    if peer == "pytriton":
        cmd += ["--metrics-port", str(mesh.free_port()), "--delay-us", str(args.pytriton_delay_us)]
    if peer == "mlserver":
        cmd += ["--batch-time-ms", str(args.mlserver_batch_ms)]
    return cmd


def peer_env(peer: str) -> dict[str, str]:
    """PyTriton's Python backend stub must load the running interpreter's libpython."""
    env = dict(os.environ)
    if peer == "pytriton":
        code = "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"
        libdir = subprocess.run([str(venv_python(peer)), "-c", code], capture_output=True,
                                text=True, check=True).stdout.strip()  # fmt: skip
        env["LD_LIBRARY_PATH"] = ":".join(filter(None, [libdir, env.get("LD_LIBRARY_PATH")]))
    return env


def stop_process(proc: subprocess.Popen[bytes], name: str) -> None:
    """SIGTERM to the PID, SIGKILL after 30 s; then its process group (tritonserver) too."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            print(f"{name} still running 30 s after SIGTERM; killing it", flush=True)
            proc.kill()
            proc.wait()
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # children left behind, if any (own session)


def wait_ready(proc: subprocess.Popen[bytes], log: Path, name: str, deadline_s: float) -> int:
    deadline = time.monotonic() + deadline_s
    while not (m := READY_RE.search(log.read_text(errors="replace"))):
        if proc.poll() is not None or time.monotonic() > deadline:
            why = f"exited with {proc.returncode}" if proc.poll() is not None else "not ready"
            sys.exit(f"{name} {why}:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.05)
    with grpc.insecure_channel(f"{HOST}:{m[1]}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        ready_req = service_pb2.ModelReadyRequest(name=MODEL_NAME)
        mesh.wait_for(lambda: bool(stub.ModelReady(ready_req, timeout=5).ready),
                      max(1.0, deadline - time.monotonic()), f"{name} ModelReady")  # fmt: skip
    return int(m[1])


@contextmanager
def start_peer(args: argparse.Namespace, server: Server, model: Path,
               log: Path) -> Iterator[Target]:  # fmt: skip
    """The peer's script in its own virtualenv and session; stopped by PID at exit."""
    peer = server.peer or ""
    if not venv_python(peer).exists():
        sys.exit(f"no virtualenv for {peer}: run bench/bench_peers.py --setup first")
    cmd = peer_command(args, peer, model) + list(server.peer_args)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=peer_env(peer),
                                start_new_session=True)  # fmt: skip
    try:
        yield Target(wait_ready(proc, log, peer, 180), False, None, None)
    finally:
        stop_process(proc, peer)


def start(args: argparse.Namespace, server: Server, repos: dict[str, Path],
          logdir: Path) -> AbstractContextManager[Target]:  # fmt: skip
    """A context manager yielding the started server's Target; its logs go to logdir."""
    logdir.mkdir(parents=True, exist_ok=True)
    log = logdir / f"{server.key}.log"
    if server.peer is not None:
        return start_peer(args, server, bms.latest_model(repos["unbatched"]), log)
    if server.key.startswith(("naive", "grpc-floor")):
        model = bms.latest_model(repos["unbatched"])
        return start_naive(model, log, server.event_loop, server.memo)
    delay = args.delay_us if server.delay_us is None else server.delay_us
    repo = repos[f"delay{delay}" if delay >= 0 else "unbatched"]
    if server.key == "infermesh-envoy":
        return start_envoy_mesh(repo, logdir)
    if server.key == "infermesh-before":
        if args.before_source is None:
            sys.exit("infermesh-before needs --before-source DIR (a worktree of an earlier commit)")
        return start_infermesh(repo, log, args.before_source.resolve())
    return start_infermesh(repo, log, frontends=server.frontends, loop=server.event_loop)


# ---------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------


def output_of(resp: service_pb2.ModelInferResponse) -> np.ndarray:
    """probs from raw_output_contents or, if a server uses them, the typed contents."""
    if resp.raw_output_contents:
        return np.frombuffer(resp.raw_output_contents[0], dtype=np.float32)
    return np.array(resp.outputs[0].contents.fp32_contents, dtype=np.float32)


def probe(target: Target, req: service_pb2.ModelInferRequest, want: np.ndarray,
          n: int = PROBES) -> dict[str, int]:  # fmt: skip
    """n ModelInfer calls via grpcio: non-OK gRPC codes and wrong outputs, by kind."""
    errors: dict[str, int] = {}
    metadata = [mesh.HEADER] if target.header else None
    with grpc.insecure_channel(f"{HOST}:{target.port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(n):
            try:
                resp = stub.ModelInfer(req, metadata=metadata, timeout=30)
            except grpc.RpcError as exc:
                errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
                continue
            got = output_of(resp)
            if got.shape != want.shape or float(np.max(np.abs(got - want))) > 1e-5:
                errors["WRONG_OUTPUT"] = errors.get("WRONG_OUTPUT", 0) + 1
    return errors


def level_from_log(args: argparse.Namespace, c: int, rows: list[list[str]],
                   non_ok: dict[str, float]) -> bms.Level:  # fmt: skip
    """bms.run_level's figures from h2load log rows (used for the Envoy path)."""
    lat_ms = np.array([float(r[2]) / 1e3 for r in rows if r[1] == "200"])
    cancelled = non_ok.pop("CANCELLED", 0.0) if non_ok.get("CANCELLED", 0.0) <= c else 0.0
    return bms.Level(
        concurrency=c, requests=len(lat_ms), failed=len(rows) - len(lat_ms),
        qps=len(lat_ms) / args.duration,
        p50_ms=float(np.percentile(lat_ms, 50)) if len(lat_ms) else math.nan,
        p99_ms=float(np.percentile(lat_ms, 99)) if len(lat_ms) else math.nan,
        non_ok=non_ok, cancelled_at_stop=cancelled, cpu_ms_per_request=None, server_cores=None,
    )  # fmt: skip


def header_level(args: argparse.Namespace, exe: str, url: str, c: int, workdir: Path,
                 metrics_url: str | None) -> bms.Level:  # fmt: skip
    """run_level with the x-model-name header (bench_mesh.h2load sends it)."""
    frame = workdir / "frame.bin"
    mesh.h2load(exe, url, frame, c, args.warmup, workdir / "warmup.log", True)  # discarded
    before = bms.settled_counts(metrics_url)
    rows = mesh.h2load(exe, url, frame, c, args.duration, workdir / f"c{c}.log", True)
    after = bms.settled_counts(metrics_url)
    non_ok: dict[str, float] = {"n/a": math.nan}
    if before is not None and after is not None:
        non_ok = {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}
    return level_from_log(args, c, rows, non_ok)


def measure_server(args: argparse.Namespace, exe: str, server: Server, rnd: int,
                   repos: dict[str, Path], workdir: Path, req: service_pb2.ModelInferRequest,
                   want: np.ndarray) -> list[Sample]:  # fmt: skip
    """A fresh process of the server, measured at every level, probed before and after each."""
    samples = []
    with start(args, server, repos, workdir / "logs" / f"r{rnd}-{server.key}") as target:
        url = f"http://{HOST}:{target.port}{bms.METHOD}"
        for c in args.levels:
            errors = probe(target, req, want)
            if target.header:
                level = header_level(args, exe, url, c, workdir, target.metrics_url)
            else:
                level = bms.run_level(args, exe, url, c, workdir, target.pid, target.metrics_url)
            for code, n in probe(target, req, want).items():
                errors[code] = errors.get(code, 0) + n
            samples.append(Sample(server.key, rnd, level, 2 * PROBES, errors))
            print(f"round {rnd} {server.key} c{c}: {bms.fmt_row(level)} | probes non-OK "
                  f"{sum(errors.values())}/{2 * PROBES}", flush=True)  # fmt: skip
    return samples


def log_problems(workdir: Path) -> list[str]:
    pattern = re.compile(r" (ERROR|CRITICAL) |Traceback|\]\[(error|critical)\]\[")
    return [f"{f.parent.name}/{f.name}: {ln}" for f in sorted(workdir.rglob("*.log"))
            for ln in f.read_text(errors="replace").splitlines() if pattern.search(ln)]  # fmt: skip


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------


def medians(samples: list[Sample], key: str, c: int) -> bms.Level | None:
    group = [s.level for s in samples if s.server == key and s.level.concurrency == c]
    return bms.median_level(group) if group else None


def non_ok_cell(samples: list[Sample], key: str, c: int) -> str:
    group = [s for s in samples if s.server == key and s.level.concurrency == c]
    probes = sum(sum(s.probe_errors.values()) for s in group)
    counted = [s.level.non_ok for s in group if "n/a" not in s.level.non_ok]
    server = str(int(sum(sum(d.values()) for d in counted))) if counted else "n/a"
    failed = sum(s.level.failed for s in group)
    return f"{server} | {probes}/{sum(s.probes for s in group)} | {failed}"


def print_table(args: argparse.Namespace, samples: list[Sample], keys: list[str]) -> None:
    print(
        "\n| server | concurrency | QPS | p50 ms | p99 ms | non-OK (server counter) | "
        "non-OK grpcio probes | HTTP failures | QPS per round |\n" + "| --- " * 9 + "|"
    )
    for key in keys:
        for c in args.levels:
            m = medians(samples, key, c)
            if m is None:
                continue
            rounds = ", ".join(f"{s.level.qps:,.0f}" for s in samples
                               if s.server == key and s.level.concurrency == c)  # fmt: skip
            print(f"| {BY_KEY[key].label} | {c} | {bms.fmt(m.qps, ',.0f')} | "
                  f"{bms.fmt(m.p50_ms, '.2f')} | {bms.fmt(m.p99_ms, '.2f')} | "
                  f"{non_ok_cell(samples, key, c)} | {rounds} |")  # fmt: skip


@dataclass
class Verdict:
    name: str
    met: bool | None  # None: a server is missing
    detail: str


def compare(samples: list[Sample], ours: str, peer: str, levels: list[int],
            rule: Callable[[float, float], bool], rule_text: str) -> Verdict:  # fmt: skip
    """rule(QPS ratio, p99 ratio) must hold at every level (ours / peer, medians)."""
    cells, met = [], True
    for c in levels:
        a, b = medians(samples, ours, c), medians(samples, peer, c)
        if a is None or b is None:
            return Verdict(f"{ours} vs {peer}", None, "not measured")
        q, p = a.qps / b.qps, a.p99_ms / b.p99_ms
        met &= rule(q, p)
        cells.append(f"c{c}: QPS x{q:.2f}, p99 x{p:.2f}")
    name = f"{BY_KEY[ours].label} vs {BY_KEY[peer].label}: {rule_text}"
    return Verdict(name, met, "; ".join(cells))


def verdicts(samples: list[Sample], levels: list[int], par: float) -> list[Verdict]:
    def ahead(q: float, p: float) -> bool:
        return q > 1.0 and p <= 1.0

    out = []
    for ours in ("infermesh", "infermesh-envoy"):
        for peer in ("kserve", "mlserver"):
            out.append(
                compare(samples, ours, peer, levels, ahead, "more QPS at equal or better P99")
            )
    for peer in ("pytriton", "pytriton-d0"):
        out.append(compare(samples, "infermesh", peer, levels, lambda q, p: q >= par,
                           f"QPS at least on par (>= {par:g}x)"))  # fmt: skip
    return out + issue29_verdicts(samples, levels)


def issue29_verdicts(samples: list[Sample], levels: list[int]) -> list[Verdict]:
    """Issue 29's targets against the naive server: c64 QPS >= c16 QPS; c1 p50 within 1.1x
    of naive's; c64 QPS >= 1.5x naive's (medians; only the levels measured)."""
    out = []
    for key in ("infermesh", "infermesh-before", "infermesh-asyncio"):
        at = {c: medians(samples, key, c) for c in (1, 16, 64) if c in levels}
        naive = {c: medians(samples, "naive", c) for c in (1, 64) if c in levels}
        if any(m is None for m in at.values()):
            continue
        label = BY_KEY[key].label
        if (c16 := at.get(16)) and (c64 := at.get(64)):
            out.append(Verdict(f"{label}: c64 QPS >= c16 QPS", c64.qps >= c16.qps,
                               f"c16 {c16.qps:,.0f}, c64 {c64.qps:,.0f}"))  # fmt: skip
        if (ours := at.get(1)) and (theirs := naive.get(1)):
            out.append(Verdict(f"{label}: c1 p50 <= 1.1x naive", ours.p50_ms <= 1.1 * theirs.p50_ms,
                               f"p50 x{ours.p50_ms / theirs.p50_ms:.2f}"))  # fmt: skip
        if (ours := at.get(64)) and (theirs := naive.get(64)):
            out.append(Verdict(f"{label}: c64 QPS >= 1.5x naive", ours.qps >= 1.5 * theirs.qps,
                               f"QPS x{ours.qps / theirs.qps:.2f}"))  # fmt: skip
    return out


def print_ratios(samples: list[Sample], levels: list[int], keys: list[str]) -> None:
    print("\n| InferMesh setup | peer | " + " | ".join(
        f"c{c} QPS ratio | c{c} p99 ratio" for c in levels) + " |")  # fmt: skip
    print("| --- " * (2 + 2 * len(levels)) + "|")
    for ours in ("infermesh", "infermesh-envoy"):
        for peer in ("pytriton", "pytriton-d0", "kserve", "mlserver", "infermesh-unbatched",
                     "infermesh-d500", "infermesh-before", "infermesh-asyncio", "naive",
                     "naive-uvloop", "grpc-floor", "grpc-floor-uvloop"):  # fmt: skip
            if ours not in keys or peer not in keys:
                continue
            cells = []
            for c in levels:
                a, b = medians(samples, ours, c), medians(samples, peer, c)
                assert a is not None and b is not None
                cells += [f"{a.qps / b.qps:.2f}", f"{a.p99_ms / b.p99_ms:.2f}"]
            print(f"| {BY_KEY[ours].label} | {BY_KEY[peer].label} | " + " | ".join(cells) + " |")


def plot(samples: list[Sample], levels: list[int], keys: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    out.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    for i, key in enumerate(keys):
        ms = [medians(samples, key, c) for c in levels]
        style = "-" if key.startswith("infermesh") else "--"
        kw = {"label": BY_KEY[key].label, "marker": "o", "ls": style, "color": f"C{i}"}
        ax1.plot(levels, [m.qps if m else math.nan for m in ms], **kw)
        ax2.plot(levels, [m.p99_ms if m else math.nan for m in ms], **kw)
    ax1.set(xscale="log", xlabel="concurrent clients (h2load -c)", ylabel="QPS (median)",
            title="Throughput, batch-1 requests")  # fmt: skip
    ax2.set(xscale="log", yscale="log", xlabel="concurrent clients (h2load -c)",
            ylabel="p99 ms (median, log)", title="P99 latency")  # fmt: skip
    ax2.yaxis.set_major_formatter(ScalarFormatter())
    for ax in (ax1, ax2):
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    fig.suptitle("Same ONNX model, same h2load gRPC load, 2 shared CPU cores", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"plot: {out}")


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------


def expected_output(model: Path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(["probs"], {"input": x})[0], dtype=np.float32).ravel()


def measure_all(args: argparse.Namespace, keys: list[str], workdir: Path) -> list[Sample]:
    repos = {"unbatched": write_repository(workdir / "repo-unbatched", False, 0, 1)}
    for delay in {args.delay_us, *(BY_KEY[k].delay_us for k in keys)} - {None, -1}:
        assert delay is not None
        repos[f"delay{delay}"] = write_repository(
            workdir / f"repo-delay{delay}", True, delay, args.instances
        )
    exe = bms.ensure_h2load()
    x, req = bms.make_request(1)
    want = expected_output(bms.latest_model(repos["unbatched"]), x)
    payload = req.SerializeToString()
    (workdir / "frame.bin").write_bytes(b"\0" + len(payload).to_bytes(4, "big") + payload)
    samples = []
    for rnd in range(1, args.rounds + 1):
        for key in keys:
            samples += measure_server(args, exe, BY_KEY[key], rnd, repos, workdir, req, want)
    return samples


def report(args: argparse.Namespace, samples: list[Sample], versions: dict[str, dict[str, str]],
           problems: list[str], load: float) -> int:  # fmt: skip
    keys = args.keys
    print(f"\n## Peers, batch-1 requests: commit {mesh.commit()}, nproc {os.cpu_count()}, load "
          f"average at start {load:.2f}")  # fmt: skip
    print(f"h2load -m 1 -t 1, {args.duration:g} s per level after a {args.warmup:g} s warm-up; "
          f"{args.rounds} rounds, each server a fresh process per round; medians of the rounds, "
          f"counts summed; InferMesh dynamic_batching max_queue_delay {args.delay_us} us, "
          f"{args.instances} instance(s); PyTriton delay {args.pytriton_delay_us} us, max batch "
          f"32; MLServer max_batch_time {args.mlserver_batch_ms:g} ms, max batch 32")  # fmt: skip
    for peer, pinned in versions.items():
        print(f"{peer}: " + ", ".join(f"{k} {val}" for k, val in pinned.items()))
    print_table(args, samples, keys)
    print_ratios(samples, args.levels, keys)
    print("\nTargets (at every concurrency level, medians):")
    for v in verdicts(samples, args.levels, args.par):
        state = "not measured" if v.met is None else ("MET" if v.met else "NOT MET")
        print(f"- {v.name}: {state} ({v.detail})")
    if problems:
        print(f"\nserver log error lines: {len(problems)}; first ones:")
        print("\n".join(problems[:5]))
    bad = sum(sum(s.probe_errors.values()) + s.level.failed for s in samples)
    print(f"grpcio probes non-OK in all: {sum(sum(s.probe_errors.values()) for s in samples)}")
    return 1 if bad else 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--setup", action="store_true", help="create/update the peers' virtualenvs")
    p.add_argument("--measure", action="store_true", help="run the benchmark (under flock)")
    p.add_argument("--servers", default=",".join(s.key for s in SERVERS),
                   help="comma-separated: " + ", ".join(BY_KEY))  # fmt: skip
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated client counts")
    p.add_argument("--duration", type=float, default=8.0, help="seconds per timed run")
    p.add_argument("--warmup", type=float, default=2.0, help="discarded seconds before each")
    p.add_argument("--rounds", type=int, default=2, help="fresh processes per server")
    p.add_argument("--delay-us", type=int, default=0, help="InferMesh max_queue_delay")
    p.add_argument("--instances", type=int, default=1, help="InferMesh instance_group count")
    p.add_argument(
        "--before-source",
        type=Path,
        help="infermesh-before: the model server of this source tree (a worktree)",
    )
    p.add_argument("--pytriton-delay-us", type=int, default=1000)
    p.add_argument("--mlserver-batch-ms", type=float, default=1.0)
    p.add_argument("--par", type=float, default=0.95, help="'on par' QPS ratio vs PyTriton")
    p.add_argument("--json", type=Path, help="write raw results here")
    p.add_argument("--logs", type=Path, help="keep the servers' logs in this folder")
    p.add_argument("--plot", type=Path, default=HERE / "plots" / "peers_qps.png")
    args = p.parse_args()
    args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    args.keys = [k.strip() for k in args.servers.split(",") if k.strip()]
    if unknown := [k for k in args.keys if k not in BY_KEY]:
        p.error(f"unknown servers {unknown}; have {list(BY_KEY)}")
    if not (args.setup or args.measure):
        p.error("give --setup and/or --measure")
    return args


def main() -> int:
    args = parse_args()
    peers = [BY_KEY[k].peer for k in args.keys if BY_KEY[k].peer]
    if args.setup:
        setup([p for p in PEER_REQUIREMENTS if p in peers])
    if not args.measure:
        return 0
    versions = {p: installed_versions(p) for p in peers if p}
    versions = {p: {k: v[k] for k in REPORTED if k in v} for p, v in versions.items()}
    versions["infermesh"] = {"onnxruntime": ort.__version__, "grpcio": grpc.__version__}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        samples = measure_all(args, args.keys, Path(tmp))
        problems = log_problems(Path(tmp) / "logs")
        if args.logs:
            shutil.copytree(Path(tmp) / "logs", args.logs, dirs_exist_ok=True)
    rc = report(args, samples, versions, problems, load)
    if args.plot:
        plot(samples, args.levels, args.keys, args.plot)
    if args.json:
        out = {"args": {k: str(v) for k, v in vars(args).items()}, "versions": versions,
               "samples": [asdict(s) for s in samples], "server_errors": problems}  # fmt: skip
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
