"""Benchmark mutual TLS inside the mesh: the same mesh in plaintext and over mTLS, side by side,
and a third with edge TLS on top (as ``infermesh up`` runs it).

Three meshes run at once, each with two model servers, the control plane and Envoy (one
worker): one in plaintext; one with ``listener.upstream_tls`` (servers with ``--tls-*``,
Envoy's certificate and the CA over SDS, each connection checking the server's name), its
clients plaintext at the edge; one with that and ``listener.tls`` (clients over TLS, h2 by
ALPN). In each round, at each concurrency, h2load drives each mesh's listener in turn
(bench_mesh.py's method: raw gRPC frames, x-model-name; its connections are made once, before
the warm-up, so handshakes are not in the figures); medians of the rounds, the QPS and
latency ratios to plaintext, and the ratio of each round's pair.

Then a reconnect storm at one model server of each mesh: N new connections at once (their own
subchannels), each asking ServerReady once, plaintext against mTLS (an operator certificate,
the server's name checked): wall time until all are answered and the server's CPU per
connection. Last, the resident memory of each mesh's Envoy and servers after the load.

    flock /tmp/infermesh-bench.lock .venv/bin/python bench/bench_mtls.py \
        [--duration 8 --rounds 3 --concurrency 1,16,64 --storm 200]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import re
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import bench_edge as be
import bench_mesh as bm
import bench_model_server as bms
import grpc
import yaml
from scale.harness import memory
from tritonclient.grpc import service_pb2, service_pb2_grpc

from infermesh import pki

HOST = bms.HOST
PLAIN, MTLS, EDGE = "plaintext inside", "mTLS inside", "mTLS inside + edge TLS"
ENVOY_NODE = "bench-envoy"  # bench_mesh.start_envoy's node id


def start_servers(
    stack: ExitStack, models: Path, workdir: Path, authority: pki.Authority | None
) -> list[tuple[int, int, int | None]]:
    """Two model servers (REST at gRPC + offset); with ``authority``, each over mTLS with a
    certificate for its own address."""
    spec = bms.server_specs(models)[0]
    servers = []
    for i in (1, 2):
        port = be.free_pair()
        cmd = [*spec.cmd, "--port", str(port), "--http-port", str(port + be.REST_OFFSET)]
        if authority is not None:
            directory = workdir / "pki"
            files = pki.issue(authority, pki.model_server(f"{HOST}:{port}"), directory)
            cmd += ["--tls-cert", str(files.cert), "--tls-key", str(files.key),
                    "--tls-ca", str(directory / "ca.crt")]  # fmt: skip
        server = bms.ServerSpec(f"{workdir.name} server {i}", cmd, spec.listen, spec.ready)
        servers.append(stack.enter_context(bms.start_server(server, workdir / f"s{i}.log")))
    return servers


def start_mesh(
    stack: ExitStack, models: Path, workdir: Path, tls: bool, edge: bool = False
) -> bm.Mesh:
    """``tls``: mTLS inside; ``edge``: the listener speaks TLS too (as ``infermesh up`` runs
    it: the mesh CA's certificate for localhost)."""
    workdir.mkdir()
    authority = None
    if tls:
        authority = pki.init_authority(workdir / "pki")
        for who in (pki.control_plane(), pki.envoy(ENVOY_NODE), pki.operator("bench"),
                    pki.edge("localhost")):  # fmt: skip
            pki.issue(authority, who, workdir / "pki")
    servers = start_servers(stack, models, workdir, authority)
    listener = bm.free_port()
    topology = be.write_topology(workdir / "topology.yaml", listener,
                                 [f"{HOST}:{port}" for _, port, _ in servers])  # fmt: skip
    data = yaml.safe_load(topology.read_text())
    data["telemetry"] = {"port": bm.free_port()}  # two control planes on one host
    if tls:
        data["listener"]["upstream_tls"] = {"pki_dir": str(workdir / "pki")}
    if edge:
        files = pki.workload_files(workdir / "pki", pki.edge("localhost"))
        data["listener"]["tls"] = {"cert_file": str(files.cert), "key_file": str(files.key)}
    topology.write_text(yaml.safe_dump(data))
    cp_admin, envoy_pid, envoy_admin = bm.start_plane_and_envoy(stack, workdir, topology)
    envoy = bm.Admin(envoy_admin)
    healthy = re.compile(f"^{bm.CLUSTER}::.*::health_flags::healthy$", re.M)
    bm.wait_for(lambda: len(healthy.findall(envoy.call("/clusters"))) == 2, 60,
                f"2 healthy hosts in {workdir.name}")  # fmt: skip
    scheme = "https" if edge else "http"
    return bm.Mesh(servers, envoy_pid, envoy_admin, cp_admin, listener, scheme)


# --- the reconnect storm ---------------------------------------------------------------------


def _credentials(workdir: Path) -> grpc.ChannelCredentials:
    mine = pki.load_workload(workdir / "pki", pki.operator("bench"))
    return grpc.ssl_channel_credentials(mine.ca_pem, mine.key_pem, mine.cert_pem)


async def _storm(address: str, n: int, tls: grpc.ChannelCredentials | None) -> tuple[float, int]:
    """``n`` new connections at once, one ServerReady each: (seconds, answered)."""
    options: list[tuple[str, str | int]] = [("grpc.use_local_subchannel_pool", 1)]  # its own
    if tls is not None:
        options.append(("grpc.ssl_target_name_override", pki.server_dns_name(address)))
    channels = [
        grpc.aio.secure_channel(address, tls, options=options)
        if tls is not None
        else grpc.aio.insecure_channel(address, options=options)
        for _ in range(n)
    ]
    started = time.perf_counter()

    async def ready(channel: grpc.aio.Channel) -> bool:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            answer = await stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=30)
        except grpc.RpcError:
            return False
        return bool(answer.ready)

    answered = sum(await asyncio.gather(*(ready(c) for c in channels)))
    elapsed = time.perf_counter() - started
    await asyncio.gather(*(c.close() for c in channels))
    return elapsed, answered


def storm(mesh: bm.Mesh, workdir: Path, n: int, tls: bool) -> tuple[float, int, float]:
    """(seconds, answered, the server's CPU ms per connection) for one storm at server 1."""
    pid, port, _ = mesh.servers[0]
    credentials = _credentials(workdir) if tls else None
    cpu0 = bms.cpu_seconds(pid) or 0.0
    elapsed, answered = asyncio.run(_storm(f"{HOST}:{port}", n, credentials))
    time.sleep(0.5)  # the server finishes closing the connections: charged to this storm
    cpu = (bms.cpu_seconds(pid) or 0.0) - cpu0
    return elapsed, answered, cpu * 1e3 / n


# --- the report ------------------------------------------------------------------------------


def report(samples: list[bm.Sample], levels: list[int]) -> None:
    print("\n| c | setup | QPS | p50 ms | p99 ms | non-OK | Envoy CPU ms/request | Envoy cores "
          "| servers CPU ms/request | QPS / plain | p50 / plain | p99 / plain "
          "| QPS ratio per round |\n" + "| --- " * 13 + "|")  # fmt: skip
    for c in levels:

        def pick(name: str, c: int = c) -> list[bm.Sample]:
            return [s for s in samples if s.setup == name and s.level.concurrency == c]

        base = bms.median_level([s.level for s in pick(PLAIN)])
        for name in (PLAIN, MTLS, EDGE):
            group = pick(name)
            m = bms.median_level([s.level for s in group])
            per_round = [s.level.qps / p.level.qps for s, p in zip(group, pick(PLAIN), strict=True)]
            cells = [m.qps / base.qps, m.p50_ms / base.p50_ms, m.p99_ms / base.p99_ms]
            print(f"| {c} | {name} | {bms.fmt_row(m)} | "
                  f"{bms.median([s.server_cpu_ms for s in group]):.3f} | "
                  + " | ".join(f"{r:.2f}" for r in cells) + " | "
                  + ", ".join(f"{r:.2f}" for r in per_round) + " |")  # fmt: skip


def report_storms(storms: dict[str, list[tuple[float, int, float]]], n: int) -> None:
    print(f"\n## Reconnect storm: {n} new connections at once to one model server, one "
          "ServerReady each (medians; per round)\n")  # fmt: skip
    print("| setup | seconds until all answered | answered | server CPU ms per connection "
          "| per round (s; CPU ms) |\n" + "| --- " * 5 + "|")  # fmt: skip
    for name, runs in storms.items():
        secs, answered, cpu = (bms.median([r[i] for r in runs]) for i in range(3))
        rounds = ", ".join(f"{r[0]:.2f}" for r in runs) + "; "
        rounds += ", ".join(f"{r[2]:.2f}" for r in runs)
        print(f"| {name} | {secs:.2f} | {answered:.0f} of {n} | {cpu:.2f} | {rounds} |")


def rss_line(name: str, mesh: bm.Mesh) -> str:
    envoy = memory(mesh.envoy_pid)[0] / 2**20
    servers = [memory(pid)[0] / 2**20 for pid, _, _ in mesh.servers]
    return f"| {name} | {envoy:.0f} | " + ", ".join(f"{s:.0f}" for s in servers) + " |"


def main() -> int:
    p = argparse.ArgumentParser(description="mTLS inside the mesh vs plaintext, side by side.")
    be.add_run_arguments(p, rounds=3)
    p.set_defaults(concurrency="1,16,64")
    p.add_argument("--storm", type=int, default=200, help="connections in a reconnect storm")
    args = p.parse_args()
    levels, load_avg, exe = be.prepare(args)
    _, req = bms.make_request(1)
    payload = req.SerializeToString()
    samples: list[bm.Sample] = []
    storms: dict[str, list[tuple[float, int, float]]] = {PLAIN: [], MTLS: []}
    with tempfile.TemporaryDirectory(prefix="bench-mtls-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        (workdir / "frame.bin").write_bytes(b"\0" + len(payload).to_bytes(4, "big") + payload)
        meshes = {
            PLAIN: start_mesh(stack, args.models, workdir / "plain", tls=False),
            MTLS: start_mesh(stack, args.models, workdir / "mtls", tls=True),
            EDGE: start_mesh(stack, args.models, workdir / "edge", tls=True, edge=True),
        }
        checks = []
        for name, mesh in meshes.items():
            ca = (workdir / "edge" / "pki" / "ca.crt").read_bytes() if name == EDGE else None
            target = f"localhost:{mesh.listener}" if ca else f"{HOST}:{mesh.listener}"
            checks.append(f"{name}: {bm.grpc_check(target, req, True, None, root_ca=ca)[0]}")
        for rnd, c in itertools.product(range(args.rounds), levels):
            for name, mesh in meshes.items():
                setup = (name, mesh.listener, True)
                samples.append(run := bm.run_once(args, exe, mesh, setup, c, workdir))
                print(f"round {rnd + 1} c{c} {name}: {bms.fmt_row(run.level)}", flush=True)
        memory_rows = [rss_line(name, mesh) for name, mesh in meshes.items()]
        for rnd in range(args.rounds):  # the storm is at a server: the edge does not change it
            for name, mesh in ((n, m) for n, m in meshes.items() if n != EDGE):
                folder = workdir / ("mtls" if name == MTLS else "plain")
                storms[name].append(result := storm(mesh, folder, args.storm, name == MTLS))
                print(f"storm round {rnd + 1} {name}: {result[0]:.2f} s, {result[1]} answered, "
                      f"{result[2]:.2f} server CPU ms per connection", flush=True)  # fmt: skip
        problems = [f"{f.name}: {ln}" for f in sorted(workdir.glob("*/*.log"))
                    for ln in f.read_text(errors="replace").splitlines()
                    if bm.PROBLEM_RE.search(ln)]  # fmt: skip
    print(f"\n## mTLS inside the mesh vs plaintext, through Envoy: commit {bm.commit()}, nproc "
          f"{os.cpu_count()}, load average at start {load_avg:.2f}")  # fmt: skip
    print(f"h2load -m 1 -t 1, {args.duration:g} s per run after a {args.warmup:g} s warm-up; "
          f"{args.rounds} rounds, the meshes alternating; medians; each mesh: Envoy "
          "--concurrency 1, 2 servers, both meshes up throughout")  # fmt: skip
    print("\n".join(f"check {c}" for c in checks))
    report(samples, levels)
    report_storms(storms, args.storm)
    print("\n## Resident memory after the load (MiB)\n\n| mesh | Envoy | servers |\n| --- | --- "
          "| --- |\n" + "\n".join(memory_rows))  # fmt: skip
    if problems:
        print(f"log error lines: {len(problems)}, first: {problems[0]}")
    bad = sum(sum(s.level.non_ok.values()) + s.level.failed for s in samples)
    lost = sum(args.storm - r[1] for runs in storms.values() for r in runs)
    return 1 if bad or lost or problems else 0


if __name__ == "__main__":
    sys.exit(main())
