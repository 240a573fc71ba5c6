"""The control plane at fleet scale (issue 10): time from a telemetry change to every node.

Per configuration (endpoints x nodes x mode), on fresh processes stopped by PID: synthetic
model servers (bench/scale/fleet.py, ``--per-fleet`` endpoints per process), the real control
plane (``python -m control_plane``, 100 models m0..m99), an OTLP generator speaking for every
endpoint every second (bench/scale/otlp_gen.py), ``--nodes`` synthetic Envoy nodes over ADS
(bench/scale/xds_clients.py) and ``--envoys`` real Envoys. Once every node holds the same EDS
version and no EDS response has arrived for ``--quiet`` s, ``--trials`` times: one endpoint (a
different pool each time) reports a P99 far above 2x its SLA; the time from that export's send
to each node receiving the endpoint's new weight (and later its ejection) is recorded, then
the endpoint heals and its recovery is awaited.

    flock /tmp/infermesh-bench.lock .venv/bin/python bench/bench_scale.py \
        --endpoints 1000,10000 --nodes 10,100 --modes sotw,delta --json scale.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from scale.harness import (
    HOST,
    PYTHON,
    EnvoyWatch,
    Proc,
    cp_metrics,
    cpu_seconds,
    decisions_after,
    decisions_since,
    family_cpu_seconds,
    family_rss,
    fleet_counts,
    free_port,
    memory,
    note,
    profiler,
    quantile,
    start_envoy,
    tree_hash,
    wait_until,
)
from scale.report import plot, print_table

from control_plane.xds.bootstrap import raise_open_file_limit

CP_RE = re.compile(
    r"control plane listening: xds=[\d.]+:(\d+) admin=[\d.]+:(\d+) otlp=[\d.]+:(\d+)"
)
SCALE = Path(__file__).resolve().parent / "scale"
LOG_TIME_RE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*snapshot set \(", re.M)


def snapshot_times(log: str) -> list[float]:
    """Wall times of the control plane's "snapshot set" log lines (millisecond resolution)."""
    return [
        datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        for m in LOG_TIME_RE.finditer(log)
    ]


def stages(admin: int, pool: str, t0: float, t_all: float, log: str) -> dict[str, float]:
    """Where a trial's time went: from the export's send to routing's first decision about the
    pool (ingest, then waiting for and running a recompute: a decision's time is its
    recompute's start), to the next snapshot set (the rest of the recompute and the rebuild),
    to the last node's receipt (ADS delivery)."""
    decided = [d["at"] for d in decisions_after(admin, t0) if d["pool"] == pool]
    if not decided or math.isnan(t_all):
        return {}
    decision = min(decided)
    snapshot = next((t for t in snapshot_times(log) if t >= decision - 0.001), math.nan)
    return {
        "to_decision_s": decision - t0,
        "decision_to_snapshot_s": snapshot - decision,
        "snapshot_to_all_s": t0 + t_all - snapshot,
    }


def write_topology(path: Path, args: argparse.Namespace, endpoints: list[str]) -> None:
    data = {
        "listener": {
            "auth": {"mode": "off"},  # benches measure routing; bench_edge --auth measures auth
            "host": HOST,
            "port": free_port(),
            "health_check_interval_s": args.hc_interval,
            "health_checks": args.health_checks,
            # The synthetic servers answer gRPC only. With REST twins, Envoy's HTTP checks of
            # PORT+2000 reached whichever synthetic server had that port (the fleet's ports are
            # the kernel's, 10,000 of them): a second connection per server for ~40% of them,
            # past the real Envoys' 20,000 descriptors, and they crashed.
            "rest": {"enabled": False},
        },
        "placement": {"poll_interval_s": args.poll_interval, "timeout_s": args.poll_timeout},
        "telemetry": {
            "decoder_processes": args.decoder_processes,
            "shards": args.shards,
            "shard_nice": args.shard_nice,
        },
        "models": [
            {"name": f"m{i}", "sla_p99_ms": args.sla_ms, "capacity_qps": 1000}
            for i in range(args.models)
        ],
        "endpoints": [{"address": e} for e in endpoints],
    }
    path.write_text(yaml.safe_dump(data))


def start_fleets(
    workdir: Path, total: int, args: argparse.Namespace
) -> tuple[list[Proc], list[Any]]:
    fleets = []
    for k, first in enumerate(range(0, total, args.per_fleet)):
        cmd = [PYTHON, str(SCALE / "fleet.py"), "--first", str(first),
               "--count", str(min(args.per_fleet, total - first)), "--models", str(args.models),
               "--out", str(workdir / f"fleet-{k}.json"),
               "--stats", str(workdir / f"fleet-{k}-stats.json")]  # fmt: skip
        fleets.append(Proc(f"fleet-{k}", cmd, workdir / f"fleet-{k}.log", nice=args.emulator_nice))
    outs = [workdir / f"fleet-{k}.json" for k in range(len(fleets))]

    def bound() -> bool:
        dead = [f.name for f in fleets if not f.alive()]
        if dead:
            raise RuntimeError(f"{dead} exited:\n{fleets[0].log()[-2000:]}")
        return all(p.exists() for p in outs)

    wait_until(bound, 300, "the fleet's ports")
    endpoints = sorted(e for p in outs for e in json.loads(p.read_text())["endpoints"])
    return fleets, endpoints


def first_change(
    changes: list[Any], want: Any = None, weight: float = math.inf, weight_only: bool = False
) -> Any:
    """The first change to health ``want``, or (no ``want``) the first that the slow endpoint
    causes: weight below 90% of the ``weight`` it had (the hysteresis), or not HEALTHY. An
    endpoint that drops out of placement and comes back with its old weight does not count.
    ``weight_only`` for real Envoys: their config_dump health also carries active health
    checking (a host failing Envoy's own checks reads UNHEALTHY), so only weights compare."""
    for c in changes:
        if want is not None:
            if c[2] == want:
                return c
        elif c[1] < 0.9 * weight or (c[2] != "HEALTHY" and not weight_only):
            return c
    return None


def one_trial(k: int, ctx: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    endpoints, clients, gen, cp = ctx["endpoints"], ctx["clients"], ctx["gen"], ctx["cp"]
    per_model = len(endpoints) // args.models
    pool = (k * 37 + 11) % args.models
    index = pool + args.models * ((k * 7919) % per_model)
    key, cluster = endpoints[index][1], f"model:m{pool}"
    values = clients.ask(json.dumps({"cmd": "watch", "cluster": cluster, "endpoint": key}))
    baseline = Counter(tuple(v) if v else None for v in values["values"].values()).most_common(1)[
        0
    ][0]
    envoy_base = [w.watch(cluster, key) for w in ctx["watches"]]
    if baseline is None:  # placement flapping: the endpoint is not in its cluster right now
        note(f"trial {k}: {key} is in no node's {cluster}: not measured")
        return {
            "trial": k,
            "endpoint": key,
            "cluster": cluster,
            "error": "not in its cluster",
            "t_all_s": math.nan,
            "envoy_s": [],
            "cp_cpu_s": math.nan,
            "update_bytes": [],
        }
    weight = baseline[0]
    cpu0, rss0, all0 = cpu_seconds(cp.pid), memory(cp.pid)[0], family_cpu_seconds(cp.pid)
    sent = gen.ask(f"slow {key}")
    t0 = sent["sent_at"]
    nodes = args.nodes_now

    def report() -> dict[str, Any]:
        got: dict[str, Any] = clients.ask(json.dumps({"cmd": "report"}))["nodes"]
        return got

    def all_changed(health: str | None = None) -> bool:
        r = report()
        ctx["last_report"] = r
        synthetic = sum(first_change(n["changes"], health, weight) is not None for n in r.values())
        envoys = health is not None or all(  # ejection: on the synthetic nodes only
            first_change(w.changes, None, weight, weight_only=True) is not None
            for w in ctx["watches"]
        )
        return synthetic == nodes and envoys

    result: dict[str, Any] = {"trial": k, "endpoint": key, "cluster": cluster, "t0": t0,
                              "baseline": baseline, "envoy_baseline": envoy_base}  # fmt: skip
    try:
        wait_until(all_changed, args.trial_timeout, "every node to get the new weight", 0.05)
    except TimeoutError as exc:
        result["timeout"] = str(exc)
    cpu1, t1, all1 = cpu_seconds(cp.pid), time.time(), family_cpu_seconds(cp.pid)
    r = ctx["last_report"]
    stage_log = cp.log()
    firsts = {n: first_change(v["changes"], None, weight) for n, v in r.items()}
    times = [c[0] - t0 for c in firsts.values() if c is not None]
    result.update({
        "nodes_changed": len(times),
        "t_all_s": max(times) - 0 if len(times) == nodes else math.nan,
        "t_p50_node_s": quantile(times, 0.5),
        "new_value": Counter((c[1], c[2]) for c in firsts.values() if c).most_common(1)[0][0]
        if times else None,
        "update_bytes": [c[3] for c in firsts.values() if c is not None],
        "eds_bytes": [v["bytes"].get("EDS", 0) for v in r.values()],
        "eds_responses": [v["responses"].get("EDS", 0) for v in r.values()],
        "cp_cpu_s": cpu1 - cpu0,
        "cp_cpu_all_s": all1 - all0,
        "window_s": t1 - t0,
        "cp_rss": max(rss0, memory(cp.pid)[0]),
        "envoy_s": [(c[0] - t0) if (c := first_change(w.changes, None, weight, True)) else math.nan
                    for w in ctx["watches"]],
        "envoy_value": [w.value for w in ctx["watches"]],
    })  # fmt: skip
    result["stages"] = stages(ctx["admin"], f"m{pool}", t0, result["t_all_s"], stage_log)
    result["stages"]["export_acked_s"] = sent["acked_at"] - t0  # the receiver stored it
    if args.eject_timeout > 0:
        try:
            wait_until(lambda: all_changed("UNHEALTHY"), args.eject_timeout, "the ejection", 0.1)
            ej = [first_change(v["changes"], "UNHEALTHY") for v in ctx["last_report"].values()]
            result["t_eject_all_s"] = max(c[0] for c in ej) - t0
            result["envoy_eject_s"] = [(c[0] - t0) if (c := first_change(w.changes, "UNHEALTHY"))
                                       else math.nan for w in ctx["watches"]]  # fmt: skip
        except TimeoutError:
            result["t_eject_all_s"] = math.nan

    def agree() -> bool:  # the real Envoys hold what the synthetic nodes hold, read together
        values = report().values()
        final = Counter(tuple(v["value"]) if v["value"] else None for v in values).most_common(1)
        result["synthetic_final"] = final[0][0]
        want = final[0][0]  # weights compare (see first_change), health is reported
        return all(w.value and want and w.value[0] == want[0] for w in ctx["watches"])

    try:  # allow the real Envoys 3 s to catch up
        wait_until(agree, 3, "the real Envoys to agree", 0.1)
        result["envoys_agree"] = True
    except TimeoutError:
        result["envoys_agree"] = False
    result["envoy_final"] = [w.value for w in ctx["watches"]]
    heal_at = gen.ask(f"heal {key}")["sent_at"]
    if args.recovery_timeout > 0:

        def recovered() -> bool:
            r = report()
            # back HEALTHY with a weight within the hysteresis (10%) of the baseline's
            weight = baseline[0] if baseline else 1
            return all(
                v["value"] and v["value"][1] == "HEALTHY" and v["value"][0] >= 0.9 * weight
                for v in r.values()
            )

        try:
            result["recovery_s"] = wait_until(recovered, args.recovery_timeout, "recovery", 0.25)
        except TimeoutError:
            result["recovery_s"] = math.nan
        result["recovery_from_heal_s"] = time.time() - heal_at
    note(f"trial {k}: {key} in {cluster}: all {nodes} nodes in {result['t_all_s']:.3f} s, "
         f"envoys {result['envoy_s']}, eject {result.get('t_eject_all_s', math.nan):.2f} s, "
         f"cp cpu {result['cp_cpu_s']:.2f} s, stages {result['stages']}, "
         f"update {statistics.median(result['update_bytes'] or [0]):.0f} B")  # fmt: skip
    return result


def wait_synced(clients: Proc, nodes: int, args: argparse.Namespace) -> dict[str, Any]:
    state: dict[str, Any] = {}

    def synced() -> bool:
        s = clients.ask(json.dumps({"cmd": "status"}))
        state.update(s)
        return (s["synced"] == nodes and len(s["eds_versions"]) == 1
                and time.time() - s["last_eds_at"] > args.quiet)  # fmt: skip

    state["sync_s"] = wait_until(synced, args.sync_timeout, "every node in sync and quiet", 0.5)
    return state


def run_config(endpoints_n: int, nodes: int, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    began = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix=f"scale-{endpoints_n}-{nodes}-{mode}-"))
    out: dict[str, Any] = {"endpoints": endpoints_n, "nodes": nodes, "mode": mode,
                           "workdir": str(workdir), "control_plane_hash": tree_hash(),
                           "started": time.strftime("%H:%M:%S")}  # fmt: skip
    procs: list[Proc] = []
    watches: list[EnvoyWatch] = []
    try:
        fleets, endpoints = start_fleets(workdir, endpoints_n, args)
        procs += fleets
        (workdir / "endpoints.json").write_text(json.dumps(endpoints))
        topology = workdir / "topology.yaml"
        write_topology(topology, args, [e[1] for e in endpoints])
        cp = Proc("control-plane", [PYTHON, "-m", "control_plane", "--topology", str(topology),
                  "--xds-port", "0", "--admin-port", "0", "--otlp-port", "0"],
                  workdir / "control-plane.log")  # fmt: skip
        procs.append(cp)
        match: list[re.Match[str]] = []

        def listening() -> bool:
            if not cp.alive():
                raise RuntimeError(f"control plane exited:\n{cp.log()[-3000:]}")
            found = CP_RE.search(cp.log())
            match[:] = [found] if found else []
            return found is not None

        out["cp_listening_s"] = wait_until(listening, args.sync_timeout, "the control plane", 0.1)
        stamps = snapshot_times(cp.log())
        if stamps:
            out["first_snapshot_s"] = stamps[0] - cp.started
        xds, admin, otlp = (int(g) for g in match[0].groups())
        gen = Proc("otlp-gen", [PYTHON, str(SCALE / "otlp_gen.py"), "--otlp", f"{HOST}:{otlp}",
                   "--endpoints", str(workdir / "endpoints.json"), "--interval",
                   str(args.otlp_interval), "--channels", str(args.otlp_channels), "--slow-ms",
                   str(args.sla_ms * 6)], workdir / "otlp-gen.log", pipes=True,
                   nice=args.emulator_nice)  # fmt: skip
        procs.append(gen)
        clients = Proc("xds-clients", [PYTHON, str(SCALE / "xds_clients.py"), "--xds",
                       f"{HOST}:{xds}", "--nodes", str(nodes), "--mode", mode],
                       workdir / "xds-clients.log", pipes=True)  # fmt: skip
        procs.append(clients)
        for i in range(args.envoys):
            envoy, admin_port = start_envoy(workdir, f"envoy-{i}", xds, mode == "delta")
            procs.append(envoy)
            watches.append(EnvoyWatch(admin_port))
            watches[-1].start()
        state = wait_synced(clients, nodes, args)
        out["sync_s"], out["eds_clusters"] = state["sync_s"], state["eds_clusters"]
        note(
            f"{endpoints_n} endpoints, {nodes} {mode} nodes: in sync after {state['sync_s']:.1f} s"
        )
        # A fleet that just started is not at rest: every endpoint's windows fill for their
        # first window_s (moving every report) and each is sent whole again within the
        # shards' refresh period. A configuration in sync within seconds ran its first trial
        # in that, and it was its slowest in each of three runs (0.84, 1.29 and 1.78 s).
        time.sleep(max(0.0, args.warmup - (time.time() - gen.started)))
        tag = f"{endpoints_n}-{nodes}-{mode}"
        spy = profiler(cp.pid, args, f"idle-{tag}", args.idle, workdir)
        counts0, cpu0, t0 = fleet_counts(workdir, len(fleets)), cpu_seconds(cp.pid), time.time()
        tree0 = family_cpu_seconds(cp.pid)
        time.sleep(args.idle)
        if spy is not None:
            spy.proc.wait(args.idle + 30)
        counts1, cpu1, t1 = fleet_counts(workdir, len(fleets)), cpu_seconds(cp.pid), time.time()
        tree1 = family_cpu_seconds(cp.pid)
        ready_rate = (counts1["ServerReady"] - counts0["ServerReady"]) / (t1 - t0)
        out.update({
            "idle_cpu_cores": (cpu1 - cpu0) / (t1 - t0),
            "idle_cpu_cores_all": (tree1 - tree0) / (t1 - t0),  # with shards or decoders
            "idle_rss": memory(cp.pid)[0],
            "idle_rss_all": family_rss(cp.pid),
            "poll_server_ready_per_s": ready_rate,
            "poll_period_s": endpoints_n / ready_rate if ready_rate else math.nan,
            "gen_stats": gen.ask("stats"),
            "cp_metrics_idle": cp_metrics(admin),
            "cp_metrics_idle_at": time.time(),
            "decisions_idle": decisions_since(admin, t0),
        })  # fmt: skip
        args.nodes_now = nodes
        ctx = {"endpoints": endpoints, "clients": clients, "gen": gen, "cp": cp,
               "watches": watches, "admin": admin}  # fmt: skip
        spy = profiler(cp.pid, args, f"updates-{tag}", args.profile_s, workdir)
        if spy is not None:
            procs.append(spy)
            time.sleep(1.0)  # py-spy attached before the first change
        out["trials"] = [one_trial(k, ctx, args) for k in range(args.trials)]
        out["peak_rss"] = memory(cp.pid)[1]
        log = cp.log()
        out["cp_snapshots"] = log.count("snapshot set (")
        out["cp_unreachable_logs"] = log.count(" unreachable: ")
        out["cp_errors"] = len(re.findall(r" ERROR |Traceback", log))
        out["gen_stats_end"] = gen.ask("stats")
        out["cp_metrics_end"], out["cp_metrics_end_at"] = cp_metrics(admin), time.time()
        # An Envoy that died (it did at 10,000 hosts with 20,000 descriptors) reads n/a above.
        out["envoy_exit_codes"] = [p.proc.poll() for p in procs if p.name.startswith("envoy-")]
        if any(code is not None for code in out["envoy_exit_codes"]):
            note(f"real Envoys exited: {out['envoy_exit_codes']} (see envoy-*.log)")
    except (RuntimeError, TimeoutError, OSError, KeyError, ValueError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        note(f"configuration failed: {out['error'][:2000]}")
    finally:
        for w in watches:
            w.stopped.set()
        for proc in reversed(procs):
            proc.stop()
    out["runtime_s"] = time.monotonic() - began
    return out


def main() -> int:
    # SIGTERM unwinds like Ctrl-C, so every configuration's ``finally`` stops its processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--endpoints", type=ints, default=[1000, 10000])
    p.add_argument("--nodes", type=ints, default=[10, 100])
    p.add_argument("--modes", type=lambda s: s.split(","), default=["sotw", "delta"])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--models", type=int, default=100)
    p.add_argument("--envoys", type=int, default=2, help="real Envoys among the nodes")
    p.add_argument("--per-fleet", type=int, default=2000, help="endpoints per fleet process")
    p.add_argument("--sla-ms", type=float, default=50.0)
    p.add_argument("--poll-interval", type=float, default=1.0, help="placement poll (topology)")
    p.add_argument("--poll-timeout", type=float, default=1.0)
    p.add_argument(
        "--decoder-processes", type=int, default=0, help="telemetry.decoder_processes (OTLP)"
    )
    p.add_argument("--shards", type=int, default=0, help="telemetry.shards (OTLP processes)")
    p.add_argument("--shard-nice", type=int, default=5, help="telemetry.shard_nice")
    emulators = ("os.nice of the synthetic servers and the OTLP generator (a real deployment "
                 "runs them on other machines); xDS nodes and Envoys stay at 0")  # fmt: skip
    p.add_argument("--emulator-nice", type=int, default=0, help=emulators)
    p.add_argument("--otlp-interval", type=float, default=1.0, help="each endpoint's export")
    p.add_argument("--otlp-channels", type=int, default=0,
                   help="connections the generator spreads its batches over (0: one per batch "
                   "of 100 endpoints, as a fleet's servers each export on their own)")  # fmt: skip
    p.add_argument("--hc-interval", type=float, default=60.0,
                   help="Envoy active health checks of the fleet (listener option)")  # fmt: skip
    p.add_argument("--health-checks", choices=("all", "model"), default="all",
                   help="listener.health_checks: which clusters Envoy health-checks")  # fmt: skip
    p.add_argument("--quiet", type=float, default=3.0, help="no EDS for this long: in sync")
    p.add_argument("--sync-timeout", type=float, default=600.0)
    p.add_argument("--idle", type=float, default=5.0, help="seconds of idle CPU measurement")
    p.add_argument("--warmup", type=float, default=25.0,
                   help="seconds from the generator's start before measuring: the telemetry "
                        "window (10 s) and the shards' refresh period (15 s)")  # fmt: skip
    p.add_argument("--trial-timeout", type=float, default=30.0)
    p.add_argument("--eject-timeout", type=float, default=10.0)
    p.add_argument("--recovery-timeout", type=float, default=40.0, help="0: do not wait")
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="py-spy the control plane into this folder: idle, and the trials",
    )
    p.add_argument("--profile-s", type=float, default=20.0, help="seconds of the trials' profile")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--plot", type=Path, default=Path(__file__).parent / "plots" / "scale_results.png"
    )
    args = p.parse_args()
    # Inherited by the fleets and Envoys: each Envoy holds a health-check connection per host.
    note(f"open-file limit: {raise_open_file_limit()}")
    results = []
    for n_endpoints in args.endpoints:
        for nodes in args.nodes:
            for mode in args.modes:
                note(f"configuration: {n_endpoints} endpoints, {nodes} nodes, {mode}")
                results.append(run_config(n_endpoints, nodes, mode, args))
                if args.json is not None:
                    args.json.write_text(json.dumps(results, indent=1, default=str))
    print_table(results)
    plot(results, args.plot)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
