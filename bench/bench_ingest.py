"""Telemetry ingest at fleet scale (issue 10): endpoints' OTLP exports into the telemetry
shards, with nothing else on the host.

Per ``--endpoints`` count: ``--shards`` shard processes started as the control plane starts
them (``control_plane.telemetry.shards``, in this process's stead) and the scale bench's OTLP
generator (``bench/scale/otlp_gen.py``: every endpoint every second, ten points each, 100
endpoints an Export request, one connection a batch). After ``--warmup`` s, over
``--seconds`` s: the points the shards took in (used or not) against what the generator
offered, its rounds (a late one took longer than its second), the shards' CPU (cores, and
microseconds an endpoint report), the busiest shard's share, and how long a report waited
from its arrival at a shard to the control plane holding it (``telemetry_shard_delay``).

    flock /tmp/infermesh-bench.lock .venv/bin/python bench/bench_ingest.py \
        --endpoints 5000,10000,20000 --shards 2 --json ingest.json

``bench_scale.py`` measures the same ingest with the whole control plane, the synthetic fleet
and Envoys on the host; this says what the shards can do when they have the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scale.harness import HOST, PYTHON, Proc, cpu_seconds, note, quantile, wait_until

from control_plane.config.topology import TelemetryOptions
from control_plane.telemetry.shards import Push, TelemetryShards

SCALE = Path(__file__).resolve().parent / "scale"


class CountingShards(TelemetryShards):
    """The control plane's side of the shards, counting what the pushes carry."""

    def __init__(self, count: int, options: TelemetryOptions) -> None:
        super().__init__(count, options)
        self.points = 0
        self.per_shard = [0] * count
        self.delays: list[float] = []

    def _apply(self, index: int, push: Push) -> None:
        self.points += push.taken
        self.per_shard[index] += push.taken
        if push.telemetry or push.touched:
            self.delays.append(push.delay + time.monotonic() - push.at)
        super()._apply(index, push)


def measure(endpoints: int, args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix=f"ingest-{endpoints}-"))
    listing = [[i, f"10.{i // 62500}.{i // 250 % 250}.{i % 250}:8001", f"m{i % args.models}"]
               for i in range(endpoints)]  # fmt: skip
    (workdir / "endpoints.json").write_text(json.dumps(listing))
    shards = CountingShards(args.shards, TelemetryOptions(host=HOST, port=0, shards=args.shards))
    port = shards.start(0)
    gen = Proc("otlp-gen", [PYTHON, str(SCALE / "otlp_gen.py"), "--otlp", f"{HOST}:{port}",
               "--endpoints", str(workdir / "endpoints.json")], workdir / "otlp-gen.log",
               pipes=True)  # fmt: skip
    try:
        wait_until(lambda: shards.points > 0, 60, "the first points")
        time.sleep(args.warmup)
        pids = shards.pids()
        start = (time.monotonic(), gen.ask("stats"), shards.points, list(shards.per_shard),
                 sum(cpu_seconds(p) for p in pids), len(shards.delays))  # fmt: skip
        time.sleep(args.seconds)
        end = (time.monotonic(), gen.ask("stats"), shards.points, list(shards.per_shard),
               sum(cpu_seconds(p) for p in pids), len(shards.delays))  # fmt: skip
    finally:
        gen.stop()
        shards.stop()
    span = end[0] - start[0]
    rounds = end[1]["rounds"] - start[1]["rounds"]
    taken = end[2] - start[2]
    per_shard = [b - a for a, b in zip(start[3], end[3], strict=True)]
    cpu = end[4] - start[4]
    delays = shards.delays[start[5] : end[5]]
    return {
        "endpoints": endpoints,
        "shards": args.shards,
        "offered_points_s": rounds * endpoints * 10 / span,
        "nominal_points_s": endpoints * 10,
        "taken_points_s": taken / span,
        "rounds": rounds,
        "late_rounds": end[1]["late_rounds"] - start[1]["late_rounds"],
        "last_round_s": end[1]["last_round_s"],
        "failures": end[1]["failures"] - start[1]["failures"],
        "shard_cores": cpu / span,
        "us_per_report": cpu / (taken / 10) * 1e6 if taken else float("nan"),
        "busiest_share": max(per_shard) / sum(per_shard) if sum(per_shard) else float("nan"),
        "delay_mean_s": statistics.fmean(delays) if delays else float("nan"),
        "delay_p99_s": quantile(delays, 0.99),
        "delay_max_s": max(delays, default=float("nan")),
    }


COLUMNS = (
    ("endpoints", "endpoints", "{}"),
    ("nominal_points_s", "points/s offered (nominal)", "{:.0f}"),
    ("offered_points_s", "offered (rounds sent)", "{:.0f}"),
    ("taken_points_s", "taken in", "{:.0f}"),
    ("late_rounds", "late rounds", "{}"),
    ("rounds", "rounds", "{}"),
    ("shard_cores", "shard cores", "{:.2f}"),
    ("us_per_report", "us/report", "{:.0f}"),
    ("busiest_share", "busiest shard", "{:.2f}"),
    ("delay_mean_s", "delay mean s", "{:.3f}"),
    ("delay_p99_s", "delay P99 s", "{:.3f}"),
    ("delay_max_s", "delay max s", "{:.3f}"),
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoints", default="5000,10000,20000",
                   help="comma-separated endpoint counts, one run each")  # fmt: skip
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--models", type=int, default=100)
    p.add_argument("--warmup", type=float, default=20.0, help="seconds before measuring")
    p.add_argument("--seconds", type=float, default=30.0, help="seconds measured")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args()
    results = []
    for n in (int(x) for x in args.endpoints.split(",")):
        note(f"{n} endpoints, {args.shards} shards")
        results.append(measure(n, args))
        note(json.dumps(results[-1]))
    print("| " + " | ".join(title for _, title, _ in COLUMNS) + " |")
    print("|" + " --- |" * len(COLUMNS))
    for r in results:
        print("| " + " | ".join(fmt.format(r[key]) for key, _, fmt in COLUMNS) + " |")
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
