"""The model server's own request path in process: what one ModelInfer costs the event loop.

No gRPC and no load generator: ``InferenceService.infer`` with a real repository (the demo
classifier as ``bench_peers.py`` configures it: ``dynamic_batching { max_queue_delay_microseconds:
0 }``, one instance) and real ONNX Runtime, driven by C coroutines that each parse the request
from its wire bytes, call ``infer`` and serialize the answer (what grpc.aio does around a
handler), one after another. Per level: requests/s, the event-loop thread's CPU per request
(``time.thread_time``: the part that holds the GIL and bounds a process) and the process's.
On a shared host these move far less than h2load's QPS, and they isolate this code's share of
the per-request cost from grpc.aio's own (the same for every grpc.aio server).

A before/after runs the script once per source tree, alternating (``--source DIR``, e.g. a
``git worktree`` of the parent commit, goes first on ``sys.path``)::

    .venv/bin/python bench/bench_request_path.py --rounds 5
    .venv/bin/python bench/bench_request_path.py --rounds 5 --source /work/wt-perf-base
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--concurrency", default="1,64", help="comma-separated client counts")
    p.add_argument("--duration", type=float, default=3.0, help="seconds per level and round")
    p.add_argument("--rounds", type=int, default=3, help="runs per level (medians reported)")
    p.add_argument("--source", type=Path, help="import model_server from this source tree")
    p.add_argument(
        "--naive",
        action="store_true",
        help="drive bench/naive_server.py's ModelInfer instead (the floor, same file and load)",
    )
    p.add_argument(
        "--event-loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="the loop the path runs on (the server's default is uvloop where installed)",
    )
    p.add_argument("--json", action="store_true", help="one JSON line per level")
    return p.parse_args()


async def measure(concurrency: int, seconds: float, service: Any, frame: bytes) -> dict[str, float]:
    from tritonclient.grpc import service_pb2

    done = 0
    stop = False
    if hasattr(service, "infer"):
        metadata = (("te", "trailers"),)
        infer = lambda request: service.infer(request, metadata, None)  # noqa: E731
    else:  # the naive server's servicer
        infer = lambda request: service.ModelInfer(request, None)  # noqa: E731

    async def client() -> None:
        nonlocal done
        while not stop:
            request = service_pb2.ModelInferRequest.FromString(frame)
            response = await infer(request)
            response.SerializeToString()
            done += 1

    tasks = [asyncio.create_task(client()) for _ in range(concurrency)]
    await asyncio.sleep(0.5)  # warm-up
    done = 0
    thread0, process0, wall0 = time.thread_time(), time.process_time(), time.perf_counter()
    await asyncio.sleep(seconds)
    thread1, process1, wall1 = time.thread_time(), time.process_time(), time.perf_counter()
    count = done
    stop = True
    await asyncio.gather(*tasks)
    return {
        "c": concurrency,
        "qps": count / (wall1 - wall0),
        "loop_us": (thread1 - thread0) / count * 1e6,
        "process_us": (process1 - process0) / count * 1e6,
    }


async def run(args: argparse.Namespace) -> list[dict[str, float]]:
    sys.path.insert(0, str(HERE))
    import bench_model_server as bms
    import bench_peers as peers

    from model_server.core.memory import MemoryGuard, ProcessMemory
    from model_server.core.runtime import DeviceChoice
    from model_server.lifecycle.repository import ModelRepository
    from model_server.observability.metrics import ServerMetrics
    from model_server.protocol.service import InferenceService
    from model_server.scheduling.gate import ServingGate

    with tempfile.TemporaryDirectory() as tmp:
        repo = peers.write_repository(Path(tmp) / "repo", True, 0, 1)
        metrics = ServerMetrics()
        repository = ModelRepository(
            repo, DeviceChoice("cpu"), MemoryGuard(ProcessMemory(8 << 30)), metrics
        )
        await repository.load(peers.MODEL_NAME)
        gate = ServingGate(ready=lambda: True)
        service: Any = InferenceService(repository, metrics, gate, 64 << 20, lambda n, _: None)
        if args.naive:
            import naive_server

            service = naive_server.NaiveService(str(bms.latest_model(repo)))
        frame = bms.make_request(1)[1].SerializeToString()
        levels = [int(c) for c in args.concurrency.split(",")]
        out = []
        for _ in range(args.rounds):
            for c in levels:
                out.append(await measure(c, args.duration, service, frame))
        for version in repository.all_versions():
            await version.unload()
        return out


def main() -> None:
    args = parse_args()
    if args.source is not None:
        sys.path.insert(0, str(args.source.resolve()))
    import model_server

    where = Path(model_server.__file__).resolve().parent.parent
    if args.event_loop == "asyncio":  # also for a --source tree older than infermesh.event_loop
        samples = asyncio.run(run(args))
    else:
        from infermesh import event_loop  # after --source, as model_server: the tree's own

        samples = event_loop.run(run(args), args.event_loop)
    for c in sorted({int(s["c"]) for s in samples}):
        rows = [s for s in samples if s["c"] == c]
        source = ("naive" if args.naive else str(where)) + f" on {args.event_loop}"
        summary: dict[str, Any] = {"source": source, "c": c, "rounds": len(rows)}
        shown = []
        for key, unit in (("qps", "req/s"), ("loop_us", "us/req loop CPU"),
                          ("process_us", "us/req process CPU")):  # fmt: skip
            values = sorted(s[key] for s in rows)
            summary[key] = values[len(values) // 2]
            summary[f"{key}_range"] = [values[0], values[-1]]
            shown.append(f"{summary[key]:,.0f} {unit} ({values[0]:,.0f}-{values[-1]:,.0f})")
        if args.json:
            print(json.dumps(summary), flush=True)
        else:
            load = os.getloadavg()[0]
            print(f"{source} c{c}: " + ", ".join(shown) + f"; load {load:.2f}", flush=True)


if __name__ == "__main__":
    main()
