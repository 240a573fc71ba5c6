"""Helpers for tests that run real server processes on loopback ports.

Every process is started here, stopped by its own PID, and waited for with deadlines.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
# Model servers refuse loads and unloads unless started so (Triton's default, none).
EXPLICIT = ("--model-control-mode", "explicit")
LISTENING = re.compile(r"model server listening: grpc=[\d.]+:(\d+) metrics=(?:[\d.]+:(\d+)|off)")
T = TypeVar("T")


def wait_for(
    condition: Callable[[], T | None], timeout: float, what: str, interval: float = 0.05
) -> T:
    """Polls ``condition`` until it returns a truthy value; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


async def wait_for_async(condition: Callable[[], object], within_s: float, what: str) -> None:
    """``wait_for`` inside an event loop: polls without blocking it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not condition():
        if loop.time() > deadline:
            raise TimeoutError(f"timed out after {within_s}s waiting for {what}")
        await asyncio.sleep(0.01)


HTTP_PORT = re.compile(r"model server listening: .* http=[\d.]+:(\d+) ")


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    log_path: Path
    port: int = 0
    metrics_port: int = 0
    _channels: list[grpc.Channel] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def http_port(self) -> int:
        """The KServe v2 REST port, from the start-up line (``--http-port``, free with 0)."""
        match = HTTP_PORT.search(self.log())
        assert match, self.log()
        return int(match.group(1))

    def client(self) -> grpcclient.InferenceServerClient:
        return grpcclient.InferenceServerClient(self.url)

    def metrics(self) -> str:
        """One scrape of the server's Prometheus /metrics."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            return str(response.read().decode())

    def stub(self) -> service_pb2_grpc.GRPCInferenceServiceStub:
        channel = grpc.insecure_channel(self.url)
        self._channels.append(channel)
        return service_pb2_grpc.GRPCInferenceServiceStub(channel)

    def health(self, service: str = "") -> int:
        with grpc.insecure_channel(self.url) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service=service)
            return int(stub.Check(request, timeout=5).status)

    def is_ready(self) -> bool:
        try:
            return bool(self.client().is_server_ready())
        except Exception:
            return False

    def wait_ready(self, timeout: float = 60) -> None:
        wait_for(
            lambda: self.is_ready() or self._dead(), timeout, f"server ready; log:\n{self.log()}"
        )
        assert self.proc.poll() is None, f"server exited early; log:\n{self.log()}"

    def _dead(self) -> bool:
        return self.proc.poll() is not None

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.proc.send_signal(signum)

    def wait_exit(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        for channel in self._channels:
            channel.close()
        stop_process(self.proc, signal.SIGINT, 15)


def stop_process(
    proc: subprocess.Popen[bytes], signum: int, grace_s: float, kill_wait_s: float = 10
) -> None:
    """Stops a process a test started: ``signum``, up to ``grace_s`` to exit, then SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signum)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=kill_wait_s)


def start_server(
    repository: Path,
    log_dir: Path,
    *args: str,
    wait_ready: bool = True,
    timeout: float = 60,
    own_group: bool = False,
) -> ServerProcess:
    """Starts ``python -m model_server`` on a free port; waits until it listens (and is ready).
    ``own_group``: in a new session, so a signal to its process group reaches no one else."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"server-{time.monotonic_ns()}.log"
    command = [
        sys.executable, "-m", "model_server",
        "--model-repository", str(repository),
        "--port", "0", "--metrics-port", "0",
        "--drain-delay", "0.2",
        *args,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
            start_new_session=own_group,
        )  # fmt: skip
    server = ServerProcess(proc, log_path)

    def listening() -> re.Match[str] | None:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        return LISTENING.search(server.log())

    try:
        match = wait_for(listening, timeout, "the server to listen")
        server.port = int(match.group(1))
        server.metrics_port = int(match.group(2) or 0)
        if wait_ready:
            server.wait_ready(timeout)
    except BaseException:
        server.stop()
        raise
    return server


def classifier_request(
    images: np.ndarray, version: str = "", request_id: str = ""
) -> service_pb2.ModelInferRequest:
    """A raw-contents ModelInfer request for the demo classifier."""
    request = service_pb2.ModelInferRequest(
        model_name="classifier", model_version=version, id=request_id
    )
    tensor = request.inputs.add(name="input", datatype="FP32")
    tensor.shape.extend(images.shape)
    request.raw_input_contents.append(np.ascontiguousarray(images, dtype=np.float32).tobytes())
    return request


def successes(client: grpcclient.InferenceServerClient, model: str = "classifier") -> int:
    """Requests for ``model`` the server answered OK, every version (its statistics API)."""
    stats = client.get_inference_statistics(model).model_stats
    return sum(m.inference_stats.success.count for m in stats)


def infer_classifier(
    client: grpcclient.InferenceServerClient, images: np.ndarray, version: str = ""
) -> grpcclient.InferResult:
    tensor = grpcclient.InferInput("input", list(images.shape), "FP32")
    tensor.set_data_from_numpy(images.astype(np.float32))
    return client.infer("classifier", [tensor], model_version=version)


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sums the Prometheus samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


class Traffic:
    """Steady ModelInfer load from ``clients`` threads until stopped; records every outcome."""

    def __init__(
        self,
        url: str,
        clients: int,
        version: str = "",
        deadline_s: float = 60.0,
        leave_when_draining: bool = False,
        metadata: tuple[tuple[str, str], ...] = (),
        batch: int = 1,
        root_ca: bytes | None = None,
    ) -> None:
        self.url = url
        self.root_ca = root_ca  # TLS to the edge (listener.tls), trusting this CA (PEM)
        self.clients = clients
        self.version = version
        self.metadata = metadata  # request headers, e.g. (("x-sla-class", "batch"),)
        self.batch = batch  # images per request
        self.deadline_s = deadline_s  # a bound on the whole run, whatever happens
        # A client told "draining" goes elsewhere, as a client behind a balancer would.
        self.leave_when_draining = leave_when_draining
        self.ok = 0
        self.versions: dict[str, int] = {}
        self.errors: list[tuple[grpc.StatusCode, str]] = []
        # When each outcome came (time.monotonic()): OK ones with their latency in seconds,
        # failures in the order of ``errors``.
        self.latencies: list[tuple[float, float]] = []
        self.failed_at: list[float] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> Traffic:
        for index in range(self.clients):
            thread = threading.Thread(target=self._run, args=(index,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def wait_ok(self, count: int, timeout: float = 30) -> None:
        start = self.ok
        wait_for(lambda: self.ok >= start + count, timeout, f"{count} more OK responses")

    def _run(self, index: int) -> None:
        shape = (self.batch, 3, 32, 32)
        images = np.random.default_rng(index).random(shape, dtype=np.float32)
        request = classifier_request(images, version=self.version)
        ends = time.monotonic() + self.deadline_s
        opened = (
            grpc.secure_channel(self.url, grpc.ssl_channel_credentials(self.root_ca))
            if self.root_ca is not None
            else grpc.insecure_channel(self.url)
        )
        with opened as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            while not self._stop.is_set() and time.monotonic() < ends:
                sent = time.monotonic()
                try:
                    response = stub.ModelInfer(request, timeout=10, metadata=self.metadata)
                except grpc.RpcError as error:
                    with self._lock:
                        self.errors.append((error.code(), error.details() or ""))
                        self.failed_at.append(time.monotonic())
                    if error.code() == grpc.StatusCode.UNAVAILABLE:
                        if self.leave_when_draining and "draining" in (error.details() or ""):
                            return
                        time.sleep(0.01)  # a refusing server: do not spin
                    continue
                done = time.monotonic()
                with self._lock:
                    self.ok += 1
                    self.latencies.append((done, done - sent))
                    key = response.model_version
                    self.versions[key] = self.versions.get(key, 0) + 1


def post_json(url: str, body: dict[str, Any], timeout: float = 10) -> Any:
    """POSTs ``body`` as JSON; the JSON answer (an HTTP error status raises)."""
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read().decode())


def post_faults(server: ServerProcess, body: dict[str, Any]) -> None:
    """Sets a model server's injected faults (it must run with --enable-fault-injection)."""
    post_json(f"http://127.0.0.1:{server.metrics_port}/faults", body, timeout=5)


def children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with suppress(FileNotFoundError):  # a thread that ended since the listing
            found.update(int(p) for p in (task / "children").read_text().split())
    return found


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` now: its children, theirs, and so on."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        with suppress(FileNotFoundError):  # one that ended since
            new = children(todo.pop()) - found
            found |= new
            todo.extend(new)
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def infermesh(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "infermesh.cli", *args],
        cwd=cwd, capture_output=True, text=True, timeout=60, env=None,
    )  # fmt: skip


MODEL = "demo_lm"


def text_request(prompt: str, **parameters: Any) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    tensor = request.inputs.add(name="text_input", datatype="BYTES")
    tensor.shape.append(1)
    data = prompt.encode()
    request.raw_input_contents.append(len(data).to_bytes(4, "little") + data)
    for key, value in parameters.items():
        if isinstance(value, str):
            request.parameters[key].string_param = value
        elif isinstance(value, float):
            request.parameters[key].double_param = value
        else:
            request.parameters[key].int64_param = value
    return request
