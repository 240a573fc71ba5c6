"""A real Triton server (PyTriton's ``tritonserver``) as a mesh member serving the demo model.

Run from PyTriton's own virtualenv (``tools/install_triton.sh``; its dependencies conflict
with InferMesh's ``.venv``)::

    .venv-triton/bin/python tests/triton_member.py --models /tmp/tm-models \\
        --grpc-port 18001 --http-port 18000 --metrics-port 18002 --fault-port 18003

It serves ``<models>/<model>/<version>/model.onnx`` under our model server's name and version
(``classifier`` v1 by default): a Python function bound through PyTriton runs onnxruntime (one
intra-op thread) behind Triton's dynamic batcher (batches up to 32). Ready when ServerReady is
true (gRPC) or GET /v2/health/ready answers 200; RepositoryIndex then lists the version READY.

Why things are done as they are:

* ``LD_LIBRARY_PATH``: Triton's Python backend stub links ``libpython3.11.so.1.0`` by name and
  the loader finds the system one (Debian's 3.11.2) while the stub imports this interpreter's
  standard library (e.g. pyenv's 3.11.7): model load fails with ``'_thread.RLock' object has no
  attribute '_recursion_count'``. This interpreter's LIBDIR goes first in ``os.environ`` before
  tritonserver starts; PyTriton passes its environment on to tritonserver and so to the stub.
* Readiness: PyTriton's default starts tritonserver with an empty repository and loads the
  model afterwards, so ServerReady turns true ~2 s before the model. With a local model store
  the model loads at startup and strict readiness holds ServerReady back until it is READY. A
  request in the ~1 s before PyTriton has connected its proxy waits; it does not fail.
* Ports bind 127.0.0.1 only (Triton's default is 0.0.0.0 with 8000 HTTP, 8001 gRPC, 8002
  metrics). PyTriton's access token on the repository/statistics APIs is off, since the control
  plane calls RepositoryIndex without one (``--protect-admin-apis`` keeps it and logs it).
* Metrics: Triton's Prometheus counters plus latency summaries (p50/p90/p99), CPU metrics.
* Faults: ``--fault-port`` serves ``POST /faults`` with ``{"latency_ms": n}`` or
  ``{"reset": true}`` and ``GET /faults``, like our model server's admin port. The delay is
  slept in the model function, i.e. once per batch by the one model instance: under load it
  also throttles throughput and queueing adds to it, unlike our server's per-request sleep.
* Startup runs in a thread watched from the main one: Triton.run() would wait out PyTriton's
  120 s timeout if tritonserver died (a port in use), and ignore signals meanwhile. That thread
  stays parked for good: tritonserver gets SIGTERM (PR_SET_PDEATHSIG) when it ends.
* SIGTERM/SIGINT stop tritonserver (PyTriton sends SIGINT and waits, ~4-5 s) and exit 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

log = logging.getLogger("triton_member")
HOST = "127.0.0.1"


class FaultState:
    """The injected latency, changed by the fault endpoint and read by the model function."""

    def __init__(self) -> None:
        self.latency_ms = 0.0

    def as_dict(self) -> dict[str, float]:
        return {"latency_ms": self.latency_ms}

    def apply(self, body: object) -> dict[str, float]:
        """Applies a POST /faults body; raises ValueError saying what is wrong."""
        if not isinstance(body, dict) or not set(body) <= {"latency_ms", "reset"}:
            raise ValueError('expected a JSON object with "latency_ms" and/or "reset"')
        reset = body.get("reset", False)
        if not isinstance(reset, bool):
            raise ValueError(f"reset: expected true or false, got {reset!r}")
        latency = body.get("latency_ms", 0.0 if reset else self.latency_ms)
        if isinstance(latency, bool) or not isinstance(latency, int | float) or not latency >= 0:
            raise ValueError(f"latency_ms: expected a number >= 0, got {latency!r}")
        if math.isinf(latency):
            raise ValueError("latency_ms: expected a finite number")
        self.latency_ms = float(latency)
        log.warning("faults now %s", self.as_dict())
        return self.as_dict()


class FaultHandler(BaseHTTPRequestHandler):
    """GET /faults answers the faults in force; POST /faults changes them (JSON both ways)."""

    server: FaultServer

    def do_GET(self) -> None:
        self._answer(self.server.faults.as_dict)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._answer(lambda: self.server.faults.apply(json.loads(body or b"{}")))

    def _answer(self, action: Callable[[], object]) -> None:
        reply: object = {"error": f"no such path {self.path}"}
        status = 404
        if self.path == "/faults":
            try:
                status, reply = 200, action()
            except ValueError as exc:  # json.JSONDecodeError is a ValueError too
                status, reply = 400, {"error": str(exc)}
        data = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("fault endpoint: " + format, *args)


class FaultServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, faults: FaultState) -> None:
        super().__init__((HOST, port), FaultHandler)
        self.faults = faults


def fix_libpython_path() -> None:
    """Puts this interpreter's libpython first for the Python backend stub (see the docstring)."""
    libdir = sysconfig.get_config_var("LIBDIR")
    if not libdir or not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return  # a static interpreter: nothing better to offer than the loader's choice
    paths = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    if paths[:1] != [libdir]:
        os.environ["LD_LIBRARY_PATH"] = ":".join([libdir, *(p for p in paths if p != libdir)])


def _run(triton: Any, done: threading.Event, failure: list[BaseException]) -> None:
    """Starts tritonserver and loads the model (PyTriton's Triton.run), recording a failure.

    The thread then stays parked: tritonserver runs with PR_SET_PDEATHSIG=SIGTERM, which fires
    when the thread that started it ends, not the process.
    """
    try:
        triton.run()
    except BaseException as exc:  # reported by main()
        failure.append(exc)
    done.set()
    threading.Event().wait()


def _descendants() -> list[tuple[int, str]]:
    """(pid, name) of the live processes below this one, parents first (from /proc; Linux).

    PyTriton's own liveness check (``sh``) blocks while its exit handler waits for the lock
    that Triton.run() holds, so tritonserver is watched here instead.
    """
    parents: dict[int, tuple[int, str]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # exited meanwhile
        state, ppid = text[text.rindex(")") + 2 :].split()[:2]
        if state != "Z":
            parents[int(stat.parent.name)] = (
                int(ppid),
                text[text.index("(") + 1 : text.rindex(")")],
            )
    found: list[tuple[int, str]] = []
    frontier = {os.getpid()}
    while frontier:
        kids = [(pid, name) for pid, (ppid, name) in parents.items() if ppid in frontier]
        found += kids
        frontier = {pid for pid, _ in kids}
    return found


def _abandon(workspace: Any, code: int) -> NoReturn:
    """Ends a start that has not finished and exits; Triton.stop() cannot be used here.

    Triton.run() holds PyTriton's lock until the model is ready or its 120 s timeout passes,
    and Triton.stop() (ours, its atexit hook, its tritonserver exit handler) waits for that
    lock. So the processes below this one are killed (the Python stub outlives a killed
    tritonserver), its shared memory and the workspace removed, and os._exit skips the hooks.
    """
    for pid, _name in _descendants():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for region in Path("/dev/shm").glob(f"pytrtion{os.getpid()}-*"):  # PyTriton's spelling
        region.unlink(missing_ok=True)
    workspace.clean()
    log.info("start abandoned")
    logging.shutdown()
    os._exit(code)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--models", type=Path, required=True, help="Triton-layout repository")
    parser.add_argument("--model", default="classifier", help="model name (default classifier)")
    parser.add_argument("--version", type=int, default=1, help="model version (default 1)")
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--fault-port", type=int, default=0, help="fault endpoint (0: off)")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--batch-delay-us", type=int, default=1000, help="dynamic batcher delay")
    parser.add_argument("--startup-timeout", type=float, default=60.0, help="seconds")
    parser.add_argument("--protect-admin-apis", action="store_true", help="PyTriton's token")
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    model_path = args.models / args.model / str(args.version) / "model.onnx"
    if not model_path.is_file():
        log.error("no model file %s", model_path)
        return 2
    fix_libpython_path()

    import onnxruntime as ort
    from pytriton.decorators import batch  # type: ignore[import-not-found]
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor  # type: ignore[import-not-found]
    from pytriton.triton import (  # type: ignore[import-not-found]
        Triton,
        TritonConfig,
        TritonLifecyclePolicy,
        TritonSecurityConfig,
    )
    from pytriton.utils.workspace import Workspace  # type: ignore[import-not-found]

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    faults = FaultState()

    def infer(**inputs: np.ndarray) -> dict[str, np.ndarray]:
        if faults.latency_ms > 0:
            time.sleep(faults.latency_ms / 1000.0)
        (probs,) = session.run(["probs"], {"input": inputs["input"]})
        return {"probs": probs}

    config = TritonConfig(
        http_address=HOST,
        http_port=args.http_port,
        grpc_address=HOST,
        grpc_port=args.grpc_port,
        allow_metrics=True,
        allow_gpu_metrics=False,
        allow_cpu_metrics=True,
        metrics_address=HOST,
        metrics_port=args.metrics_port,
        metrics_config=["summary_latencies=true", "summary_quantiles=0.5:0.05,0.9:0.01,0.99:0.001"],
        exit_timeout_secs=5,
    )
    security = TritonSecurityConfig(restricted_endpoints=None if args.protect_admin_apis else [])
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, _frame: stop.set())

    fault_server = FaultServer(args.fault_port, faults) if args.fault_port else None
    if fault_server is not None:
        threading.Thread(target=fault_server.serve_forever, name="faults", daemon=True).start()
        log.info("fault endpoint on http://%s:%d/faults", HOST, args.fault_port)

    endpoints = (
        f"{args.model} v{args.version} on {HOST}: gRPC {args.grpc_port}, "
        f"HTTP {args.http_port}, metrics {args.metrics_port}"
    )
    started = time.monotonic()
    # A local model store writes the model into the repository before tritonserver starts, so
    # it loads at startup and ServerReady (strict readiness) waits for it (see the docstring).
    policy = TritonLifecyclePolicy(launch_triton_on_startup=True, local_model_store=True)
    workspace = Workspace(None)  # ours, so that _abandon can remove it
    triton = Triton(
        config=config, workspace=workspace, security_config=security, triton_lifecycle_policy=policy
    )
    done = threading.Event()
    try:
        triton.bind(
            model_name=args.model,
            model_version=args.version,
            infer_func=batch(infer),
            inputs=[Tensor(name="input", dtype=np.float32, shape=(3, 32, 32))],
            outputs=[Tensor(name="probs", dtype=np.float32, shape=(10,))],
            config=ModelConfig(
                max_batch_size=args.max_batch_size,
                batcher=DynamicBatcher(max_queue_delay_microseconds=args.batch_delay_us),
            ),
            strict=True,
        )
        # run() blocks until tritonserver and the model are ready, and if tritonserver dies
        # while starting (a port in use) it waits out PyTriton's 120 s timeout; so it runs in a
        # thread and this one watches the tritonserver process, the deadline and the signals.
        failure: list[BaseException] = []
        threading.Thread(target=_run, args=(triton, done, failure), daemon=True).start()
        deadline = started + args.startup_timeout
        seen_alive = ready = False
        while not stop.wait(0.25):
            if failure:
                log.error("startup failed: %r", failure[0])
                return 1
            if ready:  # Triton.is_alive() is safe once run() has returned
                if not triton.is_alive():
                    log.error("tritonserver or the model proxy died; the log is above")
                    return 1
                continue
            if any(name == "tritonserver" for _pid, name in _descendants()):
                seen_alive = True
            elif seen_alive:
                log.error("tritonserver exited; its log is above")
                return 1
            if done.is_set():
                ready = True
                log.info("ready in %.1f s: %s", time.monotonic() - started, endpoints)
                if args.protect_admin_apis:
                    log.info("admin API token: %s", triton.get_access_token())
            elif time.monotonic() > deadline:
                log.error("not ready after %.1f s", args.startup_timeout)
                return 1
        log.info("signal received, stopping")
        return 0
    finally:
        stopping = time.monotonic()
        if fault_server is not None:
            fault_server.shutdown()
            fault_server.server_close()
        if not done.is_set():
            _abandon(workspace, code=0 if stop.is_set() else 1)
        triton.stop()
        log.info("stopped in %.1f s", time.monotonic() - stopping)


if __name__ == "__main__":
    sys.exit(main())
