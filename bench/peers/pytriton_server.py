# mypy: ignore-errors
"""PyTriton peer: the demo classifier behind PyTriton's Triton server, dynamic batcher on.

Runs in its own virtualenv (nvidia-pytriton, onnxruntime, numpy); started by
bench/bench_peers.py. Binds gRPC, HTTP and metrics to 127.0.0.1, prints
``PEER READY grpc=127.0.0.1:PORT`` once the model is loaded, and stops on SIGTERM.

Workaround (measured here): the Python backend stub links the system libpython, so
LD_LIBRARY_PATH must name the running interpreter's lib folder; bench_peers.py sets it.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

import numpy as np
import onnxruntime as ort
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig


def session(path: str) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--onnx", required=True)
    p.add_argument("--grpc-port", type=int, required=True)
    p.add_argument("--rest-port", type=int, required=True)
    p.add_argument("--metrics-port", type=int, required=True)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--delay-us", type=int, default=1000)
    args = p.parse_args()
    sess = session(args.onnx)

    @batch
    def infer(input: np.ndarray) -> dict[str, np.ndarray]:  # parameter named after the tensor
        return {"probs": sess.run(["probs"], {"input": input})[0]}

    config = TritonConfig(
        grpc_address="127.0.0.1", grpc_port=args.grpc_port, http_address="127.0.0.1",
        http_port=args.rest_port, metrics_address="127.0.0.1", metrics_port=args.metrics_port,
        allow_gpu_metrics=False,
    )  # fmt: skip
    batcher = DynamicBatcher(max_queue_delay_microseconds=args.delay_us)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with Triton(config=config) as triton:
        triton.bind(
            model_name="classifier",
            model_version=2,
            infer_func=infer,
            inputs=[Tensor(name="input", dtype=np.float32, shape=(3, 32, 32))],
            outputs=[Tensor(name="probs", dtype=np.float32, shape=(10,))],
            config=ModelConfig(max_batch_size=args.max_batch, batcher=batcher),
            strict=True,
        )
        triton.run()
        print(f"PEER READY grpc=127.0.0.1:{args.grpc_port}", flush=True)
        stop.wait()
    sys.exit(0)


if __name__ == "__main__":
    main()
