"""Good traffic while hostile clients attack the edge: does the listener's protection hold?

Two model servers, the control plane and Envoy (one worker, the listener's default limits:
control_plane/xds/edge_limits.py). Good traffic is h2load at a fixed rate (ModelInfer with the
x-model-name header), alone ("quiet") and then beside each attacker, in rounds, alternating:

- slowloris: 500 HTTP/1.1 connections, each sending a header byte a second, reopened when
  Envoy closes them (request_headers_timeout_s);
- header flood: requests with 200 headers each, back to back (431);
- h2 streams: one HTTP/2 connection opening streams without END_STREAM, 10,000 at once and
  then 10,000 more for as long as Envoy keeps it, answers read (max_concurrent_streams refuses
  all but 100; Envoy's flood guard closes the connection); then a new connection;
- h2 connections (once, after the rounds): the first 10,000 streams' bytes on connection after
  connection, each closed as soon as written (hundreds a second): a connection flood, which
  no per-connection limit bounds (see docs/security.md);
- oversized metadata: gRPC calls with a 100 KiB header, 20 at a time for as long as Envoy
  keeps the connection, on 8 connections at once;
  (the HTTP/2 attackers send bytes encoded once, so their CPU goes to sending; each but the
  connection flood reads its answers, as a client does)
- slow body: 50 REST requests each sending its body a byte a second (max_stream_duration_s).

Pass, for each attack: the good traffic has no failure (HTTP status from h2load, grpc-status
from the servers' own inference_requests_total), its P99 is within 2x the quiet P99 of the same
round, and Envoy's peak RSS stays under the overload manager's heap cap. Run it alone:

    flock /tmp/infermesh-bench.lock .venv/bin/python bench/bench_hostile.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bench_mesh as bm
import bench_model_server as bms
import hpack
import numpy as np
from scale.harness import memory

from control_plane.xds.bootstrap import MAX_HEAP_BYTES
from infermesh.api_keys import add_key, basic_authorization, new_key
from infermesh.wire import MODEL_HEADER
from model_server.demo_models import build_demo_repository

HOST = bm.HOST
# An attack that takes Envoy past this is stopped there and counted a failure: the host has
# other work (a flood of HTTP/2 frames took Envoy to 9.2 GB once before this guard).
RSS_ABORT_MIB = 2048
GOOD_CLIENTS, GOOD_RPS = 4, 50  # per client: 200 requests/s in all, far below saturation


@dataclass
class Run:
    attack: str
    requests: int
    failed: int  # non-200 from h2load plus non-OK from the servers
    p50_ms: float
    p99_ms: float
    envoy_peak_rss_mib: float
    attack_sent: int  # what the attacker managed to send (connections, requests, streams)
    envoy_cores: float  # Envoy's CPU over the timed window / its length
    attacker_cores: float  # this process's CPU (the attacker's threads, mostly) likewise
    rnd: int = 0  # the round, whose quiet run this one is compared with
    why: str = ""  # what the failures were: h2load statuses, server codes, calls never sent


# --- attackers: each runs until ``stop`` is set; returns how much it sent ----------------------


def _trickle(port: int, stop: threading.Event, connections: int, head: bytes, byte: bytes) -> int:
    """``connections`` HTTP/1.1 connections, each sending ``head`` and then ``byte`` once a
    second until Envoy closes it (then another opens); how many were opened."""

    async def one(opened: list[int]) -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(HOST, port)
            except OSError:
                await asyncio.sleep(0.5)
                continue
            opened[0] += 1
            writer.write(head)
            try:
                while not stop.is_set() and not reader.at_eof():
                    writer.write(byte)
                    await writer.drain()
                    await asyncio.sleep(1.0)
            except OSError:
                pass
            writer.close()

    async def main() -> int:
        opened = [0]
        await asyncio.gather(*(one(opened) for _ in range(connections)))
        return opened[0]

    return asyncio.run(main())


def slowloris(port: int, stop: threading.Event) -> int:
    """500 connections, each a header that never ends."""
    head = b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n"
    return _trickle(port, stop, 500, head, b"X")


def _http1(port: int, request: bytes, stop: threading.Event) -> int:
    sent = 0
    while not stop.is_set():
        with socket.create_connection((HOST, port), timeout=5) as sock:
            sock.sendall(request)
            with suppress(OSError):
                sock.recv(4096)
        sent += 1
    return sent


def header_flood(port: int, stop: threading.Event) -> int:
    headers = b"".join(b"X-Flood-%d: %s\r\n" % (i, b"v" * 64) for i in range(200))
    return _http1(port, b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n", stop)


def _grpc_headers(port: int) -> list[tuple[str, str]]:
    return [(":method", "POST"), (":scheme", "http"), (":path", bms.METHOD),
            (":authority", f"{HOST}:{port}"), ("content-type", "application/grpc"),
            ("te", "trailers"), (MODEL_HEADER, bm.MODEL_NAME)]  # fmt: skip


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + SETTINGS
MAX_FRAME = 16_384  # HTTP/2's default SETTINGS_MAX_FRAME_SIZE


def h2_frames(port: int, streams: int, extra: list[tuple[str, str]], end: bool) -> bytes:
    """A connection's bytes, preface and SETTINGS included, opening ``streams`` streams. Made
    once and replayed on every connection (HPACK state starts afresh with each one), so the
    attacker spends its CPU on sending, not on encoding, as a real one would. The ``extra``
    headers are never indexed, so every stream after the first is the same block; no Huffman
    coding (a 100 KiB value took hpack 1.4 s to Huffman-code, longer than a run)."""
    first, rest = _header_blocks(port, extra)
    frames = [_headers_frame(1 + 2 * i, rest if i else first, end) for i in range(streams)]
    return PREFACE + b"".join(frames)


def _header_blocks(port: int, extra: list[tuple[str, str]]) -> tuple[bytes, bytes]:
    """HPACK blocks of a gRPC call's headers and ``extra`` (never indexed): the first stream's
    (it fills the dynamic table), then every later one's (all indexed but ``extra``)."""
    encoder = hpack.Encoder()
    headers: list[Any] = [
        *_grpc_headers(port),
        *(hpack.NeverIndexedHeaderTuple(k, v) for k, v in extra),
    ]
    return encoder.encode(headers, huffman=False), encoder.encode(headers, huffman=False)


def _headers_frame(stream_id: int, block: bytes, end: bool = False) -> bytes:
    """HEADERS (END_STREAM if ``end``), then CONTINUATIONs past MAX_FRAME, END_HEADERS last."""
    chunks = [block[i : i + MAX_FRAME] for i in range(0, len(block), MAX_FRAME)] or [b""]
    out = []
    for n, chunk in enumerate(chunks):
        kind = 0x1 if n == 0 else 0x9
        flags = (0x4 if n == len(chunks) - 1 else 0) | (0x1 if end and n == 0 else 0)
        out.append(len(chunk).to_bytes(3, "big") + bytes([kind, flags]))
        out.append(stream_id.to_bytes(4, "big") + chunk)
    return b"".join(out)


def _replay(port: int, stop: threading.Event, payload: bytes, timeout_s: float) -> int:
    """Connections sending ``payload`` over and over, each closed once written (the bytes
    stay in the kernel for Envoy to work through); how many were opened."""
    opened = 0
    while not stop.is_set():
        try:
            with socket.create_connection((HOST, port), timeout=timeout_s) as sock:
                opened += 1
                sock.sendall(payload)
        except OSError:
            pass  # Envoy closed it or stopped reading: the next one
    return opened


def _stream_flood(
    port: int, stop: threading.Event, extra: list[tuple[str, str]], end: bool, batch: int
) -> int:
    """One HTTP/2 connection opening streams as fast as it can, ``batch`` at a time for as
    long as Envoy keeps it, while a reader takes what Envoy answers (as any client's would);
    a new connection when Envoy closes it. Streams after the first are one pre-encoded HPACK
    block, so the attacker's cost is a memcpy. Returns the streams sent."""
    first, block = _header_blocks(port, extra)
    sent = 0
    while not stop.is_set():
        try:
            with socket.create_connection((HOST, port), timeout=5.0) as sock:
                reader = threading.Thread(target=_drain, args=(sock,), daemon=True)
                reader.start()
                sock.sendall(PREFACE + _headers_frame(1, first, end))
                next_id = 3
                while not stop.is_set() and next_id < (1 << 31) - 2 * batch:
                    ids = range(next_id, next_id + 2 * batch, 2)
                    sock.sendall(b"".join(_headers_frame(i, block, end) for i in ids))
                    sent += batch
                    next_id += 2 * batch
        except OSError:
            pass  # Envoy closed it: the next one
    return sent


def _drain(sock: socket.socket) -> None:
    with suppress(OSError):
        while sock.recv(1 << 16):
            pass


def h2_streams(port: int, stop: threading.Event) -> int:
    """10,000 streams opened at once on one connection (no END_STREAM: they stay open), then
    10,000 more, and so on."""
    return _stream_flood(port, stop, [], False, 10_000)


def oversized_metadata(port: int, stop: threading.Event, connections: int = 8) -> int:
    """gRPC calls with a 100 KiB header, 20 at a time, on ``connections`` connections."""
    counts = [0] * connections

    def one(slot: int) -> None:
        counts[slot] = _stream_flood(port, stop, [("x-big", "v" * 100 * 1024)], True, 20)

    workers = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(connections)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(counts)


def h2_connection_flood(port: int, stop: threading.Event, per_connection: int = 10_000) -> int:
    """The first 10,000 streams' bytes on connection after connection, each closed as soon as
    written, its answers never read: hundreds of new connections a second, each holding
    10,000 streams' worth of frames for Envoy to work through."""
    payload = h2_frames(port, per_connection, [], end=False)
    return _replay(port, stop, payload, 5.0) * per_connection


def slow_body(port: int, stop: threading.Event) -> int:
    """50 REST requests, each a 1 MB body sent a byte a second."""
    head = (
        b"POST /v2/models/classifier/infer HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n"
    )
    return _trickle(port, stop, 50, head, b" ")


ATTACKS: dict[str, Callable[[int, threading.Event], int] | None] = {
    "quiet": None,
    "slowloris (500 connections)": slowloris,
    "header flood (200 headers)": header_flood,
    "h2: streams flooding one connection, 10,000 a batch": h2_streams,
    "oversized metadata (100 KiB, 8 at once)": oversized_metadata,
    "slow body (50, a byte a second)": slow_body,
}
# Run once, after the rounds: Envoy works through what it leaves for a minute or more and keeps
# the memory a while, which would weigh on whatever ran next.
AFTER_ROUNDS: dict[str, Callable[[int, threading.Event], int]] = {
    "h2-connections: 10,000 streams a connection, connections not awaited": h2_connection_flood,
}


# --- one run --------------------------------------------------------------------------------


def rss_mib(pid: int) -> float:
    return memory(pid)[0] / 2**20


def settle(pid: int, idle_cores: float = 0.2, deadline_s: float = 90.0) -> float:
    """Waits until Envoy is idle again (under ``idle_cores`` over half a second), so one
    attack's backlog is not charged to the next run; returns the seconds it took."""
    started = time.monotonic()
    while time.monotonic() - started < deadline_s:
        before = bms.cpu_seconds(pid) or 0.0
        time.sleep(0.5)
        if ((bms.cpu_seconds(pid) or 0.0) - before) / 0.5 < idle_cores:
            break
    return time.monotonic() - started


def run_once(
    args: argparse.Namespace, exe: str, mesh: bm.Mesh, attack: str, workdir: Path, rnd: int
) -> Run:
    attacker = {**ATTACKS, **AFTER_ROUNDS}[attack]
    settled_s = settle(mesh.envoy_pid)
    if settled_s > 1.0:
        print(f"  (Envoy took {settled_s:.1f} s to go idle after the previous run)", flush=True)
    stop, sent = threading.Event(), [0]
    thread = None
    if attacker is not None:
        thread = threading.Thread(
            target=lambda: sent.__setitem__(0, attacker(mesh.listener, stop)), daemon=True
        )
        thread.start()
        time.sleep(args.ramp)  # the attack at full size before good traffic is measured
    metrics = [f"http://{HOST}:{m}/metrics" for _, _, m in mesh.servers]
    before = [bms.settled_counts(url) or {} for url in metrics]
    peak = [rss_mib(mesh.envoy_pid)]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(0.25):
            peak.append(rss_mib(mesh.envoy_pid))
            if peak[-1] > RSS_ABORT_MIB and not stop.is_set():
                print(f"  (Envoy at {peak[-1]:.0f} MiB: attack stopped)", flush=True)
                stop.set()

    sampler = threading.Thread(target=sample, daemon=True)  # an interrupted run still exits
    sampler.start()
    envoy0, own0, wall0 = (
        bms.cpu_seconds(mesh.envoy_pid) or 0.0,
        time.process_time(),
        time.monotonic(),
    )
    rows = h2load(exe, mesh.listener, workdir, args.duration, args.credential)
    wall = time.monotonic() - wall0
    envoy_cores = ((bms.cpu_seconds(mesh.envoy_pid) or 0.0) - envoy0) / wall
    attacker_cores = (time.process_time() - own0) / wall
    sampling.set()
    sampler.join()
    stop.set()
    if thread is not None:
        thread.join(timeout=30)
    after = [bms.settled_counts(url) or {} for url in metrics]
    codes: Counter[str] = Counter()  # summed over the servers
    for a, b in zip(after, before, strict=True):
        for code, n in a.items():
            codes[code] += int(n - b.get(code, 0))
    # h2load stops with up to one call in flight per client (-m 1): the servers count those
    # CANCELLED, though no good client saw a failure. At most that many are not counted.
    at_stop = min(int(codes["CANCELLED"]), GOOD_CLIENTS)
    codes["CANCELLED"] -= at_stop
    non_ok = sum(codes.values())
    lat = np.array([float(r[2]) / 1e3 for r in rows if r[1] == "200"])
    # Calls h2load never completed (it could not connect, or Envoy never answered) are
    # failures too: the rate says how many there should have been.
    expected = GOOD_CLIENTS * GOOD_RPS * args.duration
    missing = max(0, int(expected * 0.98) - len(rows))
    statuses = Counter(r[1] for r in rows if r[1] != "200")
    why = ", ".join([*(f"HTTP {s} x{n}" for s, n in sorted(statuses.items())),
                     *(f"{c} x{n:.0f}" for c, n in sorted(codes.items()) if n),
                     *([f"never sent x{missing}"] if missing else []),
                     *([f"(not counted: {at_stop} CANCELLED at h2load's stop)"]
                       if at_stop else [])])  # fmt: skip
    return Run(
        attack, len(lat), len(rows) - len(lat) + int(non_ok) + missing,
        float(np.percentile(lat, 50)) if len(lat) else float("nan"),
        float(np.percentile(lat, 99)) if len(lat) else float("nan"),
        max(peak), sent[0], envoy_cores, attacker_cores, rnd, why,
    )  # fmt: skip


def h2load(exe: str, port: int, workdir: Path, seconds: float, credential: str) -> list[list[str]]:
    """The good traffic; ``credential``: its Authorization header ("" with auth off)."""
    frame, log = workdir / "frame.bin", workdir / "h2load.log"
    log.unlink(missing_ok=True)
    auth = ["-H", f"authorization: {credential}"] if credential else []
    cmd = [exe, "-c", str(GOOD_CLIENTS), "-m", "1", "-t", "1", f"--rps={GOOD_RPS}",
           "-D", f"{round(seconds * 1000)}ms", "-d", str(frame),
           "-H", "content-type: application/grpc", "-H", "te: trailers", *auth,
           "-H", f"{bm.HEADER[0]}: {bm.HEADER[1]}", "--log-file", str(log),
           f"http://{HOST}:{port}{bms.METHOD}"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"h2load failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return [line.split("\t") for line in log.read_text().splitlines() if line.strip()]


def report(runs: list[Run], rounds: int) -> int:
    print("\n| attack | good P50 ms | good P99 ms (median, range) | P99 / quiet (median, worst) "
          "| good failures | Envoy peak RSS MiB | Envoy cores | attacker cores | attacker sent "
          "| pass |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    quiet = {r.rnd: r for r in runs if r.attack == "quiet"}
    failed = 0
    for attack in [*ATTACKS, *AFTER_ROUNDS]:
        mine = [r for r in runs if r.attack == attack]
        if not mine:
            continue
        ratios = [r.p99_ms / quiet[r.rnd].p99_ms for r in mine]
        p99s = [r.p99_ms for r in mine]
        bad = sum(r.failed for r in mine)
        peak = max(r.envoy_peak_rss_mib for r in mine)
        ok = bad == 0 and max(ratios) <= 2.0 and peak < min(RSS_ABORT_MIB, MAX_HEAP_BYTES >> 20)
        failed += not ok
        print(f"| {attack} | {np.median([r.p50_ms for r in mine]):.2f} | "
              f"{np.median(p99s):.2f} ({min(p99s):.2f}-{max(p99s):.2f}) | "
              f"{np.median(ratios):.2f} ({max(ratios):.2f}) | {bad} of "
              f"{sum(r.requests + r.failed for r in mine):,} | {peak:.0f} | "
              f"{np.median([r.envoy_cores for r in mine]):.2f} | "
              f"{np.median([r.attacker_cores for r in mine]):.2f} | "
              f"{int(np.median([r.attack_sent for r in mine])):,} | "
              f"{'yes' if ok or attack == 'quiet' else 'NO'} |")  # fmt: skip
    return failed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "infermesh-bench")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of good traffic a run")
    p.add_argument("--ramp", type=float, default=3.0, help="seconds of attack before measuring")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--auth", choices=("api_keys", "off"), default="api_keys",
                   help="the listener's auth: api_keys (shipped; the good traffic has a key, the "
                   "attackers none) or off")  # fmt: skip
    p.add_argument("--attacks", default="", help="comma-separated names' first words "
                   "(slowloris,header,h2:,oversized,slow); default: all")  # fmt: skip
    args = p.parse_args()
    # A SIGTERM (timeout, kill) unwinds like Ctrl-C, so the ExitStack stops Envoy, the servers
    # and the control plane this run started instead of leaving them to the next one.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.attacks:
        wanted = {w.strip() for w in args.attacks.split(",")}
        for table in (ATTACKS, AFTER_ROUNDS):
            for name in [n for n in table if n != "quiet" and n.split()[0] not in wanted]:
                del table[name]
    load_avg = os.getloadavg()[0]
    build_demo_repository(args.models)
    exe = bms.ensure_h2load()
    _, req = bms.make_request(1)
    payload = req.SerializeToString()
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="bench-hostile-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        (workdir / "frame.bin").write_bytes(b"\0" + len(payload).to_bytes(4, "big") + payload)
        spec = bms.server_specs(args.models)[0]
        servers = [stack.enter_context(bms.start_server(spec, workdir / f"s{i}.log"))
                   for i in (1, 2)]  # fmt: skip
        listener = bm.free_port()
        auth, args.credential = {"mode": "off"}, ""
        if args.auth == "api_keys":
            key = new_key("good")
            add_key(workdir / "api-keys", key)
            auth = {"mode": "api_keys", "api_keys_file": str(workdir / "api-keys")}
            args.credential = basic_authorization(key)
        endpoints = [f"{HOST}:{port}" for _, port, _ in servers]
        topology = bm.write_topology(workdir / "topology.yaml", listener, endpoints, auth)
        cp_admin, envoy_pid, envoy_admin = bm.start_plane_and_envoy(stack, workdir, topology)
        mesh = bm.Mesh(servers, envoy_pid, envoy_admin, cp_admin, listener)
        envoy = bm.Admin(envoy_admin)
        bm.wait_for(lambda: envoy.call("/clusters").count("::health_flags::healthy") >= 4, 30,
                    "healthy hosts")  # fmt: skip
        bm.grpc_check(f"{HOST}:{listener}", req, True, None, args.credential)
        plan = [(rnd, attack) for rnd in range(args.rounds) for attack in ATTACKS]
        plan += [(args.rounds - 1, attack) for attack in AFTER_ROUNDS]
        for rnd, attack in plan:
            runs.append(run := run_once(args, exe, mesh, attack, workdir, rnd))
            print(f"round {rnd + 1} {attack}: P99 {run.p99_ms:.2f} ms, failed "
                  f"{run.failed}, Envoy RSS {run.envoy_peak_rss_mib:.0f} MiB, Envoy "
                  f"{run.envoy_cores:.2f} cores, attacker {run.attacker_cores:.2f} cores, "
                  f"sent {run.attack_sent:,}" + (f"; failures: {run.why}" if run.why else ""),
                  flush=True)  # fmt: skip
    print(f"\n## Good traffic under hostile clients: commit {bm.commit()}, nproc "
          f"{os.cpu_count()}, load average at start {load_avg:.2f}")  # fmt: skip
    print(f"h2load -c {GOOD_CLIENTS} --rps {GOOD_RPS} (ModelInfer, batch 1, x-model-name), "
          f"{args.duration:g} s a run after a {args.ramp:g} s ramp of the attack; {args.rounds} "
          f"rounds, attacks alternating; Envoy --concurrency 1, 2 model servers, default "
          f"listener limits; ratios against the same round's quiet run")  # fmt: skip
    return 1 if report(runs, args.rounds) else 0


if __name__ == "__main__":
    raise SystemExit(main())
