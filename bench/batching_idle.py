"""bench_batching.py ``--part idle``: Triton's queue delay on an idle model vs skipping it.

Two servers with the same ``dynamic_batching`` (``--idle-config``, default a 500 us delay and
preferred sizes 8/16, one instance) differ only in the model parameter
``dynamic_batching_skip_delay_when_idle``: "false" (the default: a batch below the preferred
sizes waits ``max_queue_delay_microseconds`` for company, idle model or not, as Triton does)
and "true" (it runs at once when no batch is running). Each level of ``--idle-concurrency``
(closed loop, h2load ``-m 1``: c1 and moderate loads) runs both, alternating, a fresh server
per run, ``--rounds`` times; medians across rounds. Reported per setup and level: QPS, P50,
P99, server CPU per request, the mean executed batch and the share of executions of each size
(the ``inference_executed_batch_size`` histogram's buckets around the timed run).
"""

from __future__ import annotations

import argparse
import math
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bench_model_server as bms
from prometheus_client.parser import text_string_to_metric_families

from model_server.core.model_config import SKIP_DELAY_WHEN_IDLE

HOST = bms.HOST
SETUPS = ("honour delay (default)", "skip delay when idle")
BUCKETS = ("1", "2", "4", "8", "16", "32")  # the histogram's upper bounds we report


@dataclass
class IdleSample:
    setup: str
    level: bms.Level
    mean_batch: float
    shares: dict[str, float]  # "<=1", "2", "3-4", ...: share of executions of that size


def parameter_text(skip: bool) -> str:
    value = "true" if skip else "false"
    return f'parameters {{ key: "{SKIP_DELAY_WHEN_IDLE}" value {{ string_value: "{value}" }} }}\n'


def buckets(url: str) -> dict[str, float]:
    """Cumulative executions by upper bound ("1.0", "2.0", ... "+Inf"), summed over models."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        families = text_string_to_metric_families(resp.read().decode())
    out: dict[str, float] = {}
    for s in (s for f in families for s in f.samples):
        if s.name == "inference_executed_batch_size_bucket":
            out[s.labels["le"]] = out.get(s.labels["le"], 0.0) + s.value
    return out


def size_shares(before: dict[str, float], after: dict[str, float]) -> tuple[float, dict[str, Any]]:
    """(executions, share per size range) between two bucket readings."""
    cum = {b: after.get(f"{b}.0", 0.0) - before.get(f"{b}.0", 0.0) for b in BUCKETS}
    total = after.get("+Inf", 0.0) - before.get("+Inf", 0.0)
    shares, below, low = {}, 0.0, 1
    for b in BUCKETS:
        name = b if int(b) == low else f"{low}-{b}"
        shares[name] = (cum[b] - below) / total if total else math.nan
        below, low = cum[b], int(b) + 1
    shares[f">{BUCKETS[-1]}"] = (total - below) / total if total else math.nan
    return total, shares


def measure_idle(args: argparse.Namespace, exe: str, repo: Path, setup: str, c: int,
                 workdir: Path) -> IdleSample:  # fmt: skip
    """A fresh server on ``repo``: warm-up, then one timed level with the histogram around it."""
    spec = bms.server_specs(repo)[0]
    with bms.start_server(spec, workdir / "server.log") as (pid, port, mport):
        url, metrics = f"http://{HOST}:{port}{bms.METHOD}", f"http://{HOST}:{mport}/metrics"
        bms.h2load(exe, url, workdir / "frame.bin", c, args.warmup, workdir / "warmup.log")
        hist0, cpu0 = buckets(metrics), bms.cpu_seconds(pid)
        log = workdir / f"c{c}.log"
        bms.h2load(exe, url, workdir / "frame.bin", c, args.duration, log)
        cpu1, hist1 = bms.cpu_seconds(pid), buckets(metrics)
    runs, shares = size_shares(hist0, hist1)
    rows = [line.split("\t") for line in log.read_text().splitlines() if line.strip()]
    ok = sum(1 for r in rows if r[1] == "200")
    cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
    level = _level(rows, c, args.duration, cpu)
    return IdleSample(setup, level, ok / runs if runs else math.nan, shares)


def _level(rows: list[list[str]], c: int, seconds: float, cpu_s: float | None) -> bms.Level:
    lat = sorted(float(r[2]) / 1e3 for r in rows if r[1] == "200")
    ok = len(lat)

    def pct(q: float) -> float:
        return lat[min(ok - 1, int(q * ok))] if ok else math.nan

    return bms.Level(
        concurrency=c, requests=ok, failed=len(rows) - ok, qps=ok / seconds, p50_ms=pct(0.5),
        p99_ms=pct(0.99), non_ok={"n/a": math.nan}, cancelled_at_stop=0.0,
        cpu_ms_per_request=cpu_s * 1e3 / ok if cpu_s is not None and ok else None,
        server_cores=cpu_s / seconds if cpu_s is not None else None,
    )  # fmt: skip


def part_idle(args: argparse.Namespace, exe: str, workdir: Path,
              repository: Callable[[str, str], Path]) -> dict[str, Any]:  # fmt: skip
    """``repository(name, extra_pbtxt)``: a batched copy of the demo repository (--idle-config)
    with ``extra_pbtxt`` appended to its config.pbtxt."""
    levels = [int(c) for c in args.idle_concurrency.split(",") if c.strip()]
    repos = {s: repository(f"repo-idle-{i}", parameter_text(i == 1)) for i, s in enumerate(SETUPS)}
    samples: list[IdleSample] = []
    for rnd in range(1, args.rounds + 1):
        for c in levels:
            for setup in SETUPS:
                s = measure_idle(args, exe, repos[setup], setup, c, workdir)
                samples.append(s)
                print(f"idle round {rnd}/{args.rounds} c{c} {setup}: {bms.fmt_row(s.level)} | "
                      f"mean batch {s.mean_batch:.2f}", flush=True)  # fmt: skip
    return report(args, samples, levels)


def report(
    args: argparse.Namespace, samples: list[IdleSample], levels: list[int]
) -> dict[str, Any]:
    names = list(samples[0].shares) if samples else []
    print(f"\n### Queue delay on an idle model: {args.idle_config}, {args.rounds} rounds, "
          f"{args.duration:g} s per run, medians (QPS per round in the last column)\n")  # fmt: skip
    print(
        "| c | setup | QPS | p50 ms | p99 ms | CPU ms/request | mean batch | "
        + " | ".join(f"size {n}" for n in names)
        + " | QPS per round |"
    )
    print("| --- " * (8 + len(names)) + "|")
    out: dict[str, Any] = {}
    for c in levels:
        for setup in SETUPS:
            group = [s for s in samples if s.setup == setup and s.level.concurrency == c]
            m = bms.median_level([s.level for s in group])
            batch = bms.median([s.mean_batch for s in group])
            shares = {n: bms.median([s.shares[n] for s in group]) for n in names}
            per_round = ", ".join(f"{s.level.qps:,.0f}" for s in group)
            print(f"| {c} | {setup} | {bms.fmt(m.qps, ',.0f')} | {bms.fmt(m.p50_ms, '.2f')} | "
                  f"{bms.fmt(m.p99_ms, '.2f')} | {bms.fmt(m.cpu_ms_per_request)} | "
                  f"{batch:.2f} | " + " | ".join(f"{shares[n]:.0%}" for n in names)
                  + f" | {per_round} |")  # fmt: skip
            out[f"c{c} {setup}"] = {"qps": m.qps, "p50_ms": m.p50_ms, "p99_ms": m.p99_ms,
                                    "mean_batch": batch, "shares": shares}  # fmt: skip
    return out
