"""Scrapes the Prometheus ``/metrics`` of Triton endpoints into the ``TelemetryStore``.

One asyncio task per target ((endpoint key "HOST:PORT", metrics URL), replaceable at run time
with ``set_targets``) fetches its URL every ``interval_s`` (first fetches staggered over one
interval; one fetch in flight per target, as the task awaits it), maps the body with that
endpoint's ``TritonMapper`` and calls ``store.ingest_points`` with ``clock()`` as the arrival
time: ``time.monotonic`` by default, the clock of the OTLP receiver, so read the store with it.
Bodies over ``max_body_bytes`` are refused; large ones are mapped and ingested in a worker
thread so the event loop stays free. Failures (refused, timeout, HTTP status, oversize,
malformed text) are counted per target, logged at most once per ``log_every_s`` per target,
and never end the loop. Set ``interval_s`` well under the store's ``window_s`` (a third of it,
say): latency and rates come from two scrapes inside one window.

With the mesh's certificates (``set_tls``, from ``listener.upstream_tls``) an ``https://``
metrics URL is fetched over mutual TLS as the control plane, and the member's certificate must
name that member (``pki.server_dns_name`` of its endpoint key, as Envoy checks it): a process
at the URL that is not the member gives no telemetry for it. ``http://`` URLs stay plaintext.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from control_plane.model.mesh import UpstreamTls
from control_plane.telemetry.store import TelemetryStore
from control_plane.telemetry.triton import TritonMapper, TritonScrape
from control_plane.telemetry.values import IngestResult
from infermesh import pki

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024
INLINE_BODY_BYTES = 64 * 1024  # larger bodies are mapped in a worker thread
TASK_PREFIX = "metrics-scrape:"


class ScrapeError(Exception):
    """A scrape that gave no usable body (the message says why)."""


@dataclass(frozen=True)
class TargetStats:
    url: str
    last_ok_age_s: float | None  # since the last clean scrape; None before the first
    scrapes: int  # attempts
    failures: int
    last_error: str | None


class _Target:
    def __init__(self, endpoint: str, url: str) -> None:
        self.endpoint = endpoint
        self.url = url
        self.mapper = TritonMapper(endpoint)
        self.scrapes = 0
        self.failures = 0
        self.last_ok: float | None = None
        self.last_error: str | None = None
        self.last_log = -float("inf")
        self.task: asyncio.Task[None] | None = None


class MetricsScraper:
    """Call ``start()``, ``set_targets()`` and ``stop()`` from the event loop."""

    def __init__(
        self,
        store: TelemetryStore,
        interval_s: float = 2.0,
        timeout_s: float | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        clock: Callable[[], float] = time.monotonic,
        log_every_s: float = 30.0,
    ) -> None:
        self.store = store
        self.interval_s = interval_s
        self.timeout_s = timeout_s if timeout_s is not None else min(interval_s, 5.0)
        self.max_body_bytes = max_body_bytes
        self.clock = clock
        self.log_every_s = log_every_s
        self._targets: dict[str, _Target] = {}
        self._session: aiohttp.ClientSession | None = None
        self._retiring: set[asyncio.Task[None]] = set()  # cancelled, not yet finished
        self._tls: tuple[ssl.SSLContext, str] | None = None  # (context, trust domain)

    def set_tls(self, tls: UpstreamTls | None) -> None:
        """The mesh's certificates for ``https://`` targets (None: the system's trust, no
        client certificate). Read again at each topology reload, so a renewal is used."""
        me = tls.control_plane if tls is not None else None
        if tls is None or me is None:
            self._tls = None
            return
        context = ssl.create_default_context(cadata=tls.ca_pem.decode())
        mine = pki.workload_files(Path(tls.pki_dir), pki.control_plane(me.name, tls.trust_domain))
        context.load_cert_chain(mine.cert, mine.key)
        self._tls = (context, tls.trust_domain)

    def set_targets(self, targets: Mapping[str, str]) -> None:
        """Scrapes exactly ``targets`` (endpoint key -> metrics URL) from now on. A target
        whose URL changes starts afresh (a new mapper: it may be another server)."""
        for endpoint in list(self._targets):
            if targets.get(endpoint) != self._targets[endpoint].url:
                self._retire(self._targets.pop(endpoint))
        for endpoint, url in targets.items():
            if endpoint not in self._targets:
                target = self._targets[endpoint] = _Target(endpoint, url)
                if self._session is not None:
                    self._launch(target)

    async def start(self) -> None:
        if self._session is not None:
            return
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout_s), trust_env=False
        )
        for target in self._targets.values():
            self._launch(target)

    async def stop(self) -> None:
        """Cancels and awaits every scrape task, then closes the HTTP session."""
        for target in self._targets.values():
            self._retire(target)
        tasks = list(self._retiring)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def stats(self, now: float | None = None) -> dict[str, TargetStats]:
        now = self.clock() if now is None else now
        return {
            key: TargetStats(
                t.url,
                None if t.last_ok is None else now - t.last_ok,
                t.scrapes,
                t.failures,
                t.last_error,
            )
            for key, t in sorted(self._targets.items())
        }

    # -- the per-target loop -------------------------------------------------------------------
    def _launch(self, target: _Target) -> None:
        name = TASK_PREFIX + target.endpoint
        target.task = asyncio.get_running_loop().create_task(self._run(target), name=name)

    def _retire(self, target: _Target) -> None:
        task, target.task = target.task, None
        if task is not None and not task.done():
            task.cancel()
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def _run(self, target: _Target) -> None:
        await asyncio.sleep(random.uniform(0.0, self.interval_s))  # stagger the targets
        next_at = time.monotonic()
        while True:
            await self._scrape(target)
            next_at += self.interval_s
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            if time.monotonic() - next_at > self.interval_s:  # fell behind: do not burst
                next_at = time.monotonic()

    async def scrape_once(self, endpoint: str) -> IngestResult | None:
        """One scrape of ``endpoint`` into the store; None when it gave nothing. Never raises
        (but cancellation)."""
        target = self._targets.get(endpoint)
        return None if target is None else await self._scrape(target)

    async def _scrape(self, target: _Target) -> IngestResult | None:
        if self._session is None:
            return None
        target.scrapes += 1
        try:
            body = await self._fetch(self._session, target.url, target.endpoint)
            result, scrape = await self._ingest(target, body)
        except asyncio.CancelledError:
            raise
        except (ScrapeError, aiohttp.ClientError, TimeoutError, OSError) as exc:
            self._failed(target, _describe(exc))
            return None
        except Exception as exc:  # a bug, not the target's fault: still no reason to stop
            log.exception("metrics scrape of %s: unexpected error", target.endpoint)
            self._failed(target, f"internal error: {_describe(exc)}")
            return None
        if scrape.errors:
            self._failed(target, "; ".join(scrape.errors))
        else:
            target.last_ok = self.clock()
        return result

    async def _fetch(self, session: aiohttp.ClientSession, url: str, endpoint: str) -> bytes:
        options: dict[str, object] = {}
        if self._tls is not None and url.startswith("https://"):
            context, domain = self._tls
            options = {"ssl": context, "server_hostname": pki.server_dns_name(endpoint, domain)}
        async with session.get(url, headers={"Accept": "text/plain"}, **options) as response:  # type: ignore[arg-type]
            if response.status != 200:
                raise ScrapeError(f"HTTP {response.status} {response.reason or ''}".strip())
            declared = response.content_length
            if declared is not None and declared > self.max_body_bytes:
                raise ScrapeError(self._too_large(f"{declared} bytes declared"))
            chunks, size = [], 0
            async for chunk in response.content.iter_chunked(64 * 1024):
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise ScrapeError(self._too_large(f"more than {self.max_body_bytes} bytes"))
                chunks.append(chunk)
            return b"".join(chunks)

    def _too_large(self, detail: str) -> str:
        return f"metrics body too large: {detail} (limit {self.max_body_bytes} bytes)"

    async def _ingest(self, target: _Target, body: bytes) -> tuple[IngestResult, TritonScrape]:
        if len(body) <= INLINE_BODY_BYTES:
            return self._map_and_store(target, body)
        # The mapper is only ever used by this target's task, one scrape at a time; the store
        # is locked. So a worker thread is safe, and parsing a big body does not stall the loop.
        return await asyncio.to_thread(self._map_and_store, target, body)

    def _map_and_store(self, target: _Target, body: bytes) -> tuple[IngestResult, TritonScrape]:
        text = body.decode("utf-8", errors="replace")
        scrape = target.mapper.scrape(text, time.time_ns())
        received_at = self.clock()
        result = self.store.ingest_points(scrape.points, scrape.ignored, scrape.errors, received_at)
        return result, scrape

    def _failed(self, target: _Target, error: str) -> None:
        target.failures += 1
        target.last_error = error[:500]
        now = time.monotonic()
        if now - target.last_log >= self.log_every_s:
            target.last_log = now
            log.warning(
                "metrics scrape of %s (%s) failed (%d so far; logged at most every %.0fs): %s",
                target.endpoint,
                target.url,
                target.failures,
                self.log_every_s,
                target.last_error,
            )


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ScrapeError):
        return str(exc)
    if isinstance(exc, TimeoutError) and not str(exc):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
