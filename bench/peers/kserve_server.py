# mypy: ignore-errors
"""KServe peer: the demo classifier in KServe's Python model server (v2 gRPC).

Runs in its own virtualenv (kserve, onnxruntime, numpy); started by bench/bench_peers.py.
KServe's Python server has no server-side batching; its best option measured
is an async ``predict`` that offloads onnxruntime to a one-thread executor, used here, with
the per-request latency log line off.
KServe 0.21 binds REST on 0.0.0.0 and gRPC on [::]: both are rebound to 127.0.0.1 below.
Prints ``PEER READY grpc=127.0.0.1:PORT`` once the gRPC port accepts connections; KServe
stops on SIGTERM itself.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime as ort

HOST = "127.0.0.1"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--onnx", required=True)
    p.add_argument("--grpc-port", type=int, required=True)
    p.add_argument("--rest-port", type=int, required=True)
    args = p.parse_args()
    sys.argv = sys.argv[:1]  # kserve parses sys.argv when imported
    return args


def loopback_only() -> None:
    """KServe hard-codes [::] (gRPC) and 0.0.0.0 (REST): bind both to 127.0.0.1 instead."""
    import grpc.aio._server as aio_server
    import uvicorn

    add_port = aio_server.Server.add_insecure_port
    aio_server.Server.add_insecure_port = lambda self, addr: add_port(
        self, HOST + ":" + addr.rsplit(":", 1)[1]
    )
    config_init = uvicorn.Config.__init__

    def init(self, *a, **kw):
        kw["host"] = HOST
        config_init(self, *a, **kw)

    uvicorn.Config.__init__ = init


def announce(port: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            socket.create_connection((HOST, port), timeout=1).close()
            print(f"PEER READY grpc={HOST}:{port}", flush=True)
            return
        except OSError:
            time.sleep(0.05)


def main() -> None:
    args = parse()
    loopback_only()
    import kserve
    from kserve import InferOutput, InferRequest, InferResponse

    class Classifier(kserve.Model):
        def __init__(self, name: str, path: str) -> None:
            super().__init__(name)
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = opts.inter_op_num_threads = 1
            self.sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
            self.pool = ThreadPoolExecutor(1)
            self.ready = True

        def run(self, x: np.ndarray) -> np.ndarray:
            return self.sess.run(["probs"], {"input": x})[0]

        async def predict(self, payload: InferRequest, headers=None, response_headers=None):
            x = payload.inputs[0].as_numpy()
            y = await asyncio.get_running_loop().run_in_executor(self.pool, self.run, x)
            out = InferOutput(name="probs", shape=list(y.shape), datatype="FP32")
            out.set_data_from_numpy(y, binary_data=True)
            return InferResponse(
                model_name=self.name, infer_outputs=[out], response_id=payload.id,
                use_binary_outputs=True,
            )  # fmt: skip

    model = Classifier("classifier", args.onnx)
    threading.Thread(target=announce, args=(args.grpc_port,), daemon=True).start()
    server = kserve.ModelServer(
        http_port=args.rest_port, grpc_port=args.grpc_port, workers=1,
        enable_latency_logging=False,  # default True: a log line per request
    )  # fmt: skip
    server.start([model])


if __name__ == "__main__":
    main()
