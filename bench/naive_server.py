"""Naive reference server: grpc.aio + onnxruntime in a thread, no batching, no checks.

The naive baseline the peer servers were also measured against (grpc.aio + onnxruntime in a
thread): only
ModelInfer, raw tensors in and out, no validation, metrics or statistics. It bounds what a
Python gRPC front end costs per request; bench_model_server.py --baseline runs it side by side
with the model server.

    .venv/bin/python bench/naive_server.py --model models/classifier/2/model.onnx --port 0

With --memo it answers an input it has seen before from a dict of its raw bytes, without
ONNX Runtime: the only per-call work left is grpc.aio's, protobuf's and one dict lookup, so
its QPS is the ceiling of any one-process Python grpc.aio server answering this request on
this host (bench_peers.py's `grpc-floor` keys).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import onnxruntime as ort
from tritonclient.grpc import service_pb2, service_pb2_grpc

from infermesh import event_loop

HOST = "127.0.0.1"


class NaiveService(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, model: str, memo: bool = False) -> None:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = 1
        self.session = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
        self.executor = ThreadPoolExecutor(max_workers=1)
        # --memo: answers by the request's model, inputs and outputs (bounded: a benchmark
        # sends one request over and over; anything past the bound runs the model).
        self.memo: dict[bytes, service_pb2.ModelInferResponse] | None = {} if memo else None

    async def ModelInfer(
        self, request: service_pb2.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ModelInferResponse:
        if self.memo is None:
            return await self.run(request)
        key = request.SerializeToString(deterministic=True)
        if (answer := self.memo.get(key)) is None:
            answer = await self.run(request)
            if len(self.memo) < 64:
                self.memo[key] = answer
        return answer

    async def run(self, request: service_pb2.ModelInferRequest) -> service_pb2.ModelInferResponse:
        feeds = {
            t.name: np.frombuffer(raw, dtype=np.float32).reshape(tuple(t.shape))
            for t, raw in zip(request.inputs, request.raw_input_contents, strict=True)
        }
        names = [o.name for o in request.outputs] or [o.name for o in self.session.get_outputs()]
        loop = asyncio.get_running_loop()
        arrays = await loop.run_in_executor(self.executor, self.session.run, names, feeds)
        response = service_pb2.ModelInferResponse(model_name=request.model_name)
        for name, array in zip(names, arrays, strict=True):
            response.outputs.add(name=name, datatype="FP32", shape=list(array.shape))
            response.raw_output_contents.append(array.tobytes())
        return response


async def serve(model: str, port: int, memo: bool) -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(NaiveService(model, memo), server)
    bound = server.add_insecure_port(f"{HOST}:{port}")
    await server.start()
    print(f"listening on {HOST}:{bound}", flush=True)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop(0.5)


def main() -> None:
    p = argparse.ArgumentParser(description="Naive grpc.aio + onnxruntime ModelInfer server.")
    p.add_argument("--model", required=True, help="path to model.onnx")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--event-loop", choices=event_loop.CHOICES, default="asyncio",
                   help="asyncio's own (default: the naive reference) or uvloop")  # fmt: skip
    p.add_argument("--memo", action="store_true",
                   help="answer a request seen before from memory, without the model")  # fmt: skip
    args = p.parse_args()
    event_loop.run(serve(args.model, args.port, args.memo), args.event_loop)


if __name__ == "__main__":
    main()
