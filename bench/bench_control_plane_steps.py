"""What each step of the control plane's loop costs at fleet scale, in process (no network).

For N endpoints spread over 100 model pools (each endpoint one pool, realistic model-server
exports from bench_telemetry.sample_registry):

- ingest: TelemetryStore.ingest of one export request per endpoint (one second's telemetry),
  and of the same exports as bytes (the receiver's path: otlp_wire's fast path)
- telemetry snapshot: every endpoint's windowed P99, rates and gauges (the routing loop's input),
  after every endpoint reported, and again with no new data (a routing tick between two reports),
  aged and as routing reads it (``ages=False``: unchanged endpoints as they were computed)
- telemetry shards: a push of every endpoint's telemetry, pickled by a shard, and unpickled
  and kept by the control plane (``telemetry.shards``)
- routing recompute: scores, ejections and weights of every pool; then with every pool at
  rest (``scoring.at_rest``: nothing moved), with one endpoint's p99 moved (its pool alone),
  and with one endpoint in every pool moved (every pool computed, 1% of the signals new)
- mesh state: clusters and assignments from placement and the routed weights (and after a
  one-pool change with the clusters kept between builds, as the control plane does)
- snapshot, one pool changed: the incremental SnapshotBuilder beside a full build of the same
  state (identical versions are checked), side by side in one run

    .venv/bin/python bench/bench_control_plane_steps.py [--endpoints 1000,10000] [--repeat 3]

Medians of --repeat runs; the machine is shared, so compare within a run.
"""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_telemetry import sample_registry

from control_plane.config.topology import TelemetryOptions, parse_topology
from control_plane.discovery.placement import EndpointReport
from control_plane.gc_tuning import tune_gc
from control_plane.model.mesh import EndpointAddress, MeshState
from control_plane.routing.mesh_state import ClusterMemo, build_mesh_state
from control_plane.routing.router import Router
from control_plane.telemetry.decode import decode_request
from control_plane.telemetry.receiver import decode_raw
from control_plane.telemetry.shards import Push, TelemetryShards
from control_plane.telemetry.store import TelemetryStore
from control_plane.telemetry.values import EndpointTelemetry, Signal
from control_plane.xds.incremental import SnapshotBuilder
from control_plane.xds.resources import build_resources
from control_plane.xds.snapshot import build_snapshot
from model_server.observability.telemetry import build_request

MODELS = 100


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Median milliseconds of ``repeat`` calls."""
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def run(n: int, repeat: int) -> list[tuple[str, float]]:
    addresses = [EndpointAddress(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", 8001)
                 for i in range(n)]  # fmt: skip
    pool = {a: f"m{i % MODELS}" for i, a in enumerate(addresses)}
    models = [{"name": f"m{j}", "sla_p99_ms": 50, "capacity_qps": 100} for j in range(MODELS)]
    topology = parse_topology(
        {"models": models, "endpoints": [{"address": a.key} for a in addresses]}
    )
    registry = sample_registry().registry
    requests = [build_request(registry, a.key) for a in addresses]
    store, clock = TelemetryStore(), [0.0]

    def ingest() -> None:
        clock[0] += 1.0
        for request in requests:
            store.ingest(request, clock[0])

    rows = [("ingest: one export per endpoint", timed(ingest, repeat))]
    # What the receiver does with the bytes it gets: the wire-level fast path, templates kept
    # from the previous round (ingest_raw's first call builds them, as an exporter's first
    # export does).
    raws = [r.SerializeToString() for r in requests]

    def ingest_raw() -> None:
        clock[0] += 1.0
        for raw in raws:
            store.ingest_points(*decode_raw(raw, store.max_points_per_request, False)[:3], clock[0])

    ingest_raw()
    rows.append(
        ("ingest: the same exports as bytes, read at the wire level", timed(ingest_raw, repeat))
    )
    # With telemetry.decoder_processes the control plane only stores what they decoded.
    decoded = [decode_request(r, store.max_points_per_request) for r in requests]

    def store_decoded() -> None:
        clock[0] += 1.0
        for points, ignored, errors in decoded:
            store.ingest_points(points, ignored, errors, clock[0])

    rows.append(
        ("ingest, storing only (decoded in decoder processes)", timed(store_decoded, repeat))
    )
    fresh = []
    for _ in range(repeat):  # every endpoint reported since the last read
        ingest()
        started = time.perf_counter()
        store.snapshot(clock[0] + 0.25)
        fresh.append((time.perf_counter() - started) * 1000)
    rows.append(("telemetry snapshot, new data from every endpoint", statistics.median(fresh)))
    raw = store.snapshot(clock[0] + 0.5)
    # With telemetry.shards the control plane receives the windowed telemetry instead: a
    # shard pickles a push, the control plane unpickles it and keeps it (TelemetryShards).
    read = {key: (clock[0], t) for key, t in raw.items()}
    push = Push(clock[0], read, (), True, frozenset(), frozenset(), (), 0, {}, ())
    sent = pickle.dumps(("push", push), protocol=pickle.HIGHEST_PROTOCOL)
    rows.append(
        (
            "telemetry shards: a push of every endpoint, sent (the shard's side)",
            timed(lambda: pickle.dumps(("push", push), protocol=pickle.HIGHEST_PROTOCOL), repeat),
        )
    )
    # Received in a process that holds what the control plane's does (the newest telemetry
    # per endpoint, not a store): how often the collector runs depends on the heap's size.
    with tempfile.NamedTemporaryFile(suffix=".push") as file:
        file.write(sent)
        file.flush()
        for settings, label in (("default", "CPython's GC defaults"), ("tuned", "its GC settings")):
            rows.append(
                (
                    f"telemetry shards: the same push received and kept by the control plane "
                    f"({label})",
                    receive_in_child(file.name, settings, repeat),
                )
            )
    rows.append(
        (
            "telemetry snapshot, no new data since the last read",
            timed(lambda: store.snapshot(clock[0] + 0.5), repeat),
        )
    )
    rows.append(
        (
            "telemetry snapshot, no new data: routing's read (ages=False)",
            timed(lambda: store.snapshot(clock[0] + 0.5, ages=False), repeat),
        )
    )
    # The sample registry reports model "classifier": give each endpoint its own pool's name.
    telemetry = {
        a.key: dataclasses.replace(
            raw[a.key],
            models=tuple(dataclasses.replace(m, model=pool[a]) for m in raw[a.key].models),
        )
        for a in addresses
    }
    reports = {a: EndpointReport(a, True, frozenset({(pool[a], "1")}), True) for a in addresses}
    router = Router()
    rows.append(
        (
            "routing recompute (100 pools)",
            timed(lambda: router.recompute(topology, telemetry, reports, clock[0]), repeat),
        )
    )
    # Steady telemetry until every pool is at rest (slow start over, scores converged): then
    # a tick costs the signals and a comparison per pool, and a change one pool's recompute.
    later = clock[0]
    for _ in range(60):
        later += 0.5
        router.recompute(topology, telemetry, reports, later)
    skipped = router.pools_skipped
    rows.append(
        (
            "routing recompute, every pool at rest",
            timed(lambda: router.recompute(topology, telemetry, reports, later), repeat),
        )
    )
    assert router.pools_skipped - skipped == MODELS * repeat, "the pools did not come to rest"
    first = addresses[0].key
    slower = [
        {**telemetry, first: _with_p99(telemetry[first], 40.0 * 1.5**k)} for k in range(repeat + 1)
    ]
    computed = router.pools_computed
    ticks = iter(slower)
    rows.append(
        (
            "routing recompute, one endpoint's p99 moved",
            timed(lambda: router.recompute(topology, next(ticks), reports, later), repeat),
        )
    )
    assert router.pools_computed - computed == repeat  # its pool alone
    # One endpoint in every pool moved: every pool computed, the other endpoints' signals
    # unchanged (what a fleet whose reports wobble past the tolerance looks like to routing).
    movers, current = [], telemetry
    for k in range(repeat):
        # One in each pool, never the endpoint the row above slowed: with --repeat 2 it was
        # left at 60 ms, this row's value, so its pool did not move.
        moved = addresses[1 + k * MODELS : 1 + (k + 1) * MODELS]
        current = {**current, **{a.key: _with_p99(telemetry[a.key], 60.0) for a in moved}}
        movers.append(current)
    computed = router.pools_computed
    moving = iter(movers)
    rows.append(
        (
            "routing recompute, one endpoint in every pool moved",
            timed(lambda: router.recompute(topology, next(moving), reports, later), repeat),
        )
    )
    assert router.pools_computed - computed == MODELS * repeat
    weights = router.pool_weights()
    rows.append(
        (
            "mesh state",
            timed(lambda: build_mesh_state(topology, reports, pool_weights=weights), repeat),
        )
    )
    builder = SnapshotBuilder()
    builder.build(build_mesh_state(topology, reports, pool_weights=weights))
    memo: ClusterMemo = {}
    build_mesh_state(topology, reports, pool_weights=weights, memo=memo)
    states, kept = [], []
    for k in range(repeat):  # each a weight change in one pool
        changed = {
            **weights,
            "m0": {a: 1 + k for a in weights.get("m0", {})} or {addresses[0]: 1 + k},
        }
        states.append(build_mesh_state(topology, reports, pool_weights=changed))
        started = time.perf_counter()
        state = build_mesh_state(topology, reports, pool_weights=changed, memo=memo)
        kept.append((time.perf_counter() - started) * 1000)
        assert state == states[-1]
    rows.append(("mesh state after a one-pool weight change, clusters kept (memo)",
                 statistics.median(kept)))  # fmt: skip
    incremental = statistics.median(_time_each(builder.build, states))
    full = statistics.median(_time_each(lambda s: build_snapshot(build_resources(s)), states))
    assert (
        builder.build(states[-1]).versions()
        == build_snapshot(build_resources(states[-1])).versions()
    )
    rows.append((f"snapshot, one pool changed: incremental (made {builder.made})", incremental))
    rows.append(("snapshot, one pool changed: full build", full))
    # A server leaving (placement): its model's clusters change, and `servers`, which holds
    # every endpoint of the fleet.
    builder.build(build_mesh_state(topology, reports, pool_weights=weights))
    without = [{a: r for a, r in reports.items() if a != addresses[1 + k]} for k in range(repeat)]
    gone = [build_mesh_state(topology, r, pool_weights=weights) for r in without]
    left = statistics.median(_time_each(builder.build, gone))
    rows.append((f"snapshot, one server left: incremental (made {builder.made})", left))
    return rows


def receive_in_child(path: str, settings: str, repeat: int) -> float:
    """Median ms of receiving the pickled push in ``path``, in a fresh process."""
    command = [sys.executable, __file__, "--receive", path, "--gc", settings,
               "--repeat", str(repeat)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=600)
    return float(done.stdout.split()[-1])


def receive_only(path: str, settings: str, repeat: int) -> float:
    sent = Path(path).read_bytes()
    shards = TelemetryShards(1, TelemetryOptions())
    shards._receive(0, pickle.loads(sent))  # steady state: each push replaces the last
    assert len(shards) == len(pickle.loads(sent)[1].telemetry)
    if settings == "tuned":
        tune_gc()
    return timed(lambda: shards._receive(0, pickle.loads(sent)), repeat * 3)


def _with_p99(t: EndpointTelemetry, ms: float) -> EndpointTelemetry:
    p99 = Signal(ms, 0.1)
    models = tuple(dataclasses.replace(m, p99_ms=p99) for m in t.models)
    return dataclasses.replace(t, p99_ms=p99, models=models)


def _time_each(fn: Callable[[MeshState], object], items: list[MeshState]) -> list[float]:
    out = []
    for item in items:
        started = time.perf_counter()
        fn(item)
        out.append((time.perf_counter() - started) * 1000)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoints", default="1000,10000")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--receive", help=argparse.SUPPRESS)  # receive_in_child's process
    parser.add_argument("--gc", default="default", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receive:
        print(receive_only(args.receive, args.gc, args.repeat))
        return 0
    counts = [int(n) for n in args.endpoints.split(",")]
    results = {n: run(n, args.repeat) for n in counts}
    print(f"\n| step | {' | '.join(f'{n:,} endpoints (ms)' for n in counts)} |")
    print("| --- " * (len(counts) + 1) + "|")
    for i, (step, _) in enumerate(results[counts[0]]):
        step = step.split(" (made")[0] if "incremental" in step else step
        cells = " | ".join(f"{results[n][i][1]:,.1f}" for n in counts)
        print(f"| {step} | {cells} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
