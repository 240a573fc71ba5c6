"""SLA classes under load: does an interactive request keep its latency while batch requests
saturate the mesh? Two configurations side by side, in one run, under the same load.

Each configuration is a fresh mesh on free 127.0.0.1 ports: two model servers
(``python -m model_server --models classifier``, reporting over OTLP every 0.2 s), the control
plane in a thread of this process and Envoy with one worker over SotW ADS (the helpers of
``tests/support.py`` and ``tests/mesh_support.py``, every process stopped by PID at the end).
The classifier's topology entry declares two SLA classes (request header ``x-sla-class``):
``interactive`` (timeout 2 s, per try 1 s, 2 retries) and ``batch`` (timeout 30 s, no retry).

- **A, no reservation**: neither server labelled. The interactive lane exists but has no
  reserved endpoint, so it holds both shared servers at priority 0: interactive requests queue
  on the same servers as the batch ones.
- **B, reserved**: server 1 is started with ``--label reserved_for=interactive``; the control
  plane puts it alone at priority 0 of the interactive lane (server 2 at priority 1, the
  spill-over) and out of every other route of the model, so batch requests only reach server 2.

Before the load the bench waits, with deadlines, until the control plane's mesh state and
Envoy's /clusters show that configuration's lanes. Load (``tests.support.Traffic``, closed
loop, grpcio threads of this process, one channel per client, through the Envoy listener):
``--batch-clients`` clients (default 8) of ``--batch-images`` images per request (default 16)
with ``x-sla-class: batch``, and ``--interactive-clients`` (default 1) of one image with
``x-sla-class: interactive``. After a ``--warmup`` window (default 3 s, once both classes have
had an answer) the figures cover the next ``--seconds`` (default 10): the requests that
completed inside the window. Reported per configuration: interactive count, p50 / p99 / max
ms; batch count, p50 / p99 ms and images/s; errors of each class in the window; the requests
each server completed in the window (its model statistics); then the ratio of interactive p99,
B / A. ``--json FILE`` writes the same figures.

    flock /tmp/infermesh-bench.lock .venv/bin/python bench/bench_sla_classes.py [--seconds 10]
    .venv/bin/python bench/bench_sla_classes.py --models /tmp/infermesh-bench --json sla.json

The load generator shares the host's CPUs with the servers, Envoy and the control plane (on a
2-core host the batch load alone saturates it), so compare the two columns of one run, not
absolute figures across runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests.* harness helpers

import numpy as np

from control_plane.model.lanes import sla_cluster
from control_plane.model.mesh import EndpointAddress, model_cluster
from model_server.demo_models import MODEL_NAME, build_demo_repository
from tests import support
from tests.envoy_support import Envoy, free_port
from tests.mesh_support import ControlPlaneThread, start_plane_and_envoy, write_topology
from tests.support import ServerProcess, Traffic, start_server, wait_for

SLA_CLASSES: dict[str, dict[str, Any]] = {
    "interactive": {"timeout_s": 2, "per_try_timeout_s": 1, "max_retries": 2},
    "batch": {"timeout_s": 30, "max_retries": 0},
}
INTERACTIVE = (("x-sla-class", "interactive"),)
BATCH = (("x-sla-class", "batch"),)
RESERVED_LABEL = ("--label", "reserved_for=interactive")
CONFIGS = (("A", "no reservation", False), ("B", "reserved", True))


@dataclass
class Result:
    key: str  # A or B
    name: str
    reserved: bool  # server 1 labelled reserved_for=interactive
    seconds: float  # the measured window
    interactive_count: int
    interactive_p50_ms: float
    interactive_p99_ms: float
    interactive_max_ms: float
    interactive_errors: int
    batch_count: int
    batch_p50_ms: float
    batch_p99_ms: float
    batch_images_per_s: float
    batch_errors: int
    served: list[int]  # requests servers 1 and 2 completed in the window
    lane_setup_s: float  # start of the processes -> lanes in place in Envoy
    error_samples: list[str] = field(default_factory=list)


def window(latencies: list[tuple[float, float]], start: float, end: float) -> np.ndarray:
    """Milliseconds of the OK requests that completed in [start, end)."""
    return np.array([s * 1000 for done, s in latencies if start <= done < end], dtype=float)


def pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def successes(server: ServerProcess) -> int:
    return support.successes(server.client(), MODEL_NAME)


def wait_for_lanes(
    plane: ControlPlaneThread, envoy: Envoy, servers: list[ServerProcess], reserved: bool
) -> None:
    """The control plane's state, then Envoy's clusters, as this configuration wants them."""
    lane, default = sla_cluster(MODEL_NAME, "interactive"), model_cluster(MODEL_NAME)
    first, second = (EndpointAddress("127.0.0.1", s.port) for s in servers)
    want_lane = {(first, 0), (second, 1)} if reserved else {(first, 0), (second, 0)}
    want_default = {second} if reserved else {first, second}

    def in_state() -> bool:
        state = plane.plane.mesh_state
        if state is None:
            return False
        got_lane = {(a.address, a.priority) for a in state.clusters.get(lane, ())}
        got_default = {a.address for a in state.clusters.get(default, ())}
        return got_lane == want_lane and got_default == want_default

    what = "server 1 reserved" if reserved else "both servers shared"
    wait_for(in_state, 30, f"the control plane's lanes ({what})", interval=0.1)

    def hosts(text: str, cluster: str) -> dict[int, tuple[str, str]]:
        """port -> (priority, health flags) of the cluster's hosts in Envoy's /clusters."""
        pattern = rf"^{re.escape(cluster)}::127\.0\.0\.1:(\d+)::(priority|health_flags)::(.*)$"
        found: dict[int, dict[str, str]] = {}
        for port, key, value in re.findall(pattern, text, re.M):
            found.setdefault(int(port), {})[key] = value.strip()
        return {p: (v.get("priority", ""), v.get("health_flags", "")) for p, v in found.items()}

    lane_want = {servers[0].port: ("0", "healthy"),
                 servers[1].port: ("1" if reserved else "0", "healthy")}  # fmt: skip
    default_want = {a.port for a in want_default}

    def in_envoy() -> bool:
        text = envoy.admin("/clusters")
        default_hosts = hosts(text, default)
        return (
            hosts(text, lane) == lane_want
            and set(default_hosts) == default_want
            and all(flags == "healthy" for _, flags in default_hosts.values())
        )

    wait_for(in_envoy, 30, f"Envoy's lanes ({what})", interval=0.1)


def run_config(
    args: argparse.Namespace, key: str, name: str, reserved: bool, workdir: Path
) -> Result:
    otlp, listener = free_port(), free_port()
    started = time.monotonic()
    with contextlib.ExitStack() as stops:
        servers = []
        for i in (1, 2):
            labels = RESERVED_LABEL if reserved and i == 1 else ()
            server = start_server(
                args.models, workdir / f"s{i}", "--models", MODEL_NAME,
                "--otlp-endpoint", f"127.0.0.1:{otlp}", "--telemetry-interval", "0.2", *labels,
            )  # fmt: skip
            stops.callback(server.stop)
            servers.append(server)
        topology = write_topology(
            workdir / "topology.yaml", listener, [s.url for s in servers],
            sla_p99_ms=args.sla_ms, sla_classes=SLA_CLASSES,
        )  # fmt: skip
        plane, envoy = start_plane_and_envoy(stops, workdir, topology, listener, 2, otlp)
        wait_for_lanes(plane, envoy, servers, reserved)
        lane_setup_s = time.monotonic() - started
        url = f"127.0.0.1:{listener}"
        bound = args.warmup + args.seconds + 120  # Traffic's own deadline, whatever happens
        batch = stops.enter_context(Traffic(url, clients=args.batch_clients,
                                            batch=args.batch_images, metadata=BATCH,
                                            deadline_s=bound))  # fmt: skip
        interactive = stops.enter_context(Traffic(url, clients=args.interactive_clients,
                                                  metadata=INTERACTIVE,
                                                  deadline_s=bound))  # fmt: skip
        batch.wait_ok(1, timeout=60)
        interactive.wait_ok(1, timeout=60)
        time.sleep(args.warmup)  # the warm-up window
        before = [successes(s) for s in servers]
        t0 = time.monotonic()
        time.sleep(args.seconds)  # the measured window
        t1 = time.monotonic()
        after = [successes(s) for s in servers]
        batch.stop()
        interactive.stop()
    seconds = t1 - t0
    i_ms = window(interactive.latencies, t0, t1)
    b_ms = window(batch.latencies, t0, t1)

    def errors_in(traffic: Traffic) -> list[str]:
        return [
            f"{code.name}: {detail}"
            for at, (code, detail) in zip(traffic.failed_at, traffic.errors, strict=True)
            if t0 <= at < t1
        ]

    i_err, b_err = errors_in(interactive), errors_in(batch)
    return Result(
        key=key, name=name, reserved=reserved, seconds=seconds,
        interactive_count=len(i_ms), interactive_p50_ms=pct(i_ms, 50),
        interactive_p99_ms=pct(i_ms, 99),
        interactive_max_ms=float(i_ms.max()) if len(i_ms) else math.nan,
        interactive_errors=len(i_err),
        batch_count=len(b_ms), batch_p50_ms=pct(b_ms, 50), batch_p99_ms=pct(b_ms, 99),
        batch_images_per_s=len(b_ms) * args.batch_images / seconds, batch_errors=len(b_err),
        served=[a - b for a, b in zip(after, before, strict=True)], lane_setup_s=lane_setup_s,
        error_samples=(i_err[:3] + b_err[:3]),
    )  # fmt: skip


def print_table(args: argparse.Namespace, results: list[Result]) -> None:
    rows: list[tuple[str, ...]] = [
        ("", *(f"{r.key}) {r.name}" for r in results)),
        ("interactive requests (1 image)", *(str(r.interactive_count) for r in results)),
        ("interactive p50 ms", *(f"{r.interactive_p50_ms:.1f}" for r in results)),
        ("interactive p99 ms", *(f"{r.interactive_p99_ms:.1f}" for r in results)),
        ("interactive max ms", *(f"{r.interactive_max_ms:.1f}" for r in results)),
        (f"batch requests ({args.batch_images} images)", *(str(r.batch_count) for r in results)),
        ("batch p50 ms", *(f"{r.batch_p50_ms:.1f}" for r in results)),
        ("batch p99 ms", *(f"{r.batch_p99_ms:.1f}" for r in results)),
        ("batch images/s", *(f"{r.batch_images_per_s:.0f}" for r in results)),
        ("errors interactive / batch",
         *(f"{r.interactive_errors} / {r.batch_errors}" for r in results)),
        ("served by server 1 / server 2", *(f"{r.served[0]} / {r.served[1]}" for r in results)),
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        values = (c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True))
        cells = [row[0].ljust(widths[0]), *values]
        print("  ".join(cells).rstrip())
    by_key = {r.key: r for r in results}
    if "A" in by_key and "B" in by_key:
        ratio = by_key["B"].interactive_p99_ms / by_key["A"].interactive_p99_ms
        print(f"interactive p99, B / A: {ratio:.2f}")
    for r in results:
        for sample in r.error_samples:
            print(f"  {r.key} error: {sample}")


def main() -> int:
    p = argparse.ArgumentParser(description="Interactive vs batch SLA classes, 2 model servers.")
    p.add_argument("--models", type=Path, help="demo repository ($TMPDIR/infermesh-bench)")
    p.add_argument("--seconds", type=float, default=10.0, help="measured window per config")
    p.add_argument("--warmup", type=float, default=3.0, help="discarded seconds before it")
    p.add_argument("--batch-clients", type=int, default=8)
    p.add_argument("--batch-images", type=int, default=16, help="images per batch request")
    p.add_argument("--interactive-clients", type=int, default=1)
    p.add_argument("--sla-ms", type=float, default=50.0, help="the model's sla_p99_ms")
    p.add_argument("--configs", default="A,B", help="which of A (no reservation), B (reserved)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args()
    if args.models is None:
        args.models = Path(tempfile.gettempdir()) / "infermesh-bench"
    build_demo_repository(args.models)  # leaves existing files alone
    wanted = {c.strip().upper() for c in args.configs.split(",") if c.strip()}
    load_avg = os.getloadavg()[0]
    print(
        f"nproc {os.cpu_count()}, load average {load_avg:.2f}; load: {args.batch_clients} batch "
        f"clients x {args.batch_images} images + {args.interactive_clients} interactive x 1 "
        f"image; warm-up {args.warmup:g} s, window {args.seconds:g} s per config"
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-sla-") as tmp:
        for key, name, reserved in CONFIGS:
            if key in wanted:
                workdir = Path(tmp) / key
                workdir.mkdir()
                results.append(run_config(args, key, name, reserved, workdir))
    print()
    print_table(args, results)
    if args.json is not None:
        figures: dict[str, Any] = {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "nproc": os.cpu_count(), "load_average": load_avg,
            "configs": [asdict(r) for r in results],
        }  # fmt: skip
        by_key = {r.key: r for r in results}
        if "A" in by_key and "B" in by_key:
            figures["interactive_p99_ratio_b_over_a"] = (
                by_key["B"].interactive_p99_ms / by_key["A"].interactive_p99_ms
            )
        args.json.write_text(json.dumps(figures, indent=2, default=str) + "\n")
    return 1 if any(r.interactive_errors or r.batch_errors for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
