"""``--frontends N`` side by side: QPS and latency of one model server process against an
engine with 2 and 4 front ends, with each process's CPU and resident memory.

Method (bench/README.md): the demo classifier, batch-1 ModelInfer frames with h2load over
h2c (``-m 1 -t 1``: h2load is one thread), as bench_model_server.py sends them. Each round
starts a fresh server per setting (``--frontends 1``, 2, 4 alternate within a round, so host
noise spreads over all three) and runs every concurrency level: a discarded ``--warmup`` run,
then ``--duration`` s timed. Reported per setting and level: medians over ``--rounds`` of QPS
(with min-max), p50 and p99 (h2load's per-request log), and CPU ms per request of the engine
and of all front ends together (utime+stime from /proc over the timed run). Resident memory
(RSS) of each process is read after the last level. Every answer is checked once against
onnxruntime, and the server's non-OK counter must not grow (h2load's stop-time cancels
excepted, as in bench_model_server.py). What else ran is printed: the load average and the
busiest other processes during the rounds.

    flock /tmp/infermesh-bench.lock .venv/bin/python bench/bench_frontends.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model_server as bms
import bench_shared_memory as bsm

from model_server.demo_models import MODEL_NAME, build_demo_repository
from model_server.frontends.engine import resident_bytes

MiB = 1024 * 1024


def thread_seconds(pid: int) -> float:
    """CPU seconds of ``pid``'s main thread (the asyncio loop: Python work under the GIL)."""
    return bms.stat_cpu_seconds(Path(f"/proc/{pid}/task/{pid}/stat"))


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (its front ends)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found.update(int(p) for p in (task / "children").read_text().split())
    return sorted(found)


@dataclass(frozen=True)
class Sample:
    frontends: int
    round: int
    concurrency: int
    qps: float
    p50_ms: float
    p99_ms: float
    engine_cpu_ms: float  # per request
    engine_loop_ms: float  # per request, its main thread alone: the event loop, holding the GIL
    frontends_cpu_ms: float  # per request, all front ends together (0 with --frontends 1)
    non_ok: int


def level(args: argparse.Namespace, exe: str, port: int, mport: int, c: int, workdir: Path,
          engine: int, fronts: list[int], n: int, index: int) -> Sample:  # fmt: skip
    url = f"http://{bms.HOST}:{port}{bms.METHOD}"
    metrics = f"http://{bms.HOST}:{mport}/metrics"
    frame = workdir / "frame.bin"
    bms.h2load(exe, url, frame, c, args.warmup, workdir / "warmup.log")
    before = bms.settled_counts(metrics) or {}
    loop0 = thread_seconds(engine)
    cpu0 = [bms.cpu_seconds(pid) or 0.0 for pid in (engine, *fronts)]
    log = workdir / f"n{n}-c{c}.log"
    bms.h2load(exe, url, frame, c, args.duration, log)
    cpu1 = [bms.cpu_seconds(pid) or 0.0 for pid in (engine, *fronts)]
    loop1 = thread_seconds(engine)
    after = bms.settled_counts(metrics) or {}
    rows = [line.split("\t") for line in log.read_text().splitlines() if line.strip()]
    lat = np.array([float(r[2]) / 1e3 for r in rows if r[1] == "200"])
    ok = max(len(lat), 1)
    grown = {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}
    if grown.get("CANCELLED", 0.0) <= c:  # h2load resets the streams in flight at its stop
        grown.pop("CANCELLED", None)
    spent = [b - a for a, b in zip(cpu0, cpu1, strict=True)]
    return Sample(
        n, index, c, len(lat) / args.duration,
        float(np.percentile(lat, 50)) if len(lat) else float("nan"),
        float(np.percentile(lat, 99)) if len(lat) else float("nan"),
        spent[0] * 1e3 / ok, (loop1 - loop0) * 1e3 / ok, sum(spent[1:]) * 1e3 / ok,
        int(sum(grown.values())),
    )  # fmt: skip


def one_server(args: argparse.Namespace, exe: str, n: int, index: int, levels: list[int],
               workdir: Path) -> tuple[list[Sample], dict[str, int]]:  # fmt: skip
    cmd = [sys.executable, "-m", "model_server", "--model-repository", str(args.models)]
    cmd += ["--host", bms.HOST, "--port", "0", "--metrics-port", "0", "--http-port", "-1"]
    cmd += ["--models", MODEL_NAME, "--frontends", str(n)]
    spec = bms.ServerSpec(f"frontends={n}", cmd, bms.LISTEN_RE, bms.READY_RE)
    x, req = bms.make_request(1)
    with bms.start_server(spec, workdir / f"server-n{n}-r{index}.log") as (pid, port, mport):
        assert mport is not None
        fronts = sorted(children(pid)) if n > 1 else []
        bms.check_correctness(f"{bms.HOST}:{port}", req, x, args.models)
        samples = [level(args, exe, port, mport, c, workdir, pid, fronts, n, index) for c in levels]
        rss = {"engine" if n > 1 else "server": resident_bytes(pid)}
        rss.update({f"front end {i}": resident_bytes(p) for i, p in enumerate(fronts)})
    return samples, rss


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def table(samples: list[Sample], settings: list[int], levels: list[int]) -> list[str]:
    lines = [
        "| frontends | c | QPS median (min-max) | p50 ms | p99 ms | engine CPU ms/req "
        "(its loop thread) | front ends CPU ms/req | QPS vs 1 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base: dict[int, float] = {}
    for c in levels:
        for n in settings:
            got = [s for s in samples if s.frontends == n and s.concurrency == c]
            qps = statistics.median(s.qps for s in got)
            base.setdefault(c, qps)
            lines.append(
                f"| {n} | {c} | {spread([s.qps for s in got])} | "
                f"{statistics.median(s.p50_ms for s in got):.2f} | "
                f"{statistics.median(s.p99_ms for s in got):.2f} | "
                f"{statistics.median(s.engine_cpu_ms for s in got):.3f} "
                f"({statistics.median(s.engine_loop_ms for s in got):.3f}) | "
                f"{statistics.median(s.frontends_cpu_ms for s in got):.3f} | "
                f"{qps / base[c]:.2f} |"
            )
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=Path,
                   default=Path(tempfile.gettempdir()) / "infermesh-bench-frontends")  # fmt: skip
    p.add_argument("--frontends", default="1,2,4", help="settings to compare")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    settings = [int(n) for n in args.frontends.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    build_demo_repository(args.models)
    exe = bms.ensure_h2load()
    commit = bms.sh(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short",
                     "HEAD"])  # fmt: skip
    nproc = bms.sh(["nproc"])
    print(f"commit {commit}, nproc {nproc}, rounds {args.rounds}, {args.duration:.0f} s per "
          f"level after {args.warmup:.1f} s warm-up", flush=True)  # fmt: skip
    print(f"before: {bsm.others(bsm._ticks(), 1.0, {os.getpid()})}", flush=True)
    samples: list[Sample] = []
    memory: dict[int, list[dict[str, int]]] = {n: [] for n in settings}
    started, ticks = time.monotonic(), bsm._ticks()
    with tempfile.TemporaryDirectory(prefix="bench-frontends-") as tmp:
        workdir = Path(tmp)
        _, req = bms.make_request(1)
        payload = req.SerializeToString()
        (workdir / "frame.bin").write_bytes(b"\0" + len(payload).to_bytes(4, "big") + payload)
        for index in range(args.rounds):
            for n in settings:
                got, rss = one_server(args, exe, n, index, levels, workdir)
                samples += got
                memory[n].append(rss)
                print(f"round {index + 1} frontends={n}: " + ", ".join(
                    f"c{s.concurrency} {s.qps:,.0f} QPS p99 {s.p99_ms:.1f} ms" for s in got
                ) + f"; RSS MiB {', '.join(f'{k} {v / MiB:.0f}' for k, v in rss.items())}",
                    flush=True)  # fmt: skip
    mine = {os.getpid()}
    print(f"during the rounds: {bsm.others(ticks, time.monotonic() - started, mine)}")
    print("(h2load and the servers are this run's own; others are listed above)\n")
    print("\n".join(table(samples, settings, levels)))
    print("\nresident memory (MiB, median over rounds, after the last level):")
    for n in settings:
        keys = memory[n][0].keys()
        print(f"  frontends={n}: " + ", ".join(
            f"{k} {statistics.median(r[k] for r in memory[n]) / MiB:.0f}" for k in keys
        ))  # fmt: skip
    bad = [s for s in samples if s.non_ok]
    for s in bad:
        print(f"NON-OK: frontends={s.frontends} round {s.round + 1} c{s.concurrency}: {s.non_ok}")
    if args.json:
        args.json.write_text(json.dumps([asdict(s) for s in samples], indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
