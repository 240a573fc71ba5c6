# mypy: ignore-errors
"""MLServer peer: the demo classifier as a custom MLModel with adaptive batching.

Runs in its own virtualenv (mlserver, onnxruntime, numpy, uvloop<0.22: with uvloop 0.22+
MLServer 1.7.1's worker dies with "There is no current event loop"); started by
bench/bench_peers.py. Its best configuration measured, plus batching:
``parallel_workers=0`` (inference in the server process), adaptive batching
(``max_batch_size`` 32, ``max_batch_time`` 1 ms by default). gRPC and REST bind 127.0.0.1,
the metrics server is off. Prints ``PEER READY grpc=127.0.0.1:PORT`` once the model is loaded
and the gRPC port accepts connections; MLServer stops on SIGTERM itself.
"""

from __future__ import annotations

import argparse
import asyncio
import socket

import numpy as np
import onnxruntime as ort
from mlserver import MLModel, MLServer
from mlserver.codecs import NumpyCodec
from mlserver.settings import ModelParameters, ModelSettings, Settings
from mlserver.types import InferenceRequest, InferenceResponse
from mlserver.utils import install_uvloop_event_loop

HOST = "127.0.0.1"
LOADED = asyncio.Event()


class OnnxClassifier(MLModel):
    async def load(self) -> bool:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = 1
        uri = self.settings.parameters.uri
        self.sess = ort.InferenceSession(uri, opts, providers=["CPUExecutionProvider"])
        LOADED.set()
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        x = NumpyCodec.decode_input(payload.inputs[0])
        y = self.sess.run(["probs"], {"input": x.astype(np.float32, copy=False)})[0]
        return InferenceResponse(
            model_name=self.name, model_version=self.version,
            outputs=[NumpyCodec.encode_output("probs", y)],
        )  # fmt: skip


async def announce(port: int) -> None:
    await LOADED.wait()
    while True:
        try:
            socket.create_connection((HOST, port), timeout=1).close()
            print(f"PEER READY grpc={HOST}:{port}", flush=True)
            return
        except OSError:
            await asyncio.sleep(0.05)


async def serve(args: argparse.Namespace) -> None:
    settings = Settings(
        host=HOST, grpc_port=args.grpc_port, http_port=args.rest_port, metrics_endpoint=None,
        parallel_workers=args.workers, load_models_at_startup=False, debug=False,
    )  # fmt: skip
    model = ModelSettings(
        name="classifier", implementation=f"{__name__}.OnnxClassifier",
        max_batch_size=args.max_batch, max_batch_time=args.batch_time_ms / 1e3,
        parameters=ModelParameters(uri=args.onnx, version="2"),
    )  # fmt: skip
    task = asyncio.create_task(announce(args.grpc_port))
    await MLServer(settings).start([model])
    task.cancel()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--onnx", required=True)
    p.add_argument("--grpc-port", type=int, required=True)
    p.add_argument("--rest-port", type=int, required=True)
    p.add_argument("--workers", type=int, default=0, help="MLServer parallel_workers")
    p.add_argument("--max-batch", type=int, default=32, help="0 or 1: no adaptive batching")
    p.add_argument("--batch-time-ms", type=float, default=1.0)
    args = p.parse_args()
    install_uvloop_event_loop()  # as the mlserver CLI does
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
