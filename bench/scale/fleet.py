"""Synthetic model-server endpoints for the scale harness: one gRPC port per endpoint.

Each endpoint answers what the control plane's placement poller asks (KServe v2 ServerReady
and RepositoryIndex(ready=true)), plus ServerLive, ModelReady and grpc.health.v1 Check (what
Envoy's active health checks call). Endpoint i serves model ``m{i % models}``, version 1,
READY. Handlers take and return raw bytes (pre-serialized answers), so the fleet's own cost per
RPC is gRPC's, not protobuf's. One grpc.aio server per model (the answer to RepositoryIndex
names the model, and a handler cannot tell which of its server's ports was called), each with
one ``add_insecure_port`` per endpoint of that model.

    python bench/scale/fleet.py --first 0 --count 2000 --models 100 --out fleet-0.json

Writes ``--out`` (JSON: pid, endpoints as [index, "127.0.0.1:PORT", model]) once every port
answers, and ``--stats`` (JSON: RPC counts by method, rewritten every second) until SIGTERM.
The fd limit is per process: keep ``--count`` so that listening sockets plus the poller's and
the Envoys' connections stay under ``ulimit -n``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from tritonclient.grpc import service_pb2

HOST = "127.0.0.1"
TRUE = b"\x08\x01"  # field 1 (bool / enum) = 1: ready, live, SERVING
INFERENCE = "inference.GRPCInferenceService"
HEALTH = "grpc.health.v1.Health"

Handler = Callable[[bytes, Any], Awaitable[bytes]]


def repository_index(model: str) -> bytes:
    response = service_pb2.RepositoryIndexResponse()
    response.models.add(name=model, version="1", state="READY")
    return bytes(response.SerializeToString())


def answer(counts: Counter[str], method: str, data: bytes) -> Handler:
    async def handle(request: bytes, context: Any) -> bytes:
        counts[method] += 1
        return data

    return handle


def handlers(model: str, counts: Counter[str]) -> list[grpc.GenericRpcHandler]:
    def unary(method: str, data: bytes) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(answer(counts, method, data))

    inference = {
        "ServerReady": unary("ServerReady", TRUE),
        "ServerLive": unary("ServerLive", TRUE),
        "ModelReady": unary("ModelReady", TRUE),
        "RepositoryIndex": unary("RepositoryIndex", repository_index(model)),
    }
    health = {"Check": unary("HealthCheck", TRUE)}
    return [
        grpc.method_handlers_generic_handler(INFERENCE, inference),
        grpc.method_handlers_generic_handler(HEALTH, health),
    ]


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)  # readers never see half a file


async def serve(args: argparse.Namespace) -> None:
    counts: Counter[str] = Counter()
    by_model: dict[str, list[int]] = {}
    for i in range(args.first, args.first + args.count):
        by_model.setdefault(f"m{i % args.models}", []).append(i)
    servers: list[grpc.aio.Server] = []
    endpoints: list[tuple[int, str, str]] = []
    options = [("grpc.so_reuseport", 0), ("grpc.max_concurrent_streams", 1000)]
    for model, indexes in sorted(by_model.items()):
        server = grpc.aio.server(options=options)
        server.add_generic_rpc_handlers(handlers(model, counts))
        for i in indexes:
            port = server.add_insecure_port(f"{HOST}:0")
            if port == 0:
                raise SystemExit(f"fleet: could not bind a port for endpoint {i}")
            endpoints.append((i, f"{HOST}:{port}", model))
        await server.start()
        servers.append(server)
    endpoints.sort()
    write_json(args.out, {"pid": os.getpid(), "endpoints": endpoints})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    started = time.time()
    while not stop.is_set():
        if args.stats is not None:
            write_json(args.stats, {"at": time.time(), "since": started, "counts": dict(counts)})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
    await asyncio.gather(*(s.stop(0) for s in servers))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--first", type=int, default=0, help="index of the first endpoint")
    p.add_argument("--count", type=int, required=True, help="endpoints in this process")
    p.add_argument("--models", type=int, default=100, help="endpoint i serves m{i %% models}")
    p.add_argument("--out", type=Path, required=True, help="JSON of the bound endpoints")
    p.add_argument("--stats", type=Path, default=None, help="JSON of RPC counts, every 1 s")
    asyncio.run(serve(p.parse_args()))


if __name__ == "__main__":
    main()
