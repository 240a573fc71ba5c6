"""Benchmark the edge protocols through Envoy: KServe v2 REST (binary tensors, JSON tensors) vs
gRPC, the same mesh (two model servers, the control plane, Envoy with one worker).

gRPC is driven as bench_mesh.py does (h2load, raw gRPC frames, x-model-name header); REST with
``h2load --h1`` POSTing the pre-encoded body to /v2/models/classifier/infer (the path routes it;
no header, no Lua). Setups alternate within each round and level; medians of the rounds.

    flock /tmp/infermesh-bench.lock .venv/bin/python bench/bench_edge.py \
        [--duration 8 --rounds 2 --concurrency 1,16]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import bench_mesh as bm
import bench_model_server as bms
import numpy as np
import yaml

from model_server.demo_models import MODEL_NAME, build_demo_repository

HOST = bms.HOST
REST_OFFSET = 2000  # the topology default and the model server's default --http-port offset
REST_PATH = f"/v2/models/{MODEL_NAME}/infer"
GRPC, BINARY, JSON_ = "gRPC (h2, x-model-name)", "REST binary tensors (HTTP/1.1)", "REST JSON"
SETUPS = (GRPC, BINARY, JSON_)


@dataclass
class Sample:
    setup: str
    level: bms.Level  # cpu_ms_per_request / server_cores: Envoy's
    server_cpu_ms: float  # both servers' CPU ms per OK request


def free_pair() -> int:
    """A gRPC port P with P + REST_OFFSET free too."""
    for _ in range(100):
        with socket.socket() as sock:
            sock.bind((HOST, 0))
            port = int(sock.getsockname()[1])
        if port + REST_OFFSET > 65535:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((HOST, port + REST_OFFSET))
            except OSError:
                continue
        return port
    sys.exit("no free port pair")


def bodies(x: np.ndarray) -> dict[str, tuple[bytes, list[str]]]:
    """The REST request bodies and their headers: binary tensors, then JSON tensors."""
    raw = x.tobytes()
    header = json.dumps({
        "inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                    "parameters": {"binary_data_size": len(raw)}}],
        "outputs": [{"name": "probs", "parameters": {"binary_data": True}}],
    }, separators=(",", ":")).encode()  # fmt: skip
    as_json = json.dumps({
        "inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                    "data": x.flatten().tolist()}],
    }, separators=(",", ":")).encode()  # fmt: skip
    return {
        BINARY: (header + raw, ["content-type: application/octet-stream",
                                f"inference-header-content-length: {len(header)}"]),
        JSON_: (as_json, ["content-type: application/json"]),
    }  # fmt: skip


def check_rest(listener: int, body: bytes, headers: list[str], want: np.ndarray) -> str:
    """One REST call through Envoy; its output must equal the gRPC answer."""
    hdrs = dict(h.split(": ", 1) for h in headers)
    req = urllib.request.Request(f"http://{HOST}:{listener}{REST_PATH}", body, hdrs)
    with urllib.request.urlopen(req, timeout=30) as resp:
        data, status = resp.read(), resp.status
        length = resp.headers.get("inference-header-content-length")
    if length is not None:
        got = np.frombuffer(data[int(length) :], np.float32)
    else:
        got = np.array(json.loads(data)["outputs"][0]["data"], np.float32)
    if not np.allclose(got, want.flatten(), rtol=1e-5):
        sys.exit("REST through Envoy: output differs from gRPC's")
    return f"HTTP {status}, output = gRPC's (allclose 1e-5)"


def h2load(exe: str, setup: str, listener: int, c: int, seconds: float, workdir: Path,
           log: Path, rest: dict[str, tuple[bytes, list[str]]],
           headers: tuple[str, ...] = ()) -> list[list[str]]:  # fmt: skip
    """``headers``: more request headers ("name: value"), e.g. a credential."""
    cmd = [exe, "-c", str(c), "-m", "1", "-t", "1", "-D", f"{round(seconds * 1000)}ms"]
    for header in headers:
        cmd += ["-H", header]
    if setup == GRPC:
        cmd += ["-d", str(workdir / "frame.bin"), "-H", "content-type: application/grpc",
                "-H", "te: trailers", "-H", f"x-model-name: {MODEL_NAME}"]  # fmt: skip
        url = f"http://{HOST}:{listener}{bms.METHOD}"
    else:
        cmd += ["--h1", "-d", str(workdir / f"{SETUPS.index(setup)}.body")]
        for header in rest[setup][1]:
            cmd += ["-H", header]
        url = f"http://{HOST}:{listener}{REST_PATH}"
    log.unlink(missing_ok=True)
    out = subprocess.run([*cmd, "--log-file", str(log), url], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"h2load failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return [line.split("\t") for line in log.read_text().splitlines() if line.strip()]


def run_once(args: argparse.Namespace, exe: str, mesh: bm.Mesh, setup: str, c: int,
             workdir: Path, rest: dict[str, tuple[bytes, list[str]]],
             headers: tuple[str, ...] = (), label: str = "") -> Sample:  # fmt: skip
    """One timed run of ``setup`` (after a warm-up); ``label`` names it in the sample."""
    metrics = [f"http://{HOST}:{m}/metrics" for _, _, m in mesh.servers]
    pids = [mesh.envoy_pid] + [pid for pid, _, _ in mesh.servers]
    h2load(exe, setup, mesh.listener, c, args.warmup, workdir, workdir / "warmup.log", rest,
           headers)  # fmt: skip
    before, cpu0 = bm.codes(metrics), [bms.cpu_seconds(p) or 0.0 for p in pids]
    rows = h2load(exe, setup, mesh.listener, c, args.duration, workdir, workdir / "run.log", rest,
                  headers)  # fmt: skip
    cpu = [(bms.cpu_seconds(p) or 0.0) - c0 for p, c0 in zip(pids, cpu0, strict=True)]
    after = bm.codes(metrics)
    lat_ms = np.array([float(r[2]) / 1e3 for r in rows if r[1] == "200"])
    ok, non_ok = len(lat_ms), dict[str, float]()
    for a, b in zip(after, before, strict=True):
        for k, v in ((k, v - b.get(k, 0.0)) for k, v in a.items()):
            if k != "OK" and v > 0:
                non_ok[k] = non_ok.get(k, 0.0) + v
    cancelled = non_ok.pop("CANCELLED", 0.0) if non_ok.get("CANCELLED", 0.0) <= c else 0.0
    level = bms.Level(
        concurrency=c, requests=ok, failed=len(rows) - ok, qps=ok / args.duration,
        p50_ms=float(np.percentile(lat_ms, 50)) if ok else math.nan,
        p99_ms=float(np.percentile(lat_ms, 99)) if ok else math.nan,
        non_ok=non_ok, cancelled_at_stop=cancelled,
        cpu_ms_per_request=cpu[0] * 1e3 / ok if ok else None,
        server_cores=cpu[0] / args.duration,
    )  # fmt: skip
    return Sample(label or setup, level, sum(cpu[1:]) * 1e3 / ok if ok else math.nan)


def write_topology(path: Path, listener: int, endpoints: list[str]) -> Path:
    data = {
        "listener": {"auth": {"mode": "off"}, "host": HOST, "port": listener,
                     "health_check_interval_s": 0.5,
                     "rest": {"enabled": True, "port_offset": REST_OFFSET}},
        "placement": {"poll_interval_s": 0.2, "timeout_s": 1.0},
        "models": [{"name": MODEL_NAME, "sla_p99_ms": 100, "capacity_qps": 1000}],
        "endpoints": [{"address": e} for e in endpoints],
    }  # fmt: skip
    path.write_text(yaml.safe_dump(data))
    return path


def report(samples: list[Sample], levels: list[int]) -> None:
    print("\n| c | setup | QPS | p50 ms | p99 ms | non-OK | Envoy CPU ms/request | Envoy cores "
          "| servers CPU ms/request | QPS / gRPC | p50 / gRPC | QPS / gRPC per round |\n"
          + "| --- " * 12 + "|")  # fmt: skip
    for c in levels:

        def pick(name: str, c: int = c) -> list[Sample]:
            return [s for s in samples if s.setup == name and s.level.concurrency == c]

        base = bms.median_level([s.level for s in pick(GRPC)])
        for name in SETUPS:
            group = pick(name)
            m = bms.median_level([s.level for s in group])
            per_round = [s.level.qps / g.level.qps
                         for s, g in zip(group, pick(GRPC), strict=True)]  # fmt: skip
            print(f"| {c} | {name} | {bms.fmt_row(m)} | "
                  f"{bms.median([s.server_cpu_ms for s in group]):.2f} | "
                  f"{m.qps / base.qps:.2f} | {m.p50_ms / base.p50_ms:.2f} | "
                  + ", ".join(f"{r:.2f}" for r in per_round) + " |")  # fmt: skip


def add_run_arguments(p: argparse.ArgumentParser, rounds: int) -> None:
    """The options of a bench that alternates setups at each concurrency level."""
    p.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "infermesh-bench")
    p.add_argument("--concurrency", default="1,16", help="comma-separated client counts")
    p.add_argument("--duration", type=float, default=8.0, help="seconds per timed run")
    p.add_argument("--warmup", type=float, default=2.0, help="discarded seconds before each run")
    p.add_argument(
        "--rounds", type=int, default=rounds, help="runs per setup and level, alternating"
    )


def prepare(args: argparse.Namespace) -> tuple[list[int], float, str]:
    """(concurrency levels, load average at start, h2load's path), the demo models built."""
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    load_avg = os.getloadavg()[0]
    build_demo_repository(args.models)
    return levels, load_avg, bms.ensure_h2load()


def start_servers(
    stack: ExitStack, models: Path, workdir: Path
) -> list[tuple[int, int, int | None]]:
    """Two model servers, each with its REST port at gRPC + REST_OFFSET, stopped by ``stack``."""
    spec = bms.server_specs(models)[0]
    servers = []
    for i in (1, 2):
        port = free_pair()
        cmd = [*spec.cmd, "--port", str(port), "--http-port", str(port + REST_OFFSET)]
        server = bms.ServerSpec(f"model server {i}", cmd, spec.listen, spec.ready)
        servers.append(stack.enter_context(bms.start_server(server, workdir / f"s{i}.log")))
    return servers


def main() -> int:
    p = argparse.ArgumentParser(description="REST vs gRPC through Envoy, 2 model servers.")
    add_run_arguments(p, rounds=2)
    args = p.parse_args()
    levels, load_avg, exe = prepare(args)
    x, req = bms.make_request(1)
    payload = req.SerializeToString()
    rest = bodies(x)
    with tempfile.TemporaryDirectory(prefix="bench-edge-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        (workdir / "frame.bin").write_bytes(b"\0" + len(payload).to_bytes(4, "big") + payload)
        for setup, (body, _) in rest.items():
            (workdir / f"{SETUPS.index(setup)}.body").write_bytes(body)
        servers = start_servers(stack, args.models, workdir)
        listener = bm.free_port()
        topology = write_topology(workdir / "topology.yaml", listener,
                                  [f"{HOST}:{port}" for _, port, _ in servers])  # fmt: skip
        cp_admin, envoy_pid, envoy_admin = bm.start_plane_and_envoy(stack, workdir, topology)
        mesh = bm.Mesh(servers, envoy_pid, envoy_admin, cp_admin, listener)
        envoy = bm.Admin(envoy_admin)
        for cluster in (bm.CLUSTER, f"rest:{bm.CLUSTER}"):
            healthy = re.compile(f"^{cluster}::.*::health_flags::healthy$", re.M)

            def two_healthy(pattern: re.Pattern[str] = healthy) -> bool:
                return len(pattern.findall(envoy.call("/clusters"))) == 2

            bm.wait_for(two_healthy, 30, f"2 healthy hosts in {cluster}")
        status, want = bm.grpc_check(f"{HOST}:{listener}", req, True, None)
        probs = np.frombuffer(want, np.float32)
        checks = [f"{GRPC}: {status}"]
        checks += [f"{name}: {check_rest(listener, *rest[name], probs)}" for name in rest]
        samples = []
        for rnd, c, setup in itertools.product(range(args.rounds), levels, SETUPS):
            samples.append(run := run_once(args, exe, mesh, setup, c, workdir, rest))
            print(f"round {rnd + 1} c{c} {setup}: {bms.fmt_row(run.level)}", flush=True)
        problems = [f"{f.name}: {ln}" for f in sorted(workdir.glob("*.log"))
                    for ln in f.read_text(errors="replace").splitlines()
                    if bm.PROBLEM_RE.search(ln)]  # fmt: skip
    sizes = ", ".join(f"{name} {len(body):,} B" for name, (body, _) in rest.items())
    print(f"\n## REST vs gRPC through Envoy, batch 1: commit {bm.commit()}, nproc "
          f"{os.cpu_count()}, load average at start {load_avg:.2f}")  # fmt: skip
    print(f"h2load -m 1 -t 1 (REST: --h1), {args.duration:g} s per run after a {args.warmup:g} s "
          f"warm-up; {args.rounds} rounds, setups alternating; medians; Envoy --concurrency 1, "
          f"2 servers; request bodies: gRPC {len(payload):,} B, {sizes}")  # fmt: skip
    print("\n".join(f"check {c}" for c in checks))
    report(samples, levels)
    if problems:
        print(f"log error lines: {len(problems)}, first: {problems[0]}")
    bad = sum(sum(s.level.non_ok.values()) + s.level.failed for s in samples)
    return 1 if bad or problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
