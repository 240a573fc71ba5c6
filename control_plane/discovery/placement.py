"""Placement probing: which models and versions are READY on which model server.

``probe_endpoint`` asks one server (KServe v2 RepositoryIndex with ready=true, and
ServerReady) over grpc.aio. ``PlacementPoller`` keeps one channel per endpoint and probes each
endpoint once per cycle, staggered over the cycle in small ticks, within a probe budget
(``max_probes_per_s``; above it the cycle stretches) and at most ``max_concurrent_probes`` in
flight; it calls ``on_change`` at most once per tick, only when the placement (reachability,
server readiness, READY (model, version) pairs) changed. ``routing.mesh_state`` builds the
mesh state from the reports.

Why it is one module of this length: the prober and the poller share the channel and probe-
budget bookkeeping; the poller's background loop and ``poll_once`` share the same probe path by
design (one place decides what changed).
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from control_plane.model.mesh import EndpointAddress, UpstreamTls
from infermesh.pki import server_name

log = logging.getLogger(__name__)

READY = "READY"
# No proxy for model servers; reconnect quickly so a restarted server is seen within a poll
# or two (gRPC's default backoff grows to two minutes).
CHANNEL_OPTIONS = (
    ("grpc.enable_http_proxy", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
TICK_S = 0.05  # the background loop probes the next slice of endpoints this often
HINT_INTERVAL_S = 0.1  # how often telemetry's hints (a model changed state) become probes

Reports = Mapping[EndpointAddress, "EndpointReport"]
Placement = tuple[bool, bool, frozenset[tuple[str, str]]]
AddressSource = Callable[[], Iterable[EndpointAddress] | Awaitable[Iterable[EndpointAddress]]]
ChangeCallback = Callable[[Reports], Awaitable[None] | None]
Metadata = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class EndpointReport:
    """What one poll of one model server found."""

    address: EndpointAddress
    reachable: bool  # at least one of the two RPCs answered
    ready_models: frozenset[tuple[str, str]] = frozenset()  # (model, version) pairs READY
    server_ready: bool = False
    error: str = ""  # why an RPC failed; "" when both answered
    # Unreachable and every call ran out of time: the network said nothing (a partition, or
    # a host gone), as opposed to a host that answered no (connection refused: no server).
    silent: bool = False

    @property
    def placement(self) -> Placement:
        """What a change is judged on: error texts vary from poll to poll and do not count."""
        return (self.reachable, self.server_ready, self.ready_models)


def grpc_target(address: EndpointAddress) -> str:
    return f"[{address.host}]:{address.port}" if ":" in address.host else address.key


def open_channel(address: EndpointAddress, tls: UpstreamTls | None = None) -> grpc.aio.Channel:
    """A channel to the server; with ``tls``, mutual TLS as the control plane's identity,
    the server checked against its own certificate name (``pki.server_name``: its address's,
    or on Kubernetes its pod's), not just its IP: a certificate for another server on the
    same host does not pass."""
    target = grpc_target(address)
    me = tls.control_plane if tls is not None else None
    if tls is None or me is None or address.key in tls.plaintext:
        return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
    credentials = grpc.ssl_channel_credentials(tls.ca_pem, me.key_pem, me.cert_pem)
    expected = server_name(address.key, tls.pods.get(address.key), tls.trust_domain)
    name = ("grpc.ssl_target_name_override", expected)
    return grpc.aio.secure_channel(target, credentials, options=(*CHANNEL_OPTIONS, name))


async def probe_endpoint(
    address: EndpointAddress,
    timeout_s: float,
    channel: grpc.aio.Channel | None = None,
    credential: Metadata = (),
    tls: UpstreamTls | None = None,
) -> EndpointReport:
    """Asks one server for its READY model versions and readiness; never raises.

    Uses ``channel`` if given (it stays open), else a channel of its own for this call.
    ``credential``: metadata for RepositoryIndex, for servers that restrict their
    model-repository API (``--restricted-api``).
    """
    own = channel is None
    chan = open_channel(address, tls) if channel is None else channel
    try:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(chan)
        index_request = service_pb2.RepositoryIndexRequest(ready=True)
        ready_request = service_pb2.ServerReadyRequest()
        (index, index_error, index_code), (ready, ready_error, ready_code) = await asyncio.gather(
            _call(
                "RepositoryIndex",
                lambda: stub.RepositoryIndex(
                    index_request, timeout=timeout_s, metadata=credential or None
                ),
            ),
            _call("ServerReady", lambda: stub.ServerReady(ready_request, timeout=timeout_s)),
        )
    finally:
        if own:
            await chan.close()
    models: frozenset[tuple[str, str]] = frozenset()
    if index is not None:
        models = frozenset(
            (m.name, m.version) for m in index.models if m.state == READY and m.version
        )
    return EndpointReport(
        address=address,
        reachable=index is not None or ready is not None,
        ready_models=models,
        server_ready=bool(ready is not None and ready.ready),
        error="; ".join(e for e in (index_error, ready_error) if e),
        silent=index is None
        and ready is None
        and index_code == ready_code == grpc.StatusCode.DEADLINE_EXCEEDED,
    )


async def _call(
    name: str, call: Callable[[], Awaitable[Any]]
) -> tuple[Any, str, grpc.StatusCode | None]:
    """(the answer, or None; the error; its status code)."""
    try:
        return await call(), "", None
    except grpc.aio.AioRpcError as exc:
        return None, f"{name}: {exc.code().name}: {exc.details()}", exc.code()
    except asyncio.CancelledError:
        # Closing a channel (new certificates: set_tls) cancels its calls in flight, which
        # raises here though nothing cancelled this task; raised on, it ended the loop that
        # awaited the probe (discovery, the topology watch), silently.
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # this probe itself was cancelled (stop, a cycle moving on)
        return None, f"{name}: CANCELLED: its channel was closed", grpc.StatusCode.CANCELLED
    except Exception as exc:  # a probe never raises; the report carries the error
        return None, f"{name}: {type(exc).__name__}: {exc}", None


class PlacementPoller:
    """Probes every endpoint once per cycle, staggered, and reports placement changes.

    ``addresses`` returns the endpoints to poll now (sync or async, e.g. a closure over
    ``EndpointResolver.resolve`` of the current topology); it is asked every tick, and a tuple
    or frozenset returned again (the same object) is taken as unchanged without a look.

    The cycle is ``effective_interval_s``: ``interval_s``, stretched to
    ``len(endpoints) / max_probes_per_s`` when probing each endpoint once per ``interval_s``
    would exceed the budget. The background loop spreads the endpoints evenly over it, in
    address order, one slice every ``TICK_S``; at most ``max_concurrent_probes`` probes are in
    flight (``poll_once`` included), and an endpoint whose probe is in flight is not probed
    again. Endpoints that joined, and those passed to ``request_probe``, are probed first, at
    the next tick. ``on_change`` (sync or async) gets every endpoint's latest report, in
    address order, after the first delivery and then at most once per tick, when some
    endpoint's placement differs from the one last delivered; if it raises, a later tick
    delivers again. Endpoints that left are dropped and their channels closed. A channel is
    kept per endpoint only while the cycle is at most ``keep_channels_up_to_s``: an open
    channel holds ~47 KiB (470 MB at 10,000 endpoints), and one probed less often reconnects.
    """

    def __init__(
        self,
        addresses: AddressSource,
        interval_s: float = 1.0,
        timeout_s: float = 1.0,
        on_change: ChangeCallback | None = None,
        *,
        max_probes_per_s: float = 100.0,
        max_concurrent_probes: int = 200,
        keep_channels_up_to_s: float = 10.0,
        unreachable_after: int = 2,
        credential: Metadata = (),
        tls: UpstreamTls | None = None,
    ) -> None:
        self.credential = credential  # sent with RepositoryIndex (never logged)
        self.tls = tls  # mutual TLS to the servers (listener.upstream_tls), None: plaintext
        self.keep_channels_up_to_s = keep_channels_up_to_s
        self.unreachable_after = unreachable_after  # failed probes in a row (see _damped)
        self._failed: dict[EndpointAddress, int] = {}  # reachable ones' failures in a row
        self.addresses = addresses
        self.on_change = on_change
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_probes_per_s = max_probes_per_s
        self.max_concurrent_probes = max_concurrent_probes
        self.probes_started = 0  # probes begun so far (both RPCs count as one)
        self._source: object = None  # what addresses() returned last
        self._members: frozenset[EndpointAddress] = frozenset()
        self._order: list[EndpointAddress] = []  # the cycle's order: address order
        self._cursor = 0  # the next endpoint of the cycle
        self._due = 0.0  # cycle probes owed (fractional)
        self._tokens = 0.0  # the probe budget's token bucket
        self._requested: dict[EndpointAddress, None] = {}  # probe first, in this order
        self._in_flight: dict[EndpointAddress, asyncio.Task[EndpointReport]] = {}
        self._fresh: dict[EndpointAddress, EndpointReport] = {}  # probed, not yet published
        self._reports: Reports = MappingProxyType({})
        # Each endpoint's last report that reached it: what routing keeps an endpoint on while
        # this control plane cannot reach it but Envoy can (routing.partitions).
        self._last_reachable: dict[EndpointAddress, EndpointReport] = {}
        self._delivered: dict[EndpointAddress, Placement] = {}
        self._differs: set[EndpointAddress] = set()  # placement now != the one delivered
        self._ever_delivered = False
        self._channels: dict[EndpointAddress, grpc.aio.Channel] = {}
        self._lock = asyncio.Lock()  # one poll_once at a time
        self._deliver_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._stretched = False
        self._failing = False  # the background loop's last tick failed (logged once)
        self._retry_at = 0.0

    @property
    def max_concurrent_probes(self) -> int:
        return self._max_concurrent

    @max_concurrent_probes.setter
    def max_concurrent_probes(self, value: int) -> None:
        self._max_concurrent = max(1, int(value))  # probes already waiting keep the old limit
        self._semaphore = asyncio.Semaphore(self._max_concurrent)

    @property
    def effective_interval_s(self) -> float:
        """The cycle: ``interval_s``, or longer where the probe budget requires."""
        return max(self.interval_s, len(self._order) / max(self.max_probes_per_s, 1e-9))

    @property
    def reports(self) -> Reports:
        """The latest report of every endpoint probed, in address order (read-only)."""
        return self._reports

    @property
    def last_reachable(self) -> Mapping[EndpointAddress, EndpointReport]:
        """Each member's last report that reached it (read-only view)."""
        return MappingProxyType(self._last_reachable)

    @property
    def open_channels(self) -> frozenset[EndpointAddress]:
        """The endpoints the poller holds a channel to."""
        return frozenset(self._channels)

    @property
    def in_flight(self) -> int:
        """Probes started or waiting for a slot and not finished yet."""
        return len(self._in_flight)

    async def start(self) -> None:
        """Starts probing in the background (the first tick right away)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="placement-poller")

    async def stop(self) -> None:
        """Stops probing and closes every channel."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])
        async with self._lock:
            probes = list(self._in_flight.values())
            for probe in probes:
                probe.cancel()
            if probes:
                await asyncio.wait(probes)
            channels, self._channels = list(self._channels.values()), {}
            await asyncio.gather(*(c.close() for c in channels))

    async def set_tls(self, tls: UpstreamTls | None) -> None:
        """New certificates (or none): the channels made with the old ones are closed, so the
        next probes handshake with these."""
        if tls == self.tls:
            return
        self.tls = tls
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close() for c in channels))

    async def follow_hints(self, take_hints: Callable[[], Iterable[str]]) -> None:
        """Every HINT_INTERVAL_S: the endpoints (``HOST:PORT``) whose telemetry says a model
        version changed state, or the server started draining, are probed at once: at fleet
        scale the cycle is long."""
        while True:
            await asyncio.sleep(HINT_INTERVAL_S)
            hints = set(take_hints())
            if hints:
                self.request_probe(a for a in self._members if a.key in hints)

    def request_probe(self, addresses: Iterable[EndpointAddress]) -> None:
        """Probes these endpoints at the next tick, ahead of the cycle (unknown ones ignored)."""
        for address in addresses:
            if address in self._members:
                self._requested[address] = None

    async def poll_once(self) -> Reports:
        """Probes every endpoint now, at most ``max_concurrent_probes`` at a time, and calls
        ``on_change`` if the placement changed (its exception propagates)."""
        async with self._lock:
            await self._refresh()
            order = list(self._order)
            for address in order:
                self._requested.pop(address, None)
            await asyncio.gather(*(self._probe(address) for address in order))
            self._publish()
            await self._deliver()
            return self._reports

    # -- the background loop ----------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        self._tokens = self._token_cap()
        while True:
            now = loop.time()
            elapsed, last = min(now - last, 1.0), now
            try:
                await self._refresh()
                for address in self._slice(elapsed):
                    self._probe(address)
                self._publish()
                if now >= self._retry_at:
                    await self._deliver()
                if self._failing:
                    log.info("placement polling recovered")
                self._failing = False
            except Exception:
                if not self._failing:
                    log.exception("placement poll failed; retrying")
                self._failing = True
                self._retry_at = now + min(self.interval_s, 1.0)
            await asyncio.sleep(TICK_S)

    def _token_cap(self) -> float:
        return max(1.0, 2 * self.max_probes_per_s * TICK_S)

    def _slice(self, elapsed: float) -> list[EndpointAddress]:
        """The endpoints to probe this tick: requested ones first, then the cycle's next."""
        self._tokens = min(self._tokens + elapsed * self.max_probes_per_s, self._token_cap())
        self._check_stretch()  # interval_s and the budget may have been set since
        n = len(self._order)
        self._due = min(self._due + elapsed * n / self.effective_interval_s, float(n))
        free = self.max_concurrent_probes - len(self._in_flight)
        chosen: dict[EndpointAddress, None] = {}
        for address in list(self._requested):
            if free < 1 or self._tokens < 1:
                break
            if address in self._in_flight:
                continue  # asked for after that probe began: probed again once it is done
            del self._requested[address]
            chosen[address] = None
            free, self._tokens = free - 1, self._tokens - 1
        while n and self._due >= 1 and free >= 1 and self._tokens >= 1:
            address = self._order[self._cursor]
            self._cursor, self._due = (self._cursor + 1) % n, self._due - 1
            if address in self._in_flight or address in chosen:
                continue  # its turn passes: a probe of it is under way
            chosen[address] = None
            free, self._tokens = free - 1, self._tokens - 1
        return list(chosen)

    # -- shared by the loop and poll_once -----------------------------------------------------
    async def _refresh(self) -> None:
        """Takes the current endpoint set: queues new endpoints, drops those that left."""
        found = self.addresses()
        if inspect.isawaitable(found):
            found = await found
        if found is self._source and isinstance(found, tuple | frozenset):
            return
        self._source = found
        members = frozenset(found)
        if members != self._members:
            self._update_members(members)
        gone = [self._channels.pop(a) for a in set(self._channels) - members]
        await asyncio.gather(*(channel.close() for channel in gone))

    def _update_members(self, members: frozenset[EndpointAddress]) -> None:
        old_order, old_members = self._order, self._members
        self._members, self._order = members, sorted(members)
        if old_order and self._order:  # the cycle goes on where it was
            at = old_order[self._cursor % len(old_order)]
            self._cursor = bisect.bisect_left(self._order, at) % len(self._order)
        else:
            self._cursor = 0
        for address in self._order:
            if address not in old_members:
                self._requested[address] = None
        for address in old_members - members:
            self._requested.pop(address, None)
            self._failed.pop(address, None)
            self._fresh.pop(address, None)
            self._last_reachable.pop(address, None)
            self._note(address)
        if any(address not in members for address in self._reports):
            reports = {a: r for a, r in self._reports.items() if a in members}
            self._reports = MappingProxyType(reports)
        self._check_stretch()

    def _check_stretch(self) -> None:
        """Logs once when the budget starts stretching the cycle (and when it stops)."""
        stretched = self.effective_interval_s > self.interval_s
        if stretched and not self._stretched:
            log.warning(
                "placement: %d endpoints at most %g probes/s: each is probed every %.1f s "
                "instead of every %g s",
                len(self._order), self.max_probes_per_s, self.effective_interval_s,
                self.interval_s,
            )  # fmt: skip
        elif self._stretched and not stretched:
            log.info("placement: each endpoint is probed every %g s again", self.interval_s)
        self._stretched = stretched

    def _probe(self, address: EndpointAddress) -> asyncio.Task[EndpointReport]:
        """The probe of this endpoint: the one in flight, else a new one."""
        task = self._in_flight.get(address)
        if task is None:
            task = asyncio.create_task(self._probe_now(address), name=f"probe {address.key}")
            self._in_flight[address] = task
            task.add_done_callback(functools.partial(self._probe_done, address))
        return task

    def _probe_done(self, address: EndpointAddress, task: asyncio.Task[EndpointReport]) -> None:
        if self._in_flight.get(address) is task:
            del self._in_flight[address]

    async def _probe_now(self, address: EndpointAddress) -> EndpointReport:
        async with self._semaphore:
            self.probes_started += 1
            keep = self.effective_interval_s <= self.keep_channels_up_to_s
            channel = self._channel(address) if keep and address in self._members else None
            if not keep and address in self._channels:  # the cycle got long: let it go
                await self._channels.pop(address).close()
            report = self._damped(
                address,
                await probe_endpoint(address, self.timeout_s, channel, self.credential, self.tls),
            )
        if address in self._members:
            self._fresh[address] = report
        return report

    def _damped(self, address: EndpointAddress, report: EndpointReport) -> EndpointReport:
        """A reachable endpoint stays as it was reported until ``unreachable_after`` probes in
        a row have failed. On a loaded fleet one probe timing out is common, and taking the
        endpoint out of its clusters and back in costs two rebuilds (at 10,000 endpoints these
        flaps were a fifth of the control plane's time). One never reached fails at once."""
        if report.reachable:
            self._failed.pop(address, None)
            return report
        last = self._fresh.get(address) or self._reports.get(address)
        failed = self._failed.get(address, 0) + 1
        if last is None or not last.reachable or failed >= self.unreachable_after:
            self._failed.pop(address, None)
            return report
        self._failed[address] = failed
        return last

    def _channel(self, address: EndpointAddress) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = open_channel(address, self.tls)
        return self._channels[address]

    def _publish(self) -> None:
        """Makes the reports probed since the last call the latest ones. Reports equal to the
        latest change nothing, and the mapping stays the same object: at 10,000 endpoints
        copying it at every tick for a few unchanged probes was a third of the process."""
        if not self._fresh:
            return
        fresh, self._fresh = self._fresh, {}
        fresh = {a: r for a, r in fresh.items() if self._reports.get(a) != r}
        if not fresh:
            return
        self._log_changes(fresh.values())
        self._last_reachable.update((a, r) for a, r in fresh.items() if r.reachable)
        if all(address in self._reports for address in fresh):
            reports = dict(self._reports)
            reports.update(fresh)  # keeps the address order
        else:
            merged = {**self._reports, **fresh}
            reports = {a: merged[a] for a in self._order if a in merged}
        self._reports = MappingProxyType(reports)
        for address in fresh:
            self._note(address)

    def _note(self, address: EndpointAddress) -> None:
        """Records whether this endpoint's placement now differs from the one delivered."""
        report = self._reports.get(address) if address in self._members else None
        now = None if report is None else report.placement
        if now == self._delivered.get(address):
            self._differs.discard(address)
        else:
            self._differs.add(address)

    async def _deliver(self) -> None:
        """Calls ``on_change`` if the placement differs from the one delivered last."""
        async with self._deliver_lock:
            if self._ever_delivered and not self._differs:
                return
            reports, differs = self._reports, set(self._differs)
            if self.on_change is not None:
                result = self.on_change(reports)
                if inspect.isawaitable(result):
                    await result
            self._ever_delivered = True
            for address in differs:
                if address in reports:
                    self._delivered[address] = reports[address].placement
                else:
                    self._delivered.pop(address, None)
                self._note(address)

    def _log_changes(self, reports: Iterable[EndpointReport]) -> None:
        for report in reports:
            before = self._reports.get(report.address)
            if before is not None and before.placement == report.placement:
                continue
            if report.reachable:
                models = ", ".join(f"{m}:{v}" for m, v in sorted(report.ready_models)) or "none"
                state = "ready" if report.server_ready else "not ready"
                log.info("endpoint %s: %s; READY: %s", report.address.key, state, models)
            else:
                log.warning("endpoint %s unreachable: %s", report.address.key, report.error)
