"""Telemetry shards: the OTLP receiver and its store in N processes sharing the telemetry port.

At fleet scale decoding, storing and windowing the model servers' exports is most of the
control plane's CPU (at 10,000 endpoints reporting every second: ~1.3 s to decode, ~0.8 s to
store and ~1.5 s to window, per second), more than one process has. With
``telemetry.shards: N`` each of N spawned processes binds the telemetry port with
SO_REUSEPORT, so the kernel spreads the exporters' connections over them; a shard keeps the
``TelemetryStore`` of the endpoints that export to it (one server exports on one connection)
and, every ``PUSH_INTERVAL_S``, sends the control plane the telemetry of the endpoints that
reported since its last push, windowed as each report was stored (with when: the control plane
ages it from then): the control plane's own process keeps only a dict of the newest
``EndpointTelemetry`` per endpoint. Envoy's stat-sink resources, placement
hints and the receiver's counts travel with the push; canary statistics are asked for
(``version_series``) and merged here.

What does not cost the control plane's process: an endpoint whose telemetry has not moved
beyond ``telemetry.push_tolerance`` since it was last sent goes as a "touch" (its name only,
``telemetry_moved``); Envoy's reports are cut down to the stats ``EnvoyStats`` reads; and the
shards run ``telemetry.shard_nice`` nicer, so on a host short of CPU the control plane's
decisions come first.

A server that reconnects may land on another shard: its counters start a new window there
(one report's rate spans its uptime, as after a control-plane restart) and the newest push
wins. A shard that dies is logged, counted (``telemetry_shard_restarts_total``) and started
again on the same port; its exporters reconnect to the live shards meanwhile.

Why it is one module of this length: the shard process and the control plane's side speak one
private protocol over pipes; keeping both ends in one module keeps that protocol in one place.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from contextlib import suppress
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.metrics.v1 import metrics_pb2

from control_plane.gc_tuning import tune_gc
from control_plane.model.mesh import NO_PODS, ServerPods
from control_plane.telemetry.envoy import used_stats
from control_plane.telemetry.moved import split_moved
from control_plane.telemetry.receiver import start_receiver
from control_plane.telemetry.series import VersionSeries
from control_plane.telemetry.store import TelemetryStore
from control_plane.telemetry.values import EndpointTelemetry, IngestResult, read_computed
from control_plane.xds import upstream_tls

if TYPE_CHECKING:
    from control_plane.config.topology import TelemetryOptions
    from control_plane.metrics import ControlPlaneMetrics
    from control_plane.telemetry.envoy import EnvoyStats

log = logging.getLogger(__name__)

PUSH_INTERVAL_S = 0.1  # a shard pushes this often, or as fast as its windows allow
READY_TIMEOUT_S = 60.0  # a spawned shard imports grpc and protobuf: seconds on a busy host
REPLY_TIMEOUT_S = 10.0
RESTART_DELAY_S = 1.0
MAX_TIMINGS = 1000  # ingest durations per push, for telemetry_ingest_seconds


@dataclass(frozen=True)
class Push:
    """What a shard sends every ``PUSH_INTERVAL_S``."""

    at: float  # the shard's time.monotonic() (one clock for every process of the host)
    # reported and moved since the last push: (when it was read, the telemetry as read then)
    telemetry: dict[str, tuple[float, EndpointTelemetry]]
    touched: tuple[str, ...]  # reported, not moved (telemetry_moved): still as last sent
    moved: bool  # some endpoint is new or moved (not only refreshed): routing should look now
    forgotten: frozenset[str]
    hints: frozenset[str]  # see TelemetryStore.take_placement_hints
    envoy: tuple[tuple[float, bytes], ...]  # (arrival, Envoy's resources as an export request)
    points: int
    ignored: dict[str, int]
    timings: tuple[float, ...]
    delay: float = 0.0  # the oldest report in it: from its arrival at the shard to the push
    rejected: dict[str, int] = field(default_factory=dict)  # telemetry.tls refusals by reason

    @property
    def taken(self) -> int:
        """The points the shard took in since its last push, used or not."""
        return self.points + sum(self.ignored.values())


# -- the shard process -----------------------------------------------------------------------
def run_shard(
    options: TelemetryOptions,
    host: str,
    port: int,
    conn: Connection,
    pki: tuple[str, str] | None = None,
) -> None:
    """A shard process's entry point (spawned): serves until the control plane says stop or
    its end of ``conn`` closes (the control plane is gone). ``pki``: (directory, control
    plane name) with ``telemetry.tls``: the shard reads the certificates itself and again
    when they change."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the parent stops us
    os.nice(options.shard_nice)  # see TelemetryOptions.shard_nice
    logging.basicConfig(level=logging.INFO, format="%(asctime)s shard %(message)s")
    tune_gc()
    watch = upstream_tls.PkiWatch(*pki) if pki is not None else None
    asyncio.run(_Shard(options, conn, watch).serve(host, port))


class _Shard:
    def __init__(
        self, options: TelemetryOptions, conn: Connection, pki: upstream_tls.PkiWatch | None
    ) -> None:
        self.pki = pki
        self.pods = NO_PODS  # the control plane's, sent on each change (ServerPods)
        self._rejected: Counter[str] = Counter()
        self.store = TelemetryStore(
            options.window_s,
            options.stale_after_intervals,
            options.forget_after_s,
            track_changes=True,
        )
        self.conn = conn
        self._send_lock = threading.Lock()
        self._envoy: list[tuple[float, bytes]] = []
        self._envoy_lock = threading.Lock()
        self._points = 0
        self._ignored: Counter[str] = Counter()
        self._timings: list[float] = []
        self._stop = asyncio.Event()
        self.push_tolerance = options.push_tolerance
        self._sent: dict[str, tuple[float, EndpointTelemetry]] = {}  # see split_moved
        self._resend: set[str] = set()
        self._resend_lock = threading.Lock()

    def _refused(self, reason: str) -> None:
        """A report telemetry.tls refused: counted by the control plane with the next push."""
        self._rejected[reason] += 1

    def ingest(self, resources: Iterable[metrics_pb2.ResourceMetrics], now: float) -> int:
        """The receiver's Envoy sink: what the control plane reads of it is forwarded with the
        next push (the control plane counts what it uses)."""
        blob = used_stats(resources)
        with self._envoy_lock:
            self._envoy.append((now, blob))
        return 0

    def tally(self, result: IngestResult | None, ignored: dict[str, int], seconds: float) -> None:
        self._points += result.points if result else 0
        self._ignored.update(ignored)
        if len(self._timings) < MAX_TIMINGS:
            self._timings.append(seconds)

    def send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            self.conn.send(message)

    async def serve(self, host: str, port: int) -> None:
        try:
            server, bound = await start_receiver(
                self.store, None, host, port, envoy=self, tally=self.tally, reuse_port=True,
                tls=self.pki.current if self.pki is not None else None,
                on_refused=self._refused, pods=lambda: self.pods,
            )  # fmt: skip
        except Exception as exc:  # told to the control plane, which fails to start
            self.send(("failed", f"cannot bind {host}:{port}: {exc}"))
            return
        self.send(("ready", bound))
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._commands, args=(loop,), daemon=True).start()
        try:
            # Pushes start every PUSH_INTERVAL_S, or right after the last one when it took
            # longer: a fixed wait after each made a loaded shard's cycle the wait plus the
            # windows' time (0.3-0.5 s at 5,000 endpoints a second on a busy host), and an
            # export waited most of a cycle before it was windowed.
            next_at = loop.time()
            while not self._stop.is_set():
                next_at = max(next_at + PUSH_INTERVAL_S, loop.time())
                with suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), next_at - loop.time())
                await self._push()
                if self.pki is not None:
                    await asyncio.to_thread(self.pki.refresh)
        finally:
            await server.stop(0.5)

    async def _push(self) -> None:
        # The counts are swapped here, on the loop the receiver counts on; the windows are
        # computed in a thread, so exports keep arriving meanwhile.
        points, ignored, timings = self._points, dict(self._ignored), tuple(self._timings)
        self._points, self._ignored, self._timings = 0, Counter(), []
        rejected, self._rejected = dict(self._rejected), Counter()
        with self._envoy_lock:
            envoy, self._envoy = tuple(self._envoy), []
        try:
            await asyncio.to_thread(self._send_push, points, ignored, timings, envoy, rejected)
        except OSError:  # the control plane is gone
            self._stop.set()

    def _send_push(
        self,
        points: int,
        ignored: dict[str, int],
        timings: tuple[float, ...],
        envoy: tuple[tuple[float, bytes], ...],
        rejected: dict[str, int],
    ) -> None:
        now = time.monotonic()
        reported, forgotten = self.store.changed(now)
        with self._resend_lock:
            resend, self._resend = frozenset(self._resend), set()
        whole, touched, moved = split_moved(
            {key: t for key, (_, t) in reported.items()},
            self._sent, now, self.push_tolerance, resend,
        )  # fmt: skip
        telemetry = {key: reported[key] for key in whole}
        for key in forgotten:
            self._sent.pop(key, None)
        hints = self.store.take_placement_hints()
        if telemetry or touched or forgotten or hints or envoy or points or ignored or rejected:
            delay = max((now - at + t.age_s for at, t in reported.values()), default=0.0)
            push = Push(now, telemetry, touched, moved, frozenset(forgotten), frozenset(hints),
                        envoy, points, ignored, timings, delay, rejected)  # fmt: skip
            self.send(("push", push))

    def _commands(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            while True:
                message = self.conn.recv()
                if message[0] == "stop":
                    break
                if message[0] == "version_series":
                    _, request_id, model, since = message
                    self.send(("reply", request_id, self.store.version_series(model, since)))
                elif message[0] == "resend":
                    with self._resend_lock:
                        self._resend.update(message[1])
                elif message[0] == "pods":
                    self.pods = ServerPods(message[1])  # one reference swap: no lock
        except (EOFError, OSError):
            pass  # the control plane is gone
        finally:
            loop.call_soon_threadsafe(self._stop.set)


# -- the control plane's side ----------------------------------------------------------------
class TelemetryShards:
    """Starts the shard processes, keeps what they push, and asks them for canary series.

    ``start`` and ``stop`` block (call them in a thread); reads never wait on a shard except
    ``version_series``, which asks every shard."""

    def __init__(
        self,
        count: int,
        options: TelemetryOptions,
        envoy: EnvoyStats | None = None,
        metrics: ControlPlaneMetrics | None = None,
        on_moved: Callable[[], object] | None = None,
        pki: tuple[str, str] | None = None,
    ) -> None:
        self.count = count
        self.pki = pki  # (directory, control plane name) with telemetry.tls: each shard reads it
        self.on_moved = on_moved  # called (in a reader thread) after a push with moved telemetry
        self.options = options
        self.envoy = envoy
        self.metrics = metrics
        self.port = 0
        self.restarts = 0
        self._host = options.host
        # endpoint -> ((pushed or touched at, telemetry as read), shard, telemetry as pushed)
        self._telemetry: dict[
            str, tuple[tuple[float, EndpointTelemetry], int, EndpointTelemetry]
        ] = {}
        self._hints: set[str] = set()
        self._lock = threading.Lock()
        self._conns: list[Connection | None] = [None] * count
        self._processes: list[BaseProcess | None] = [None] * count
        self._send_locks = [threading.Lock() for _ in range(count)]
        self._replies: dict[int, Future[VersionSeries]] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._pods: dict[str, str] = {}  # ServerPods, as each shard is told

    def __len__(self) -> int:
        return len(self._telemetry)

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, port: int) -> int:
        """Starts every shard on ``port`` (0: a free one) and returns the bound port. Raises
        OSError when the port is taken or a shard cannot start."""
        if port:
            _check_free(self._host, port)
        for index in range(self.count):
            bound = self._start_one(index, port or self.port)
            self.port = port = bound
            threading.Thread(
                target=self._supervise, args=(index,), name=f"telemetry-shard-{index}", daemon=True
            ).start()
        return self.port

    def _start_one(self, index: int, port: int) -> int:
        ours, theirs = multiprocessing.Pipe()
        context = multiprocessing.get_context("spawn")
        process = context.Process(
            target=run_shard, args=(self.options, self._host, port, theirs, self.pki),
            name=f"infermesh-telemetry-shard-{index}", daemon=True,
        )  # fmt: skip
        process.start()
        theirs.close()
        if not ours.poll(READY_TIMEOUT_S):
            process.kill()
            raise OSError(f"telemetry shard {index} not ready in {READY_TIMEOUT_S:g} s")
        try:
            word, detail = ours.recv()
        except EOFError:  # it died before it said ready (poll() is true at the pipe's end too)
            process.join(5)
            raise OSError(
                f"telemetry shard {index} exited before it was ready (exit code "
                f"{process.exitcode}; its error is on the control plane's stderr)"
            ) from None
        if word != "ready":
            process.join(5)
            raise OSError(f"telemetry shard {index}: {detail}")
        self._conns[index], self._processes[index] = ours, process
        if self._pods:  # a restarted shard binds telemetry to identity as the others do
            self._tell(index, ("pods", self._pods))
        return int(detail)

    def _supervise(self, index: int) -> None:
        """Reads a shard's messages until it ends; one that dies is started again."""
        while True:
            conn = self._conns[index]
            assert conn is not None
            with suppress(EOFError, OSError):
                while True:
                    message = conn.recv()
                    try:
                        self._receive(index, message)
                    except Exception:  # a bug must not end the reader: the shard goes on
                        log.exception("telemetry shard %d: a message not taken", index)
            if self._stopping:
                return
            process = self._processes[index]
            code = process.exitcode if process is not None else None
            log.error("telemetry shard %d ended (exit code %s); starting it again", index, code)
            self.restarts += 1
            if self.metrics is not None:
                self.metrics.telemetry_shard_restarts.inc()
            while not self._stopping:
                time.sleep(RESTART_DELAY_S)
                try:
                    self._start_one(index, self.port)
                    break
                except Exception as exc:  # whatever it is, try again: never end this thread
                    log.error("telemetry shard %d did not start again: %s", index, exc)
            if self._stopping:
                return

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        for index, conn in enumerate(self._conns):
            with suppress(OSError), self._send_locks[index]:
                if conn is not None:
                    conn.send(("stop",))
        deadline = time.monotonic() + timeout
        for process in self._processes:
            if process is not None:
                process.join(max(0.0, deadline - time.monotonic()))
                if process.is_alive():
                    process.kill()
                    process.join(5)

    def pids(self) -> list[int]:
        return [p.pid for p in self._processes if p is not None and p.pid is not None]

    # -- what the shards send --------------------------------------------------------------------
    def _receive(self, index: int, message: tuple[Any, ...]) -> None:
        if message[0] == "push":
            self._apply(index, message[1])
        elif message[0] == "reply":
            future = self._replies.pop(message[1], None)
            if future is not None and not future.done():
                future.set_result(message[2])

    def _apply(self, index: int, push: Push) -> None:
        resend = []
        with self._lock:
            for key, (at, telemetry) in push.telemetry.items():
                self._telemetry[key] = ((at, telemetry), index, telemetry)
            for key in push.touched:
                entry = self._telemetry.get(key)
                if entry is None or entry[1] != index:  # moved between shards, or forgotten
                    resend.append(key)
                else:  # as pushed (a read may have aged the copy kept since): fresh again
                    self._telemetry[key] = ((push.at, entry[2]), index, entry[2])
            for key in push.forgotten:
                if key in self._telemetry and self._telemetry[key][1] == index:
                    del self._telemetry[key]
            self._hints |= push.hints
        if resend:
            self._ask_resend(index, resend)
        if push.moved and self.on_moved is not None:
            self.on_moved()
        used = 0
        if self.envoy is not None:
            for at, blob in push.envoy:
                resources = ExportMetricsServiceRequest.FromString(blob).resource_metrics
                used += self.envoy.ingest(resources, at)
        m = self.metrics
        if m is not None:
            m.telemetry_endpoints.set(len(self._telemetry))
            m.telemetry_points.inc(push.points + used)
            m.telemetry_shard_points.labels(str(index)).inc(push.taken)
            for reason, n in push.ignored.items():
                m.telemetry_points_ignored.labels(reason).inc(n)
            for reason, n in push.rejected.items():
                m.telemetry_reports_rejected.labels(reason).inc(n)
            for seconds in push.timings:
                m.telemetry_ingest.observe(seconds)
            if push.telemetry or push.touched:
                m.telemetry_shard_delay.observe(push.delay + time.monotonic() - push.at)
            m.telemetry_shard_endpoints.labels("whole").inc(len(push.telemetry))
            m.telemetry_shard_endpoints.labels("touched").inc(len(push.touched))

    def _ask_resend(self, index: int, keys: list[str]) -> None:
        """Asks a shard to send these endpoints whole with their next reports."""
        self._tell(index, ("resend", tuple(keys)))

    def set_pods(self, pods: ServerPods) -> None:
        """Discovery's pod of each server address, for each shard's telemetry binding
        (``otlp_identity.refusal``); blocks on the pipes (call it in a thread)."""
        self._pods = pods.as_dict()
        for index in range(self.count):
            self._tell(index, ("pods", self._pods))

    def _tell(self, index: int, message: tuple[Any, ...]) -> None:
        with suppress(OSError), self._send_locks[index]:
            conn = self._conns[index]
            if conn is not None:
                conn.send(message)

    # -- reads -----------------------------------------------------------------------------------
    def snapshot(self, now: float, ages: bool = True) -> dict[str, EndpointTelemetry]:
        """Like ``TelemetryStore.snapshot``, over what the shards pushed; an endpoint not heard
        of for ``forget_after_s`` is forgotten (its shard may have died)."""
        stale_after, forget_after = self.options.stale_after_intervals, self.options.forget_after_s
        out: dict[str, EndpointTelemetry] = {}
        with self._lock:
            for key, (cached, index, pushed) in list(self._telemetry.items()):
                at, telemetry = cached
                if telemetry.age_s + now - at > forget_after:
                    del self._telemetry[key]
                    continue
                if at > now:  # pushed after ``now`` was read: as it was pushed
                    out[key] = telemetry
                    continue
                kept, out[key] = read_computed(cached, now, ages, stale_after)
                if kept is not cached:
                    self._telemetry[key] = (kept, index, pushed)
        return out

    def take_placement_hints(self) -> set[str]:
        with self._lock:
            hints, self._hints = self._hints, set()
        return hints

    def version_series(self, model: str, since: float | None) -> list[VersionSeries]:
        """Every live shard's ``TelemetryStore.version_series`` (blocks up to REPLY_TIMEOUT_S;
        a shard that does not answer in time is left out and logged)."""
        asked: list[Future[VersionSeries]] = []
        for index, conn in enumerate(self._conns):
            request_id = next(self._ids)
            future: Future[VersionSeries] = Future()
            self._replies[request_id] = future
            try:
                with self._send_locks[index]:
                    if conn is None:
                        raise OSError("not started")
                    conn.send(("version_series", request_id, model, since))
            except OSError:
                self._replies.pop(request_id, None)
                continue
            asked.append(future)
        out = []
        for future in asked:
            try:
                out.append(future.result(REPLY_TIMEOUT_S))
            except TimeoutError:
                log.warning("a telemetry shard did not send %s's version series in time", model)
        return out


def _check_free(host: str, port: int) -> None:
    """Raises OSError when HOST:PORT is taken. The shards bind it with SO_REUSEPORT, which
    another process binding it the same way would silently share: a second control plane
    started on the port must fail instead, as it does without shards."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (connections in TIME_WAIT)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise OSError(f"telemetry port {host}:{port}: {exc.strerror}") from exc
