"""Naive reference server: grpc.aio + onnxruntime in a thread, no batching, no checks.

The naive baseline the peer servers were also measured against (grpc.aio + onnxruntime in a
thread): only
ModelInfer, raw tensors in and out, no validation, metrics or statistics. It bounds what a
Python gRPC front end costs per request; bench_model_server.py --baseline runs it side by side
with the model server.

    .venv/bin/python bench/naive_server.py --model models/classifier/2/model.onnx --port 0
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
    def __init__(self, model: str) -> None:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = 1
        self.session = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
        self.executor = ThreadPoolExecutor(max_workers=1)

    async def ModelInfer(
        self, request: service_pb2.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ModelInferResponse:
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


async def serve(model: str, port: int) -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(NaiveService(model), server)
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
    args = p.parse_args()
    event_loop.run(serve(args.model, args.port), args.event_loop)


if __name__ == "__main__":
    main()
