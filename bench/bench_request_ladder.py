"""Where a request's time goes between grpc.aio's floor and the whole model server: a ladder.

Each rung is the model server (or, at the ends, bench/naive_server.py) with less of the request
path cut out than the rung before, so the difference between two neighbours is what that part
costs. Same model, same h2load load and the same pre-encoded request as bench_peers.py:

    floor     naive_server.py --memo: grpc.aio, protobuf and a dict lookup (bench_peers'
              grpc-floor)
    answer    our server answering every ModelInfer with one prepared response: grpc.aio with
              our server's options, services and settings
    decode    + the version lookup, the request's decoding and checks, the response's encoding
    service   + the whole service path (identity, gate, tracing, priorities, metrics,
              statistics), the scheduler answering at once
    suspend   + one suspension: the handler awaits a future the loop sets in its next step
    batcher   + the dynamic batcher, the model run at once on the loop (no worker thread), a
              no-op model
    handoff   + the worker thread: the batcher's hand-off to it and back, still a no-op model
    full      the model server as shipped (ONNX Runtime runs the model)
    naive     naive_server.py: grpc.aio and ONNX Runtime on a thread, no checks or batching

floor and naive run on uvloop, as the model server does, so every rung has the same event loop
(bench_peers.py's `naive` key, issue 29's baseline, runs on asyncio's; `naive-uvloop` matches
this one).

The cut rungs patch the server in its own process (``--serve RUNG``); they exist only to
measure. Per rung: QPS, h2load's p50, and each thread's CPU (user + system) and context
switches per request, read from /proc around the timed run. Medians over ``--rounds`` fresh
processes per rung, the rungs interleaved within a round.

    flock /tmp/infermesh-bench.lock .venv/bin/python bench/bench_request_ladder.py \\
        --concurrency 1,64 --rounds 3     # about 9 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import bench_model_server as bms  # noqa: E402
import bench_peers as bp  # noqa: E402

RUNGS = ("floor", "answer", "decode", "service", "suspend", "batcher", "handoff", "full", "naive")
CUT = RUNGS[1:7]  # the rungs served by a patched model server


# ---------------------------------------------------------------------------------------
# The patched server (--serve RUNG), in its own process
# ---------------------------------------------------------------------------------------


def patch(rung: str) -> None:
    """Cuts the request path down to ``rung`` (module attributes replaced before start-up)."""
    from tritonclient.grpc import service_pb2

    from model_server.core import runtime, validation
    from model_server.protocol import service
    from model_server.scheduling import schedulers, workers

    probs = np.random.default_rng(0).standard_normal((1, 10)).astype(np.float32)

    if rung == "answer":
        answer = service_pb2.ModelInferResponse(model_name=bp.MODEL_NAME, model_version="2")
        answer.outputs.add(name="probs", datatype="FP32", shape=[1, 10])
        answer.raw_output_contents.append(probs.tobytes())

        async def prepared_answer(self: Any, request: Any, context: Any) -> Any:
            return answer

        service.InferenceService.ModelInfer = prepared_answer  # type: ignore[method-assign]
    elif rung == "decode":

        async def decode_and_encode(self: Any, request: Any, context: Any) -> Any:
            context.invocation_metadata()
            version = self.repository.resolve(request.model_name, request.model_version)
            prepared = version.scheduler.prepare(request, self.max_request_bytes)
            spec = version.scheduler.spec
            return validation.encode_response(
                request, spec, version.version, prepared.work.outputs, [probs]
            )

        service.InferenceService.ModelInfer = decode_and_encode  # type: ignore[method-assign]
    elif rung in ("service", "suspend"):

        async def answer_at_once(self: Any, decoded: Any, ticket: Any) -> list[np.ndarray]:
            if rung == "suspend":
                loop = asyncio.get_running_loop()
                future = loop.create_future()
                loop.call_soon(future.set_result, None)
                await future
            return [np.repeat(probs, decoded.batch, axis=0)]

        schedulers.BatchingScheduler.run = answer_at_once  # type: ignore[method-assign]
    if rung in ("batcher", "handoff"):

        def no_op_model(self: Any, outputs: Any, feeds: Any) -> list[np.ndarray]:
            return [np.repeat(probs, next(iter(feeds.values())).shape[0], axis=0)]

        runtime.OnnxSession.run = no_op_model  # type: ignore[method-assign]
    if rung == "batcher":

        def run_on_the_loop(self: Any, job: Any, done: Any) -> None:
            try:
                outcome = job()
            except Exception as exc:
                outcome = exc
            self._loop.call_soon(done, outcome)

        # Loading and warm-up await Workers.run, which submits: they run on the loop too.
        workers.Workers.submit = run_on_the_loop  # type: ignore[method-assign]


def serve(rung: str, argv: list[str]) -> int:
    patch(rung)
    from model_server.cli import main

    return main(argv)


# ---------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------


def thread_counters(pid: int) -> dict[str, tuple[str, float, int]]:
    """Per thread id: (name, user + system CPU seconds, context switches)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            cpu = bms.stat_cpu_seconds(task / "stat")
            status = (task / "status").read_text().splitlines()
        except OSError:  # the thread ended
            continue
        switches = sum(int(line.split()[1]) for line in status if "ctxt_switches" in line)
        out[task.name] = (name, cpu, switches)
    return out


@contextmanager
def start(rung: str, repo: Path, model: Path, log: Path) -> Iterator[bp.Target]:
    if rung in ("floor", "naive"):
        with bp.start_naive(model, log, "uvloop", rung == "floor") as target:
            yield target
        return
    if rung not in CUT:  # full: the server as bench_peers starts it
        with bp.start_infermesh(repo, log) as target:
            yield target
        return
    spec = bp.model_server_spec(repo, rung)
    assert spec.cmd[1:3] == ["-m", "model_server"]  # its arguments follow
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", rung, "--", *spec.cmd[3:]]
    with bms.start_server(bms.ServerSpec(rung, cmd, spec.listen, spec.ready), log) as started:
        pid, port, _ = started
        yield bp.Target(port, False, pid, None)


def measure(
    rung: str, c: int, args: argparse.Namespace, work: Path, repo: Path, model: Path, exe: str
) -> dict[str, Any]:
    with start(rung, repo, model, work / f"{rung}.log") as target:
        assert target.pid is not None
        url = f"http://{bms.HOST}:{target.port}{bms.METHOD}"
        frame = work / "frame.bin"
        bms.h2load(exe, url, frame, c, args.warmup, work / "warmup.log")  # discarded
        before = thread_counters(target.pid)
        log = work / "timed.log"
        bms.h2load(exe, url, frame, c, args.duration, log)
        after = thread_counters(target.pid)
    rows = [line.split("\t") for line in log.read_text().splitlines() if line.strip()]
    latencies = sorted(int(row[2]) for row in rows if row[1] == "200")
    if len(latencies) != len(rows) or not rows:
        sys.exit(f"{rung} c{c}: {len(rows) - len(latencies)} of {len(rows)} requests failed")
    n = len(rows)
    threads: dict[str, tuple[float, float]] = {}  # name: (us of CPU, switches) per request
    for tid, (name, cpu, switches) in after.items():
        _, cpu0, switches0 = before.get(tid, (name, 0.0, 0))
        if cpu - cpu0 <= 0.02:
            continue  # idle threads (admin, metrics)
        label = "loop" if tid == str(target.pid) else name
        used, cs = threads.get(label, (0.0, 0.0))
        threads[label] = (used + (cpu - cpu0) / n * 1e6, cs + (switches - switches0) / n)
    return {"qps": n / args.duration, "p50_us": latencies[n // 2], "threads": threads}


def report(results: dict[tuple[str, int], list[dict[str, Any]]], args: argparse.Namespace) -> None:
    med = statistics.median
    for c in args.concurrency:
        print(f"\n### c{c} (medians of {args.rounds} rounds; [min-max])\n")
        print(
            "| rung | QPS | p50 us | CPU us/request: loop, all threads | step over the rung "
            "above, CPU us/request | context switches/request | threads (us/request) |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- |")
        above = None
        for rung in args.rungs:
            runs = results[(rung, c)]
            qps = [r["qps"] for r in runs]
            p50 = [r["p50_us"] for r in runs]
            loop = [r["threads"].get("loop", (0.0, 0.0))[0] for r in runs]
            total = [sum(u for u, _ in r["threads"].values()) for r in runs]
            switches = [sum(s for _, s in r["threads"].values()) for r in runs]
            names = sorted({n for r in runs for n in r["threads"]})
            per = ", ".join(
                f"{n} {med(r['threads'].get(n, (0.0, 0.0))[0] for r in runs):.0f}" for n in names
            )
            step = (
                "" if above is None or rung in ("floor", "naive") else f"{med(total) - above:+.0f}"
            )
            print(f"| {rung} | {med(qps):,.0f} [{min(qps):,.0f}-{max(qps):,.0f}] | {med(p50):.0f} "
                  f"[{min(p50)}-{max(p50)}] | {med(loop):.0f}, {med(total):.0f} | {step} | "
                  f"{med(switches):.1f} | {per} |")  # fmt: skip
            if rung not in ("floor", "naive"):
                above = med(total)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--serve", choices=CUT, help=argparse.SUPPRESS)
    p.add_argument("--rungs", default=",".join(RUNGS), help="comma-separated, in this order")
    p.add_argument("--concurrency", default="1,64", help="comma-separated h2load client counts")
    p.add_argument("--rounds", type=int, default=3, help="fresh processes per rung and level")
    p.add_argument("--duration", type=float, default=4.0, help="seconds per timed run")
    p.add_argument("--warmup", type=float, default=2.0, help="discarded seconds before each")
    args, rest = p.parse_known_args()
    if args.serve:
        return serve(args.serve, [a for a in rest if a != "--"])
    args.rungs = args.rungs.split(",")
    unknown = sorted(set(args.rungs) - set(RUNGS))
    if unknown:
        p.error(f"--rungs: unknown {unknown}; expected some of {', '.join(RUNGS)}")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    exe = bms.ensure_h2load()
    results: dict[tuple[str, int], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="ladder-") as tmp:
        work = Path(tmp)
        repo = bp.write_repository(work / "repo", True, 0, 1)
        model = sorted(repo.glob(f"{bp.MODEL_NAME}/*/model.onnx"))[-1]
        _, request = bms.make_request(1)
        payload = request.SerializeToString()
        (work / "frame.bin").write_bytes(b"\0" + len(payload).to_bytes(4, "big") + payload)
        print(f"load average at start {os.getloadavg()[0]:.2f}; nproc {os.cpu_count()}")
        for c in args.concurrency:
            for round_ in range(1, args.rounds + 1):
                for rung in args.rungs:
                    r = measure(rung, c, args, work, repo, model, exe)
                    results.setdefault((rung, c), []).append(r)
                    print(f"round {round_} c{c} {rung}: {r['qps']:,.0f} QPS, p50 "
                          f"{r['p50_us']} us", flush=True)  # fmt: skip
        print(f"load average at end {os.getloadavg()[0]:.2f}")
    report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
