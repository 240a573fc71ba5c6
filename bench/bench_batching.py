"""Benchmark dynamic batching: batched vs unbatched side by side, and overload through Envoy.

Part 1, ``--part batching``: the demo classifier with batch-1 requests, unbatched (the demo
config.pbtxt) and with ``dynamic_batching`` (a copy of the repository with a changed
config.pbtxt). First a short exploration of batched configs at one concurrency
(``--explore-c``, 64) picks the one with the highest QPS whose P99 is no worse than
unbatched's; then both setups alternate, ``--rounds`` times per level, each a fresh server
process (bench_model_server.py's ``--baseline`` method): h2load ``-m 1 -t 1`` over h2c with one
pre-encoded ModelInfer frame, a discarded warm-up, then a timed run. Reported: QPS, P50/P99
(h2load's per-request log), server CPU ms per request (/proc), non-OK codes (the server's
``inference_requests_total``) and the mean executed batch size (the delta of
``inference_executed_batch_size``'s sum / count around the timed run); medians across rounds
and the ratios batched / unbatched.

Part 2, ``--part overload``: one model server with dynamic batching and a bounded queue
(``max_queue_size``, ``default_timeout_microseconds``) behind the control plane
(``--no-routing``) and Envoy, the topology with ``sla_p99_ms`` and ``listener.access_log``.
Capacity C: a closed-loop sweep through Envoy, then an open-loop rate sweep around its best
figure; C is the highest offered rate whose OK P99 is within the SLA with (almost) no errors
and all of it answered. Then h2load offers 2C open loop (``--rps`` per client and many streams
per connection so that h2load never throttles) for each protection scenario (server queue
only; plus an Envoy ``rate_limit``; plus an Envoy ``circuit_breaker``), each on a fresh mesh.
Every figure of part 2 comes from Envoy's JSON access log (one line per request: grpc_status,
duration_ms with 1 ms resolution, response flags): goodput (OK within the SLA per second),
rejections (8 RESOURCE_EXHAUSTED, 4 DEADLINE_EXCEEDED, 14 UNAVAILABLE from an Envoy circuit
breaker) with their P50/P99, the P99 of admitted OK requests and other errors.

Part 3, ``--part idle`` (bench/batching_idle.py): the same batched config with and without
the model parameter ``dynamic_batching_skip_delay_when_idle``, at c1 and moderate loads: P50,
P99 and the executed batch sizes (Triton waits the queue delay on an idle model; the
parameter runs a lone request at once).

Plots: bench/plots/batching_qps.png and bench/plots/batching_overload.png.

    flock /tmp/infermesh-bench.lock .venv/bin/python bench/bench_batching.py
    flock /tmp/infermesh-bench.lock .venv/bin/python bench/bench_batching.py --part batching \\
        --config delay=500,instances=1 --rounds 2
    flock /tmp/infermesh-bench.lock .venv/bin/python bench/bench_batching.py --part overload
    flock /tmp/infermesh-bench.lock .venv/bin/python bench/bench_batching.py --part idle \\
        --idle-concurrency 1,4,16 --rounds 3 --duration 4 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import batching_idle
import bench_mesh as bmesh
import bench_model_server as bms
import matplotlib
import numpy as np
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2

from model_server.demo_models import MODEL_NAME, build_demo_repository

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HOST = bms.HOST
PLOTS = Path(__file__).resolve().parent / "plots"
INSTANCE_RE = re.compile(r"instance_group \[.*\]")
UNBATCHED = "unbatched"
BATCHED = "batched"
REJECT_CODES = {"8": "RESOURCE_EXHAUSTED", "4": "DEADLINE_EXCEEDED", "14": "UNAVAILABLE"}
SHED_FLAG = "UO"  # Envoy's circuit breaker overflow: the only UNAVAILABLE counted as a rejection
OVERLOAD_DEFAULT = "delay=0,instances=1"
DEFAULT_EXPLORE = (
    "delay=0,instances=1;delay=500,instances=1;delay=2000,instances=1;"
    "delay=0,instances=2;delay=500,instances=2;delay=500,instances=1,preferred=8/16"
)


# -- model repositories ---------------------------------------------------------------------
@dataclass(frozen=True)
class BatchConfig:
    """config.pbtxt's dynamic_batching and instance count (times in microseconds)."""

    delay_us: int = 0
    instances: int = 1
    preferred: tuple[int, ...] = ()
    max_queue_size: int = 0
    timeout_us: int = 0

    @classmethod
    def parse(cls, text: str) -> BatchConfig:
        """``delay=500,instances=2,preferred=8/16,queue=64,timeout=25000``."""
        keys = {"delay": "delay_us", "instances": "instances", "queue": "max_queue_size",
                "timeout": "timeout_us"}  # fmt: skip
        values: dict[str, Any] = {}
        for item in (i.strip() for i in text.split(",") if i.strip()):
            key, _, value = item.partition("=")
            if key == "preferred":
                values["preferred"] = tuple(int(v) for v in value.split("/") if v)
            elif key in keys:
                values[keys[key]] = int(value)
            else:
                sys.exit(f"batch config {text!r}: unknown key {key!r}")
        return cls(**values)

    @property
    def spec(self) -> str:
        """The ``parse`` form of the batching part (without queue and timeout)."""
        text = f"delay={self.delay_us},instances={self.instances}"
        return text + (f",preferred={'/'.join(map(str, self.preferred))}" if self.preferred else "")

    @property
    def name(self) -> str:
        parts = [f"delay {self.delay_us} us", f"{self.instances} inst"]
        parts += [f"preferred {'/'.join(map(str, self.preferred))}"] if self.preferred else []
        parts += [f"queue {self.max_queue_size}"] if self.max_queue_size else []
        parts += [f"timeout {self.timeout_us / 1000:g} ms"] if self.timeout_us else []
        return ", ".join(parts)

    def pbtxt(self, base: str) -> str:
        """The demo config.pbtxt with this instance count and a dynamic_batching section."""
        text = INSTANCE_RE.sub(f"instance_group [ {{ count: {self.instances} kind: KIND_AUTO }} ]",
                               base)  # fmt: skip
        lines = ["dynamic_batching {"]
        lines += [f"  preferred_batch_size: [ {', '.join(map(str, self.preferred))} ]"]
        lines = lines if self.preferred else lines[:1]
        lines.append(f"  max_queue_delay_microseconds: {self.delay_us}")
        if self.max_queue_size or self.timeout_us:
            lines.append(f"  default_queue_policy {{ max_queue_size: {self.max_queue_size} "
                         f"default_timeout_microseconds: {self.timeout_us} }}")  # fmt: skip
        return text.rstrip("\n") + "\n" + "\n".join(lines) + "\n}\n"


def batched_repository(base: Path, dest: Path, config: BatchConfig) -> Path:
    """A copy of the demo repository at ``dest`` whose config.pbtxt batches with ``config``."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(base / MODEL_NAME, dest / MODEL_NAME)
    pbtxt = dest / MODEL_NAME / "config.pbtxt"
    pbtxt.write_text(config.pbtxt((base / MODEL_NAME / "config.pbtxt").read_text()))
    return dest


# -- part 1: batching on vs off ---------------------------------------------------------------
@dataclass
class Sample:
    setup: str
    level: bms.Level
    mean_batch: float  # rows per ONNX Runtime execution in the timed run


def scrape(url: str) -> dict[str, float]:
    """Sums over labels of the samples this benchmark reads, by sample name."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        families = text_string_to_metric_families(resp.read().decode())
    out: dict[str, float] = {}
    for s in (s for f in families for s in f.samples):
        if s.name.startswith(("inference_executed_batch_size_", "inference_rejections_total")):
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def level_from_log(log: Path, c: int, seconds: float, non_ok: dict[str, float],
                   cpu_s: float | None) -> bms.Level:  # fmt: skip
    """A Level from h2load's per-request log (bench_model_server.run_level's arithmetic)."""
    rows = [line.split("\t") for line in log.read_text().splitlines() if line.strip()]
    lat_ms = np.array([float(r[2]) / 1e3 for r in rows if r[1] == "200"])
    ok = len(lat_ms)
    cancelled = non_ok.pop("CANCELLED", 0.0) if non_ok.get("CANCELLED", 0.0) <= c else 0.0
    return bms.Level(
        concurrency=c, requests=ok, failed=len(rows) - ok, qps=ok / seconds,
        p50_ms=float(np.percentile(lat_ms, 50)) if ok else math.nan,
        p99_ms=float(np.percentile(lat_ms, 99)) if ok else math.nan,
        non_ok=non_ok, cancelled_at_stop=cancelled,
        cpu_ms_per_request=cpu_s * 1e3 / ok if cpu_s is not None and ok else None,
        server_cores=cpu_s / seconds if cpu_s is not None else None,
    )  # fmt: skip


def timed_level(args: argparse.Namespace, exe: str, url: str, c: int, workdir: Path, pid: int,
                metrics_url: str) -> tuple[bms.Level, float]:  # fmt: skip
    """Warm-up (discarded), then a timed h2load run; the Level and the mean executed batch."""
    frame = workdir / "frame.bin"
    bms.h2load(exe, url, frame, c, args.warmup, workdir / "warmup.log")
    before, hist0, cpu0 = bms.settled_counts(metrics_url) or {}, scrape(metrics_url), None
    cpu0 = bms.cpu_seconds(pid)
    log = workdir / f"c{c}.log"
    bms.h2load(exe, url, frame, c, args.duration, log)
    cpu1 = bms.cpu_seconds(pid)
    after, hist1 = bms.settled_counts(metrics_url) or {}, scrape(metrics_url)
    non_ok = {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}
    cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
    rows = hist1.get("inference_executed_batch_size_sum", 0.0) - hist0.get(
        "inference_executed_batch_size_sum", 0.0
    )
    runs = hist1.get("inference_executed_batch_size_count", 0.0) - hist0.get(
        "inference_executed_batch_size_count", 0.0
    )
    return level_from_log(log, c, args.duration, non_ok, cpu), rows / runs if runs else math.nan


def measure(args: argparse.Namespace, exe: str, repo: Path, setup: str, levels: list[int],
            workdir: Path) -> list[Sample]:  # fmt: skip
    """A fresh server on ``repo``, checked for correctness, measured at ``levels``."""
    x, req = bms.make_request(1)
    spec = replace(bms.server_specs(repo)[0], name=setup)
    log = workdir / "server.log"
    with bms.start_server(spec, log) as (pid, port, mport):
        bms.check_correctness(f"{HOST}:{port}", req, x, repo)
        url, metrics = f"http://{HOST}:{port}{bms.METHOD}", f"http://{HOST}:{mport}/metrics"
        out = [Sample(setup, *timed_level(args, exe, url, c, workdir, pid, metrics))
               for c in levels]  # fmt: skip
    problems = [ln for ln in log.read_text(errors="replace").splitlines()
                if re.search(r" (ERROR|CRITICAL) |Traceback", ln)]  # fmt: skip
    if problems:
        print(f"{setup}: {len(problems)} server log error lines, first: {problems[0]}")
    return out


def row(s: Sample) -> str:
    return f"{bms.fmt_row(s.level)} | {bms.fmt(s.mean_batch, '.1f')}"


def explore(args: argparse.Namespace, exe: str, workdir: Path) -> tuple[BatchConfig, list[str]]:
    """Each candidate config (and unbatched) once at --explore-c; the best batched config."""
    configs = [BatchConfig.parse(t) for t in args.explore.split(";") if t.strip()]
    short = argparse.Namespace(**{**vars(args), "duration": args.explore_duration})
    c = args.explore_c
    base = measure(short, exe, args.models, UNBATCHED, [c], workdir)[0]
    print(f"explore c{c} {UNBATCHED}: {row(base)}", flush=True)
    results: list[tuple[BatchConfig, Sample]] = []
    for cfg in configs:
        repo = batched_repository(args.models, workdir / "repo-explore", cfg)
        results.append((cfg, measure(short, exe, repo, cfg.name, [c], workdir)[0]))
        print(f"explore c{c} {cfg.name}: {row(results[-1][1])}", flush=True)
    fine = [r for r in results if r[1].level.p99_ms <= base.level.p99_ms * 1.05] or results
    best = max(fine, key=lambda r: r[1].level.qps)[0]
    lines = [f"| {UNBATCHED} | {row(base)} | 1.00 |"]
    lines += [f"| {cfg.name} | {row(s)} | {s.level.qps / base.level.qps:.2f} |"
              for cfg, s in results]  # fmt: skip
    return best, lines


def compare(args: argparse.Namespace, exe: str, best: BatchConfig, levels: list[int],
            workdir: Path) -> list[Sample]:  # fmt: skip
    """Unbatched then batched, --rounds times per level, a fresh process for each run."""
    repo = batched_repository(args.models, workdir / "repo-batched", best)
    samples = []
    for i in range(args.rounds):
        for c in levels:
            for setup, path in ((UNBATCHED, args.models), (BATCHED, repo)):
                samples += (got := measure(args, exe, path, setup, [c], workdir))
                print(f"round {i + 1}/{args.rounds} c{c} {setup}: {row(got[0])}", flush=True)
    return samples


def pick(samples: list[Sample], setup: str, c: int) -> list[Sample]:
    return [s for s in samples if s.setup == setup and s.level.concurrency == c]


def comparison_table(samples: list[Sample], levels: list[int]) -> tuple[list[str], dict[str, Any]]:
    lines = ["| concurrency | setup | QPS | p50 ms | p99 ms | non-OK | server CPU ms/request | "
             "cores | mean executed batch |", "| --- " * 9 + "|"]  # fmt: skip
    ratio_lines = ["| concurrency | QPS batched/unbatched | p50 ratio | p99 ratio | CPU/request "
                   "ratio | QPS ratio per round |", "| --- " * 6 + "|"]  # fmt: skip
    summary: dict[str, Any] = {}
    for c in levels:
        meds = {}
        for setup in (UNBATCHED, BATCHED):
            group = pick(samples, setup, c)
            meds[setup] = m = bms.median_level([s.level for s in group])
            batch = bms.median([s.mean_batch for s in group])
            lines.append(f"| {c} | {setup} | {bms.fmt_row(m)} | {bms.fmt(batch, '.1f')} |")
            summary[f"c{c}_{setup}"] = asdict(m) | {"mean_batch": batch}
        u, b = meds[UNBATCHED], meds[BATCHED]
        cpu_u, cpu_b = u.cpu_ms_per_request or math.nan, b.cpu_ms_per_request or math.nan
        per_round = [
            bs.level.qps / us.level.qps
            for us, bs in zip(pick(samples, UNBATCHED, c), pick(samples, BATCHED, c), strict=True)
        ]
        r = {"qps": b.qps / u.qps, "p50": b.p50_ms / u.p50_ms, "p99": b.p99_ms / u.p99_ms,
             "cpu": cpu_b / cpu_u}  # fmt: skip
        summary[f"c{c}_ratios"] = r | {"qps_per_round": per_round}
        ratio_lines.append(
            f"| {c} | {r['qps']:.2f} | {r['p50']:.2f} | {r['p99']:.2f} | "
            f"{r['cpu']:.2f} | {', '.join(f'{q:.2f}' for q in per_round)} |"
        )
    return [*lines, "", *ratio_lines], summary


def plot_qps(samples: list[Sample], levels: list[int], path: Path) -> None:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for setup, style in ((UNBATCHED, "o-"), (BATCHED, "s-")):
        meds = [bms.median_level([s.level for s in pick(samples, setup, c)]) for c in levels]
        ax1.plot(levels, [m.qps for m in meds], style, label=setup)
        ax2.plot(levels, [m.p99_ms for m in meds], style, label=setup)
    for ax, label in ((ax1, "QPS (median of rounds)"), (ax2, "P99 latency ms (median)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent clients (h2load -m 1)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Demo classifier, batch-1 requests: dynamic batching vs unbatched")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def part_batching(args: argparse.Namespace, exe: str, workdir: Path) -> dict[str, Any]:
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    explore_lines: list[str] = []
    if args.config:
        best = BatchConfig.parse(args.config)
    else:
        best, explore_lines = explore(args, exe, workdir)
    print(f"batched config for the comparison: {best.name}", flush=True)
    samples = compare(args, exe, best, levels, workdir)
    table, summary = comparison_table(samples, levels)
    print(f"\n## Dynamic batching vs unbatched, batch-1 requests, nproc {os.cpu_count()}, "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(
        f"h2load -m 1 -t 1, {args.duration:g} s per run after a {args.warmup:g} s warm-up, "
        f"{args.rounds} rounds, unbatched then batched per level, a fresh server each run"
    )
    if explore_lines:
        print(f"\n### Exploration at c{args.explore_c}, {args.explore_duration:g} s per config\n")
        print("| config | QPS | p50 ms | p99 ms | non-OK | server CPU ms/request | cores | "
              "mean executed batch | QPS / unbatched |\n" + "| --- " * 9 + "|")  # fmt: skip
        print("\n".join(explore_lines))
    print(f"\n### Comparison, batched = {best.name}\n")
    print("\n".join(table))
    plot_qps(samples, levels, args.plots / "batching_qps.png")
    return {
        "config": best.name,
        "spec": best.spec,
        "explore": explore_lines,
        "table": table,
        "summary": summary,
    }


# -- part 2: overload through Envoy --------------------------------------------------------
@dataclass
class Mesh:
    server_pid: int
    envoy_pid: int
    listener: int
    access_log: Path


@dataclass
class Window:
    """Access-log lines of one timed run, classified."""

    name: str
    offered_qps: float  # nan for a closed-loop run
    seconds: float
    ok_ms: list[float] = field(default_factory=list)
    rejected: dict[str, list[float]] = field(default_factory=dict)  # kind -> durations ms
    other: dict[str, list[float]] = field(default_factory=dict)  # kind -> durations ms
    reset_by_client: int = 0
    logged: int = 0  # access-log lines: every request h2load sent in the window
    per_second: list[tuple[int, int, int, float]] = field(default_factory=list)
    server_cores: float = math.nan
    envoy_cores: float = math.nan
    h2load_cores: float = math.nan

    def goodput(self, sla_ms: float) -> float:
        return sum(d <= sla_ms for d in self.ok_ms) / self.seconds


def write_topology(path: Path, listener: int, endpoint: str, access_log: Path, sla_ms: float,
                   protection: dict[str, Any]) -> None:  # fmt: skip
    model = {"name": MODEL_NAME, "sla_p99_ms": sla_ms, "capacity_qps": 1000, **protection}
    data = {
        "listener": {"auth": {"mode": "off"}, "host": HOST, "port": listener,
                     "health_check_interval_s": 0.5,
                     "access_log": str(access_log)},
        "placement": {"poll_interval_s": 0.5, "timeout_s": 1.0},
        "models": [model],
        "endpoints": [{"address": endpoint}],
    }  # fmt: skip
    path.write_text(yaml.safe_dump(data))


@contextmanager
def start_mesh(args: argparse.Namespace, repo: Path, workdir: Path,
               protection: dict[str, Any]) -> Iterator[Mesh]:  # fmt: skip
    """Model server, control plane (--no-routing) and Envoy; every process stopped by PID."""
    with ExitStack() as stack:
        spec = replace(bms.server_specs(repo)[0], name="model server")
        pid, port, _ = stack.enter_context(bms.start_server(spec, workdir / "server.log"))
        listener, access_log = bmesh.free_port(), workdir / "access.log"
        access_log.unlink(missing_ok=True)
        topology = workdir / "topology.yaml"
        write_topology(topology, listener, f"{HOST}:{port}", access_log, args.sla_ms, protection)
        cp_cmd = [
            sys.executable,
            "-m",
            "control_plane",
            "--topology",
            str(topology),
            "--xds-port",
            "0",
            "--admin-port",
            "0",
            "--otlp-port",
            "0",
            "--no-routing",
        ]
        cp_spec = bms.ServerSpec("control plane", cp_cmd, bmesh.CP_RE)
        _, xds_port, _ = stack.enter_context(bms.start_server(cp_spec, workdir / "cp.log"))
        envoy_pid, envoy_admin = stack.enter_context(bmesh.start_envoy(workdir, xds_port))
        envoy = bmesh.Admin(envoy_admin)
        bmesh.wait_for(lambda: envoy.call("/ready").strip() == "LIVE", 30, "Envoy /ready")
        healthy = re.compile(f"^{bmesh.CLUSTER}::.*::health_flags::healthy$", re.M)
        bmesh.wait_for(lambda: len(healthy.findall(envoy.call("/clusters"))) == 1, 30,
                       "a healthy model server in Envoy")  # fmt: skip
        _, req = bms.make_request(1)
        want = bmesh.grpc_check(f"{HOST}:{port}", req, False, None)[1]
        bmesh.grpc_check(f"{HOST}:{listener}", req, False, want)
        try:
            yield Mesh(pid, envoy_pid, listener, access_log)
        finally:
            keep_logs(args, workdir, protection)


def keep_logs(args: argparse.Namespace, workdir: Path, protection: dict[str, Any]) -> None:
    if args.keep_logs is None:
        return
    tag = "-".join(sorted(protection)) or "none"
    args.keep_logs.mkdir(parents=True, exist_ok=True)
    for name in ("access.log", "server.log", "cp.log", "envoy.log", "topology.yaml"):
        with suppress(OSError):
            shutil.copy(workdir / name, args.keep_logs / f"{tag}-{time.time():.0f}-{name}")


def h2load_cmd(exe: str, url: str, frame: Path, seconds: float, clients: int, streams: int,
               rps_per_client: float | None) -> list[str]:  # fmt: skip
    cmd = [exe, "-c", str(clients), "-m", str(streams), "-t", "1",
           "-D", f"{round(seconds * 1000)}ms", "-d", str(frame),
           "-H", "content-type: application/grpc", "-H", "te: trailers"]  # fmt: skip
    if rps_per_client is not None:
        cmd += ["--rps", f"{rps_per_client:g}"]
    return [*cmd, url]


@dataclass
class Load:
    start: float  # wall clock (time.time())
    end: float
    server_cpu_s: float
    envoy_cpu_s: float
    h2load_cpu_s: float


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # waited-for children: h2load runs
    return usage.ru_utime + usage.ru_stime


def run_load(exe: str, mesh: Mesh, frame: Path, seconds: float, clients: int, streams: int,
             rps_per_client: float | None) -> Load:  # fmt: skip
    """One h2load run through Envoy: wall-clock start and end, CPU seconds of each process."""
    url = f"http://{HOST}:{mesh.listener}{bms.METHOD}"
    cpu0 = [bms.cpu_seconds(p) or 0.0 for p in (mesh.server_pid, mesh.envoy_pid)]
    h2load0, start = children_cpu_s(), time.time()
    out = subprocess.run(h2load_cmd(exe, url, frame, seconds, clients, streams, rps_per_client),
                         capture_output=True, text=True)  # fmt: skip
    end = time.time()
    if out.returncode != 0:
        sys.exit(f"h2load failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    cpu = [(bms.cpu_seconds(p) or 0.0) - c0 for p, c0 in zip((mesh.server_pid, mesh.envoy_pid),
                                                              cpu0, strict=True)]  # fmt: skip
    return Load(start, end, cpu[0], cpu[1], children_cpu_s() - h2load0)


def read_access_log(path: Path, start: float, end: float) -> list[dict[str, Any]]:
    """Lines whose request started in [start, end), waiting (10 s at most) for the flush."""
    deadline, last = time.monotonic() + 10, -1
    entries: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        entries = []
        text = path.read_text(errors="replace") if path.exists() else ""
        for line in text.splitlines():
            with suppress(ValueError):
                e = json.loads(line)
                t = datetime.fromisoformat(e["start"].replace("Z", "+00:00")).timestamp()
                if start <= t < end:
                    entries.append(e | {"t": t - start})
        if len(entries) == last and time.time() > end + 2.5:  # two flushes with nothing new
            break
        last = len(entries)
        time.sleep(0.5)
    return entries


def classify(name: str, entries: list[dict[str, Any]], seconds: float, offered: float,
             sla_ms: float) -> Window:  # fmt: skip
    w = Window(name, offered, seconds, logged=len(entries))
    n = max(1, int(seconds))  # whole seconds; the last fraction joins the last second
    good, rej, oth, lat = [0] * n, [0] * n, [0] * n, [list[float]() for _ in range(n)]
    for e in entries:
        status, flags, ms = str(e.get("grpc_status")), str(e.get("flags")), float(e["duration_ms"])
        i = min(int(e["t"]), n - 1)
        at_stop = e["t"] + ms / 1000 >= seconds - 0.1  # it ended when h2load stopped
        if at_stop and ("DR" in flags or "DC" in flags or status == "1"):
            w.reset_by_client += 1  # h2load reset it when the run ended (CANCELLED upstream)
        elif status == "0":
            w.ok_ms.append(ms)
            good[i] += ms <= sla_ms
            lat[i].append(ms)
        elif status in REJECT_CODES and (status != "14" or SHED_FLAG in flags):
            kind = f"{status} {REJECT_CODES[status]}" + (f" ({flags})" if flags != "-" else "")
            w.rejected.setdefault(kind, []).append(ms)
            rej[i] += 1
        else:
            key = f"grpc {status} http {e.get('http_status')} flags {flags}"
            w.other.setdefault(key, []).append(ms)
            oth[i] += 1
    w.per_second = [(g, r, o, pct(ls, 99)) for g, r, o, ls in zip(good, rej, oth, lat, strict=True)]
    return w


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def window_row(w: Window, sla_ms: float) -> str:
    rejected = [ms for v in w.rejected.values() for ms in v]
    kinds = ", ".join(f"{k}: {len(v)}" for k, v in w.rejected.items()) or "0"
    other = ", ".join(f"{k}: {len(v)} (p50 {pct(v, 50):.0f} ms)" for k, v in w.other.items())
    other = other or "0"
    offered = "closed" if math.isnan(w.offered_qps) else f"{w.offered_qps:,.0f}"
    cells = [w.name, offered, f"{w.logged / w.seconds:,.0f}", f"{len(w.ok_ms) / w.seconds:,.0f}",
             f"{w.goodput(sla_ms):,.0f}",
             bms.fmt(pct(w.ok_ms, 50), ".0f"), bms.fmt(pct(w.ok_ms, 99), ".0f"),
             f"{len(rejected) / w.seconds:,.0f}", kinds, bms.fmt(pct(rejected, 50), ".0f"),
             bms.fmt(pct(rejected, 99), ".0f"), other, str(w.reset_by_client),
             f"{w.server_cores:.2f}", f"{w.envoy_cores:.2f}", f"{w.h2load_cores:.2f}"]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


WINDOW_HEADER = (
    "| run | offered QPS | logged/s | OK/s | goodput/s (OK <= SLA) | OK p50 ms | OK p99 ms | "
    "rejected/s | rejections by kind | rejected p50 ms | rejected p99 ms | other errors | "
    "reset by h2load at stop | server cores | Envoy cores | h2load cores |\n" + "| --- " * 16 + "|"
)


def timed_window(args: argparse.Namespace, exe: str, mesh: Mesh, frame: Path, name: str,
                 seconds: float, clients: int, streams: int,
                 rate: float | None) -> Window:  # fmt: skip
    """One run through Envoy (closed loop when ``rate`` is None), read from the access log."""
    per_client = None if rate is None else rate / clients
    load = run_load(exe, mesh, frame, seconds, clients, streams, per_client)
    entries = read_access_log(mesh.access_log, load.start, load.end)
    took = load.end - load.start
    w = classify(name, entries, took, math.nan if rate is None else rate, args.sla_ms)
    w.server_cores, w.envoy_cores = load.server_cpu_s / took, load.envoy_cpu_s / took
    w.h2load_cores = load.h2load_cpu_s / took
    print(window_row(w, args.sla_ms), flush=True)
    return w


def within_sla(w: Window, sla_ms: float) -> bool:
    answered = len(w.ok_ms) + sum(len(v) for v in [*w.rejected.values(), *w.other.values()])
    bad = answered - len(w.ok_ms)
    return bool(w.ok_ms) and pct(w.ok_ms, 99) <= sla_ms and bad <= 0.001 * max(answered, 1)


def capacity(args: argparse.Namespace, exe: str, repo: Path, frame: Path,
             workdir: Path) -> tuple[float, int, list[Window]]:  # fmt: skip
    """C, the closed-loop concurrency that reached it, and every sweep run."""
    windows: list[Window] = []
    with start_mesh(args, repo, workdir, {}) as mesh:
        run_load(exe, mesh, frame, args.warmup, 16, 1, None)  # warm-up, discarded
        best_closed, best_c = 0.0, 1
        for c in (int(v) for v in args.capacity_c.split(",")):
            w = timed_window(args, exe, mesh, frame, f"closed c{c}", args.sweep_duration, c, 1,
                             None)  # fmt: skip
            windows.append(w)
            if within_sla(w, args.sla_ms) and len(w.ok_ms) / w.seconds > best_closed:
                best_closed, best_c = len(w.ok_ms) / w.seconds, c
        cap = 0.0
        for f in (float(v) for v in args.capacity_fractions.split(",")):
            rate = round(best_closed * f, -1)
            w = timed_window(args, exe, mesh, frame, f"open {f:g} x closed best {best_closed:.0f}",
                             args.sweep_duration, args.clients, args.streams, rate)  # fmt: skip
            windows.append(w)
            if within_sla(w, args.sla_ms) and len(w.ok_ms) / w.seconds >= 0.97 * rate:
                cap = max(cap, rate)
    if not cap:
        print("no open-loop rate met the SLA: C falls back to the closed-loop best", flush=True)
    if not cap and not best_closed:  # nothing met the SLA: fall back to the best goodput
        best = max(windows[: len(args.capacity_c.split(","))], key=lambda w: w.goodput(args.sla_ms))
        best_closed, best_c = best.goodput(args.sla_ms), int(best.name.removeprefix("closed c"))
    return max(cap or best_closed, 10.0), best_c, windows


def scenarios(
    args: argparse.Namespace, cap: float, best_c: int
) -> list[tuple[str, dict[str, Any]]]:
    limit = int(cap * args.rate_limit_fraction)
    rate = {"rate_limit": {"requests_per_s": limit, "burst": max(1, int(limit * 0.05))}}
    breaker = {"circuit_breaker": {"max_requests": best_c, "max_pending_requests": 1}}
    table = [("server queue only", {}), (f"+ Envoy rate_limit {limit}/s", rate),
             (f"+ Envoy circuit_breaker max_requests {best_c}", breaker),
             ("+ rate_limit + circuit_breaker", rate | breaker)]  # fmt: skip
    return table[: args.scenarios]


def plot_overload(windows: list[Window], sla_ms: float, cap: float, path: Path) -> None:
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for w in windows:
        xs = np.arange(len(w.per_second)) + 0.5
        axes[0].plot(xs, [p[0] for p in w.per_second], "o-", ms=3, label=w.name)
        axes[1].plot(xs, [p[1] for p in w.per_second], "o-", ms=3, label=w.name)
        axes[2].plot(xs, [p[3] for p in w.per_second], "o-", ms=3, label=w.name)
    axes[0].axhline(0.9 * cap, color="grey", ls="--", label="0.9 C")
    axes[0].set_ylabel("goodput/s (OK <= SLA)")
    axes[1].set_ylabel("rejections/s")
    axes[2].axhline(sla_ms, color="grey", ls="--", label="SLA")
    axes[2].set_ylabel("admitted OK p99 ms")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("seconds into the overload run")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Offered 2C = {2 * cap:,.0f} QPS open loop through Envoy, SLA p99 {sla_ms:g} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def part_overload(args: argparse.Namespace, exe: str, workdir: Path) -> dict[str, Any]:
    timeout_us = round(args.queue_timeout_ms * 1000)
    cfg = replace(BatchConfig.parse(args.overload_config), max_queue_size=args.max_queue_size,
                  timeout_us=timeout_us)  # fmt: skip
    repo = batched_repository(args.models, workdir / "repo-overload", cfg)
    frame = workdir / "frame.bin"
    print(f"\noverload: server config {cfg.name}; SLA p99 {args.sla_ms:g} ms", flush=True)
    print(WINDOW_HEADER)
    cap, best_c, sweep = capacity(args, exe, repo, frame, workdir)
    print(f"capacity C = {cap:,.0f} QPS (closed-loop best at c{best_c}); offering 2C = "
          f"{2 * cap:,.0f} QPS", flush=True)  # fmt: skip
    runs: list[Window] = []
    for name, protection in scenarios(args, cap, best_c):
        with start_mesh(args, repo, workdir, protection) as mesh:
            run_load(exe, mesh, frame, args.warmup, 16, 1, None)  # warm-up, discarded
            runs.append(timed_window(args, exe, mesh, frame, name, args.overload_duration,
                                     args.clients, args.streams, 2 * cap))  # fmt: skip
    print(f"\n## Overload through Envoy: SLA p99 {args.sla_ms:g} ms, server {cfg.name}, "
          f"h2load -c {args.clients} -m {args.streams} --rps per client, duration_ms from "
          "Envoy's access log (1 ms resolution)\n")  # fmt: skip
    print(WINDOW_HEADER)
    print("\n".join(window_row(w, args.sla_ms) for w in [*sweep, *runs]))
    print(f"\ncapacity C = {cap:,.0f} QPS; targets at 2C: goodput >= {0.9 * cap:,.0f}/s, "
          f"rejection p50/p99 < 5 ms, admitted OK p99 <= {args.sla_ms:g} ms")  # fmt: skip
    verdicts = []
    for w in runs:
        rejected = [ms for v in w.rejected.values() for ms in v]
        checks = {
            "goodput >= 0.9 C": w.goodput(args.sla_ms) >= 0.9 * cap,
            "rejections p99 < 5 ms": bool(rejected) and pct(rejected, 99) < 5,
            "admitted p99 <= SLA": pct(w.ok_ms, 99) <= args.sla_ms,
            "no other errors": not w.other,
        }
        verdicts.append({"run": w.name} | checks)
        print(f"{w.name}: " + ", ".join(f"{k} {'MET' if v else 'NOT MET'}"
                                        for k, v in checks.items()))  # fmt: skip
    plot_overload(runs, args.sla_ms, cap, args.plots / "batching_overload.png")
    return {"capacity_qps": cap, "best_closed_c": best_c, "config": cfg.name,
            "windows": [asdict(w) | {"per_second": w.per_second} for w in [*sweep, *runs]],
            "verdicts": verdicts}  # fmt: skip


def cpu_jiffies() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs: a VM's vCPUs lose "steal" time to its host."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def steal_share(before: tuple[int, int]) -> float:
    after = cpu_jiffies()
    return (after[0] - before[0]) / max(1, after[1] - before[1])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--part", choices=("batching", "overload", "both", "idle"), default="both")
    p.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "infermesh-bench")
    p.add_argument("--concurrency", default="1,16,64,128", help="part 1: comma-separated levels")
    p.add_argument("--duration", type=float, default=6.0, help="part 1: seconds per timed run")
    p.add_argument("--warmup", type=float, default=2.0, help="discarded seconds before each run")
    p.add_argument("--rounds", type=int, default=3, help="part 1: runs per setup and level")
    p.add_argument("--config", help="part 1: batched config (skips the exploration), e.g. "
                   "delay=500,instances=1,preferred=8/16")  # fmt: skip
    p.add_argument("--explore", default=DEFAULT_EXPLORE, help="part 1: ';'-separated configs")
    p.add_argument("--explore-c", type=int, default=64)
    p.add_argument("--explore-duration", type=float, default=4.0)
    p.add_argument(
        "--overload-config",
        help="part 2: batching of the server (queue and timeout from the flags below); default: "
        f"part 1's choice, or {OVERLOAD_DEFAULT} without part 1",
    )
    p.add_argument("--sla-ms", type=float, default=100.0, help="part 2: the topology's sla_p99_ms")
    p.add_argument("--max-queue-size", type=int, default=64, help="part 2: server queue bound")
    p.add_argument(
        "--queue-timeout-ms",
        type=float,
        default=50.0,
        help="part 2: default_timeout_microseconds / 1000 (SLA / 2 by default)",
    )
    p.add_argument("--capacity-c", default="8,16,32,64", help="part 2: closed-loop sweep")
    p.add_argument(
        "--capacity-fractions",
        default="0.6,0.7,0.8,0.9,1.0",
        help="part 2: open-loop rates as fractions of the closed-loop best",
    )
    p.add_argument("--sweep-duration", type=float, default=5.0)
    p.add_argument("--overload-duration", type=float, default=15.0)
    p.add_argument("--clients", type=int, default=8, help="part 2: h2load connections (open loop)")
    p.add_argument("--streams", type=int, default=512, help="part 2: h2load -m (open loop)")
    p.add_argument("--scenarios", type=int, default=4, help="part 2: how many protection setups")
    p.add_argument(
        "--rate-limit-fraction",
        type=float,
        default=0.95,
        help="part 2: the Envoy rate_limit scenario's requests_per_s as a share of C",
    )
    p.add_argument("--keep-logs", type=Path, help="part 2: copy each mesh's logs into this folder")
    p.add_argument("--idle-config", default="delay=500,instances=1,preferred=8/16",
                   help="part 3: the batched config both setups share")  # fmt: skip
    p.add_argument("--idle-concurrency", default="1,4,16", help="part 3: comma-separated levels")
    p.add_argument("--plots", type=Path, default=PLOTS)
    p.add_argument("--json", type=Path, help="write machine-readable results here")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    build_demo_repository(args.models)
    args.plots.mkdir(parents=True, exist_ok=True)
    exe = bms.ensure_h2load()
    _, req = bms.make_request(1)
    payload = service_pb2.ModelInferRequest.SerializeToString(req)
    out: dict[str, Any] = {"nproc": os.cpu_count(), "load_average_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="bench-batching-") as tmp:
        workdir = Path(tmp)
        (workdir / "frame.bin").write_bytes(b"\0" + len(payload).to_bytes(4, "big") + payload)
        if args.part in ("batching", "both"):
            jiffies = cpu_jiffies()
            out["batching"] = part_batching(args, exe, workdir)
            out["batching"]["cpu_steal"] = steal_share(jiffies)
            print(
                f"\nCPU steal (time the VM's vCPUs waited for the host) during part 1: "
                f"{out['batching']['cpu_steal']:.0%}",
                flush=True,
            )
        if args.part == "idle":
            config = BatchConfig.parse(args.idle_config)

            def repository(name: str, extra: str) -> Path:
                repo = batched_repository(args.models, workdir / name, config)
                with (repo / MODEL_NAME / "config.pbtxt").open("a") as pbtxt:
                    pbtxt.write(extra)
                return repo

            out["idle"] = batching_idle.part_idle(args, exe, workdir, repository)
        if args.overload_config is None:
            args.overload_config = out.get("batching", {}).get("spec", OVERLOAD_DEFAULT)
        if args.part in ("overload", "both"):
            jiffies = cpu_jiffies()
            out["overload"] = part_overload(args, exe, workdir)
            out["overload"]["cpu_steal"] = steal_share(jiffies)
            print(f"\nCPU steal during part 2: {out['overload']['cpu_steal']:.0%}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
