"""The prepared GPU check (issue 29): one short run on a machine with an NVIDIA GPU, one table.

Checks, in order, each a row of the table (check | result | figures):

1. **CUDA provider**: onnxruntime-gpu lists ``CUDAExecutionProvider``, and a session of the demo
   classifier made with it runs on it (``session.get_providers()[0]``), with the same answer as
   the CPU provider.
2. **NVML memory moves with the model**: a real model server (``--device cuda``, explicit model
   control) is started; NVML's per-process GPU memory of that PID is read with the classifier
   loaded, after ``unload_model`` and after ``load_model`` again (stock tritonclient).
3. **Batching gain on the GPU**: rows/s of the classifier on the CUDA provider at batch 1, 16
   and 64 in this process (median of 3 rounds of 1 s each); the gain is batch 64 over batch 1.
4. **Front-end scaling**: when the model server has ``--frontends``, QPS at 1, 2 and 4 front
   ends with 64 concurrent grpc.aio callers for 3 s each; otherwise "not in this build".

Without a GPU (no NVML device, or no CUDA provider) it prints the table with what it found and
exits 2; a failed check exits 1; all passed, 0. The whole run is under 4 minutes on an H200.

    .venv/bin/python bench/gpu_check.py [--models DIR] [--skip-server]

On a lent device machine (no network there), the project's wheels travel with the working
tree (see /work/.library/device/README.md); run it as one command with a 300 s timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model_server.demo_models import MODEL_NAME, build_demo_repository

HOST = "127.0.0.1"
LISTEN_RE = re.compile(r"model server listening: grpc=[^\s]*:(\d+)")
INPUT_SHAPE = (3, 32, 32)


@dataclass
class Row:
    check: str
    result: str  # PASS, FAIL, SKIP or NO GPU
    figures: str


def model_path(models: Path) -> Path:
    latest = max(int(p.name) for p in (models / MODEL_NAME).iterdir() if p.name.isdigit())
    return models / MODEL_NAME / str(latest) / "model.onnx"


def check_provider(models: Path) -> tuple[Row, object | None]:
    import onnxruntime as ort

    available = ort.get_available_providers()
    if "CUDAExecutionProvider" not in available:
        found = f"onnxruntime {ort.__version__}: providers {available}"
        return Row("CUDA provider", "NO GPU", found), None
    path = str(model_path(models))
    cuda = ort.InferenceSession(path, providers=["CUDAExecutionProvider"])
    cpu = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).random((4, *INPUT_SHAPE), dtype=np.float32)
    name = cuda.get_inputs()[0].name
    same = np.allclose(cuda.run(None, {name: x})[0], cpu.run(None, {name: x})[0], atol=1e-3)
    active = cuda.get_providers()[0] == "CUDAExecutionProvider"
    figures = f"onnxruntime {ort.__version__}, session providers {cuda.get_providers()}, "
    figures += f"answers match the CPU's: {same}"
    return Row("CUDA provider", "PASS" if active and same else "FAIL", figures), cuda


def rows_per_s(session: object, batch: int, seconds: float = 1.0) -> float:
    run: Callable[..., object] = session.run  # type: ignore[attr-defined]
    name = session.get_inputs()[0].name  # type: ignore[attr-defined]
    x = np.random.default_rng(batch).random((batch, *INPUT_SHAPE), dtype=np.float32)
    for _ in range(5):  # warm-up: kernels picked, arena grown
        run(None, {name: x})
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        run(None, {name: x})
        done += batch
    return done / (time.perf_counter() - start)


def check_batching(session: object) -> Row:
    rates = {b: statistics.median(rows_per_s(session, b) for _ in range(3)) for b in (1, 16, 64)}
    gain = rates[64] / rates[1]
    figures = ", ".join(f"batch {b}: {r:,.0f} rows/s" for b, r in rates.items())
    return Row("batching gain (in process)", "PASS" if gain > 1 else "FAIL",
               f"{figures}; batch 64 / batch 1 = {gain:.1f}x")  # fmt: skip


def gpu_memory_of(pid: int) -> int | None:
    """NVML's GPU memory of ``pid`` in bytes, on any device (None: not listed)."""
    import pynvml

    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == pid:
                return int(proc.usedGpuMemory or 0)
    return None


def start_server(models: Path, log: Path, *flags: str) -> tuple[subprocess.Popen[bytes], int]:
    cmd = [sys.executable, "-m", "model_server", "--model-repository", str(models), "--host",
           HOST, "--port", "0", "--metrics-port", "0", "--device", "cuda",
           "--models", MODEL_NAME, *flags]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if found := LISTEN_RE.search(log.read_text(errors="replace")):
            return proc, int(found[1])
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    stop(proc)
    raise RuntimeError(f"model server did not start: {log.read_text(errors='replace')[-2000:]}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_memory(pid: int, moved: Callable[[int], bool], timeout: float = 20) -> int:
    deadline, used = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        used = gpu_memory_of(pid) or 0
        if moved(used):
            return used
        time.sleep(0.2)
    return used


def check_nvml(models: Path, workdir: Path) -> Row:
    import tritonclient.grpc as grpcclient

    proc, port = start_server(models, workdir / "server.log", "--model-control-mode", "explicit")
    try:
        client = grpcclient.InferenceServerClient(f"{HOST}:{port}")
        loaded = wait_memory(proc.pid, lambda used: used > 0)
        client.unload_model(MODEL_NAME)
        unloaded = wait_memory(proc.pid, lambda used: used < loaded)
        client.load_model(MODEL_NAME)
        again = wait_memory(proc.pid, lambda used: used > unloaded)
    finally:
        stop(proc)
    mib = 1024 * 1024
    figures = (f"server PID GPU memory: loaded {loaded / mib:.0f} MiB, unloaded "
               f"{unloaded / mib:.0f} MiB, loaded again {again / mib:.0f} MiB")  # fmt: skip
    return Row("NVML memory moves", "PASS" if loaded > unloaded < again else "FAIL", figures)


async def closed_loop_qps(port: int, callers: int, seconds: float) -> float:
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    x = np.random.default_rng(1).random((1, *INPUT_SHAPE), dtype=np.float32)
    request = service_pb2.ModelInferRequest(model_name=MODEL_NAME)
    request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    done = 0
    async with grpc.aio.insecure_channel(f"{HOST}:{port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        ends = time.monotonic() + seconds

        async def caller() -> None:
            nonlocal done
            while time.monotonic() < ends:
                await stub.ModelInfer(request, timeout=10)
                done += 1

        start = time.monotonic()
        await asyncio.gather(*(caller() for _ in range(callers)))
        return done / (time.monotonic() - start)


def check_frontends(models: Path, workdir: Path) -> Row:
    help_text = subprocess.run([sys.executable, "-m", "model_server", "--help"],
                               capture_output=True, text=True).stdout  # fmt: skip
    if "--frontends" not in help_text:
        return Row("front-end scaling", "SKIP", "the model server has no --frontends in this build")
    rates = {}
    for n in (1, 2, 4):
        proc, port = start_server(models, workdir / f"frontends{n}.log", "--frontends", str(n))
        try:
            rates[n] = asyncio.run(closed_loop_qps(port, 64, 3.0))
        finally:
            stop(proc)
    figures = ", ".join(f"{n}: {q:,.0f} QPS" for n, q in rates.items())
    return Row("front-end scaling (c64)", "PASS" if rates[4] > rates[1] else "FAIL",
               f"{figures}; 4 / 1 = {rates[4] / rates[1]:.2f}x")  # fmt: skip


def device_row() -> Row | None:
    """The GPU and driver (None: NVML finds no device)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() == 0:
            return None
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        total = pynvml.nvmlDeviceGetMemoryInfo(handle).total / 1024**3
        driver = pynvml.nvmlSystemGetDriverVersion()
        return Row("device", "PASS", f"{name}, {total:.0f} GiB, driver {driver}")
    except Exception as exc:  # no library, no driver, no device: all mean no GPU here
        return Row("device", "NO GPU", f"NVML: {type(exc).__name__}: {exc}")


def print_table(rows: list[Row], began: float) -> None:
    print(f"\n## GPU check: {time.strftime('%Y-%m-%d %H:%M:%S')}, nproc {os.cpu_count()}, "
          f"{time.monotonic() - began:.0f} s\n")  # fmt: skip
    print("| check | result | figures |\n| --- | --- | --- |")
    for row in rows:
        print(f"| {row.check} | {row.result} | {row.figures} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=Path, default=None, help="demo repository (default: temp)")
    p.add_argument("--skip-server", action="store_true", help="only the in-process checks")
    args = p.parse_args()
    began = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="infermesh-gpu-check-"))
    try:
        models: Path = args.models or workdir / "models"
        build_demo_repository(models)
        device = device_row()
        rows = [device or Row("device", "NO GPU", "NVML lists no device")]
        provider, session = check_provider(models)
        rows.append(provider)
        if rows[0].result != "PASS" or session is None:
            print_table(rows, began)
            print("\nNo GPU here: the remaining checks need one (not run).")
            return 2
        rows.append(check_batching(session))
        for check in (check_nvml, check_frontends):
            if args.skip_server:
                break
            try:
                rows.append(check(models, workdir))
            except Exception as exc:  # one failed check must not hide the others' rows
                rows.append(Row(check.__name__, "FAIL", f"{type(exc).__name__}: {exc}"))
        print_table(rows, began)
        return 0 if all(r.result in ("PASS", "SKIP") for r in rows) else 1
    finally:
        with suppress(OSError):
            shutil.rmtree(workdir)


if __name__ == "__main__":
    raise SystemExit(main())
