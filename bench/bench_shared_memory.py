"""What system shared memory buys: a 4 MiB FP32 tensor through an identity model, in the
message (``raw_input_contents`` / ``raw_output_contents``) against in registered regions
(Triton's shared-memory extension), side by side on one server, alternating within each round.

Stock ``tritonclient.grpc`` and ``tritonclient.utils.shared_memory``, one closed-loop client
per ``--clients``. Each request does what a client really does: the message mode sets the
input from numpy and reads the output with ``as_numpy``; the shared-memory mode writes the
input into its region (``set_shared_memory_region``, a 4 MiB copy) and reads the output from
its region (``get_contents_as_numpy``, a view). Both answers are checked against the input
once before the rounds. Prints per mode the median QPS of the rounds with their spread
(min-max), server CPU ms per request, the ratio of the medians and each round's ratio, and
what else ran: the load average and the busiest other processes (CPU % from /proc), before
and during the rounds.

    flock /tmp/infermesh-bench.lock .venv/bin/python bench/bench_shared_memory.py \
        [--rounds 5 --duration 4 --clients 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import bench_model_server as bms
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm

from model_server.demo_models import build_identity_model, write_model

MODEL = "identity_4mib"
ELEMENTS = 1 << 20  # FP32: 4 MiB
NBYTES = ELEMENTS * 4
HEADER = "infermesh-operator-key"
MESSAGE, SHARED = "in the message", "shared memory"


@dataclass(frozen=True)
class Round:
    qps: float
    cpu_ms: float  # server CPU per request


class Client:
    """One closed-loop client with its own connection and regions."""

    def __init__(self, url: str, auth: dict[str, str], data: np.ndarray) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.auth = auth
        self.data = data
        tag = uuid.uuid4().hex[:10]
        self.keys = (f"/infermesh_bench_in_{tag}", f"/infermesh_bench_out_{tag}")
        self.handles = [
            shm.create_shared_memory_region(f"in_{tag}", self.keys[0], NBYTES),
            shm.create_shared_memory_region(f"out_{tag}", self.keys[1], NBYTES),
        ]
        self.regions = (f"in_{tag}", f"out_{tag}")
        for name, key in zip(self.regions, self.keys, strict=True):
            self.client.register_system_shared_memory(name, key, NBYTES, headers=auth)

    def in_message(self) -> np.ndarray:
        x = grpcclient.InferInput("x", [1, ELEMENTS], "FP32")
        x.set_data_from_numpy(self.data)
        return self.client.infer(MODEL, [x], headers=self.auth).as_numpy("y")

    def in_shared_memory(self) -> np.ndarray:
        shm.set_shared_memory_region(self.handles[0], [self.data])
        x = grpcclient.InferInput("x", [1, ELEMENTS], "FP32")
        x.set_shared_memory(self.regions[0], NBYTES)
        y = grpcclient.InferRequestedOutput("y")
        y.set_shared_memory(self.regions[1], NBYTES)
        result = self.client.infer(MODEL, [x], outputs=[y], headers=self.auth)
        shape = result.get_output("y").shape
        return shm.get_contents_as_numpy(self.handles[1], np.float32, shape)

    def close(self) -> None:
        self.client.unregister_system_shared_memory(self.regions[0], headers=self.auth)
        self.client.unregister_system_shared_memory(self.regions[1], headers=self.auth)
        for handle in self.handles:
            shm.destroy_shared_memory_region(handle)
        self.client.close()


def timed(calls: list[Callable[[], np.ndarray]], seconds: float, pid: int) -> Round:
    """Every call in its own thread, in a closed loop, for ``seconds``."""
    counts = [0] * len(calls)
    stop = time.monotonic() + seconds

    def loop(index: int) -> None:
        while time.monotonic() < stop:
            calls[index]()
            counts[index] += 1

    cpu = bms.cpu_seconds(pid) or 0.0
    started = time.monotonic()
    threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    done = sum(counts)
    cpu_ms = ((bms.cpu_seconds(pid) or 0.0) - cpu) * 1000 / max(done, 1)
    return Round(done / elapsed, cpu_ms)


def _ticks() -> dict[int, tuple[str, int]]:
    """pid -> (command, utime + stime) of every process now."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            head, tail = stat.read_text().rsplit(")", 1)
        except OSError:
            continue  # gone meanwhile
        fields = tail.split()
        found[int(stat.parent.name)] = (head.split("(", 1)[1], int(fields[11]) + int(fields[12]))
    return found


def others(before: dict[int, tuple[str, int]], seconds: float, mine: set[int]) -> str:
    """The load average, and the busiest processes other than ``mine`` since ``before``."""
    after = _ticks()
    hz = os.sysconf("SC_CLK_TCK")
    busy = sorted(
        ((after[p][1] - before[p][1]) / hz / seconds * 100, p, after[p][0])
        for p in after
        if p in before and p not in mine
    )[::-1][:5]
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    top = "; ".join(f"{command} (pid {pid}) {cpu:.0f}%" for cpu, pid, command in busy if cpu)
    return f"load average {load}; other processes over {seconds:.0f} s: {top or 'none'}"


def summary(name: str, rounds: list[Round]) -> float:
    qps = [r.qps for r in rounds]
    median = statistics.median(qps)
    print(
        f"{name:>15}: median {median:8.1f} QPS (min {min(qps):.1f}, max {max(qps):.1f}), "
        f"server CPU {statistics.median(r.cpu_ms for r in rounds):.2f} ms/request"
    )
    return median


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per mode and round")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds per mode, untimed")
    parser.add_argument("--clients", type=int, default=1, help="closed-loop clients")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="infermesh-bench-shm-"))
    write_model(build_identity_model("FP32", [-1, ELEMENTS]), workdir / MODEL / "1/model.onnx")
    secret = uuid.uuid4().hex
    (workdir / "operator.key").write_text(secret)
    restrict = f"shared-memory:{HEADER}=@{workdir / 'operator.key'}"
    cmd = [sys.executable, "-m", "model_server", "--model-repository", str(workdir)]
    cmd += ["--host", bms.HOST, "--port", "0", "--metrics-port", "0", "--http-port", "-1"]
    cmd += ["--restricted-api", restrict]
    spec = bms.ServerSpec("ours", cmd, bms.LISTEN_RE, bms.READY_RE)
    sample = _ticks()
    time.sleep(1.0)
    print(f"before: {others(sample, 1.0, {os.getpid()})}")
    data = np.random.default_rng(0).random((1, ELEMENTS), dtype=np.float32)
    results: dict[str, list[Round]] = {MESSAGE: [], SHARED: []}
    with bms.start_server(spec, workdir / "server.log") as (pid, port, _):
        url = f"{bms.HOST}:{port}"
        clients = [Client(url, {HEADER: secret}, data) for _ in range(args.clients)]
        modes = {
            MESSAGE: [c.in_message for c in clients],
            SHARED: [c.in_shared_memory for c in clients],
        }
        try:
            for name, calls in modes.items():
                assert np.array_equal(calls[0](), data), f"{name}: wrong answer"
                timed(calls, args.warmup, pid)
            sample, started = _ticks(), time.monotonic()
            for index in range(args.rounds):
                order = list(modes) if index % 2 == 0 else list(reversed(modes))
                for name in order:
                    results[name].append(timed(modes[name], args.duration, pid))
                print(
                    f"round {index + 1}: "
                    + ", ".join(f"{n} {results[n][-1].qps:.1f} QPS" for n in modes)
                )
            elapsed = time.monotonic() - started
            print(f"during the rounds: {others(sample, elapsed, {os.getpid(), pid})}")
        finally:
            for client in clients:
                client.close()
    print(f"4 MiB FP32 identity, {args.clients} client(s), {args.rounds} rounds x "
          f"{args.duration:g} s per mode")  # fmt: skip
    in_message = summary(MESSAGE, results[MESSAGE])
    shared = summary(SHARED, results[SHARED])
    per_round = [s.qps / m.qps for m, s in zip(results[MESSAGE], results[SHARED], strict=True)]
    print(
        f"ratio shared/message of the medians: {shared / in_message:.2f}x "
        f"(per round: {', '.join(f'{r:.2f}' for r in per_round)})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
