"""The scraper against a real aiohttp server on 127.0.0.1, into a real TelemetryStore."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from control_plane.telemetry.scraper import INLINE_BODY_BYTES, TASK_PREFIX, MetricsScraper
from control_plane.telemetry.store import TelemetryStore
from control_plane.xds.upstream_tls import read_pki
from infermesh import pki
from tests.triton_metrics_support import requests

CAP = 1024 * 1024
PADDING = "".join(f"# padding line {i:06d} {'x' * 40}\n" for i in range(2_000))
GOOD, ERROR, DOWN, BIG, LARGE, SLOW = (f"127.0.0.1:{9000 + i}" for i in range(6))


@dataclass
class Triton:
    """A fake Triton /metrics: every GET of /good serves 10 more requests at 3 ms."""

    port: int = 0
    hits: dict[str, int] = field(default_factory=dict)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path}"

    def _hit(self, path: str) -> int:
        self.hits[path] = self.hits.get(path, 0) + 1
        return self.hits[path]

    async def good(self, _: web.Request) -> web.Response:
        n = 10 * self._hit("good")
        return web.Response(text=requests(n, n * 3_000))

    async def large(self, _: web.Request) -> web.Response:
        """Valid and over INLINE_BODY_BYTES: mapped in a worker thread."""
        n = 10 * self._hit("large")
        return web.Response(text=PADDING + requests(n, n * 7_000))

    async def error(self, _: web.Request) -> web.Response:
        self._hit("error")
        return web.Response(status=500, text="boom")

    async def big(self, request: web.Request) -> web.StreamResponse:
        """Over the cap, streamed without a Content-Length: the reader must count."""
        self._hit("big")
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        for _i in range(CAP // 65536 + 2):
            await response.write(b"#" * 65535 + b"\n")
        await response.write_eof()
        return response

    async def slow(self, _: web.Request) -> web.Response:
        self._hit("slow")
        await asyncio.sleep(1.0)
        return web.Response(text=requests(1, 1))


def free_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@pytest.fixture
async def triton() -> AsyncIterator[Triton]:
    fake = Triton()
    app = web.Application()
    for path in ("good", "large", "error", "big", "slow"):
        app.router.add_get(f"/{path}", getattr(fake, path))
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    fake.port = runner.addresses[0][1]
    try:
        yield fake
    finally:
        await runner.cleanup()


async def wait_for(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        await asyncio.sleep(0.05)


def scraper_tasks() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith(TASK_PREFIX)]


async def test_scrapes_into_the_store_and_reports_failures(
    triton: Triton, caplog: pytest.LogCaptureFixture
) -> None:
    store = TelemetryStore(window_s=10.0)
    scraper = MetricsScraper(store, interval_s=0.1, timeout_s=0.4, max_body_bytes=CAP)
    scraper.set_targets(
        {
            GOOD: triton.url("good"),
            ERROR: triton.url("error"),
            DOWN: f"http://127.0.0.1:{free_port()}/metrics",
            BIG: triton.url("big"),
            LARGE: triton.url("large"),
            SLOW: triton.url("slow"),
        }
    )
    caplog.set_level(logging.WARNING, logger="control_plane.telemetry.scraper")
    await scraper.start()
    try:

        def ready() -> bool:
            seen = store.snapshot(time.monotonic())
            stats = scraper.stats()
            return (
                all(k in seen and seen[k].p99_ms is not None for k in (GOOD, LARGE))
                and all(stats[k].failures >= 3 for k in (ERROR, DOWN, BIG))
                and stats[SLOW].failures >= 1
            )

        await wait_for(ready)
        seen = store.snapshot(time.monotonic())
        stats = scraper.stats()
    finally:
        await scraper.stop()

    good, large = seen[GOOD], seen[LARGE]
    assert good.p99_ms is not None and 2.6 <= good.p99_ms.value <= 3.0
    assert large.p99_ms is not None and 6.5 <= large.p99_ms.value <= 7.5
    assert good.error_rate is not None and good.error_rate.value == 0.0
    assert good.qps is not None and good.qps.value > 0
    for key in (GOOD, LARGE):
        assert stats[key].failures == 0 and stats[key].last_error is None
        age = stats[key].last_ok_age_s
        assert age is not None and 0 <= age < 5
    assert stats[ERROR].last_error == "HTTP 500 Internal Server Error"
    assert "Connect" in (stats[DOWN].last_error or "")
    assert "too large" in (stats[BIG].last_error or "")
    assert "time" in (stats[SLOW].last_error or "").lower()
    for key in (ERROR, DOWN, BIG):
        assert stats[key].last_ok_age_s is None and key not in seen
    # Rate-limited: one line per failing target however many failures.
    for key in (ERROR, DOWN, BIG):
        assert sum(key in r.getMessage() for r in caplog.records) == 1
    assert len(PADDING) > INLINE_BODY_BYTES  # so LARGE went through the worker thread


async def test_targets_change_at_run_time_and_stop_leaves_no_tasks(triton: Triton) -> None:
    store = TelemetryStore()
    scraper = MetricsScraper(store, interval_s=0.05, timeout_s=1.0)
    scraper.set_targets({GOOD: triton.url("good")})
    await scraper.start()
    await wait_for(lambda: scraper.stats()[GOOD].scrapes >= 2)
    assert [t.get_name() for t in scraper_tasks()] == [TASK_PREFIX + GOOD]

    scraper.set_targets({LARGE: triton.url("large")})  # GOOD goes, LARGE comes
    await wait_for(lambda: scraper.stats()[LARGE].scrapes >= 1)
    await wait_for(lambda: [t.get_name() for t in scraper_tasks()] == [TASK_PREFIX + LARGE])
    assert set(scraper.stats()) == {LARGE}

    scraper.set_targets({GOOD: triton.url("good"), LARGE: triton.url("large")})
    await wait_for(lambda: len(scraper_tasks()) == 2)
    await scraper.stop()
    assert scraper_tasks() == []
    hits = dict(triton.hits)
    await asyncio.sleep(0.2)  # nothing scrapes any more
    assert triton.hits == hits


async def test_stop_before_start_and_twice_is_harmless() -> None:
    scraper = MetricsScraper(TelemetryStore(), interval_s=0.05)
    await scraper.stop()
    scraper.set_targets({DOWN: f"http://127.0.0.1:{free_port()}/metrics"})
    await scraper.start()
    await wait_for(lambda: scraper.stats()[DOWN].failures >= 1)
    await scraper.stop()
    await scraper.stop()
    assert scraper_tasks() == []


async def test_an_https_target_must_prove_it_is_the_member(tmp_path: Path) -> None:
    """Under upstream_tls an https:// metrics URL is scraped over mutual TLS, and only a
    certificate naming the member counts: the same server scraped as another member fails."""
    pki_dir = tmp_path / "pki"
    authority = pki.init_authority(pki_dir)
    member, other = "127.0.0.1:8101", "127.0.0.1:8102"
    for who in (pki.model_server(member), pki.control_plane(), pki.envoy("e1")):
        pki.issue(authority, who, pki_dir)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=pki_dir / "ca.crt")
    server_context.verify_mode = ssl.CERT_REQUIRED  # the control plane must show its own
    stem = pki_dir / pki.model_server(member).file_stem
    server_context.load_cert_chain(f"{stem}.crt", f"{stem}.key")
    fake = Triton()
    app = web.Application()
    app.router.add_get("/good", fake.good)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_context).start()
    url = f"https://127.0.0.1:{runner.addresses[0][1]}/good"
    tls, errors = read_pki(pki_dir)
    assert not errors
    store = TelemetryStore(window_s=10.0)
    scraper = MetricsScraper(store, interval_s=0.1, timeout_s=2.0)
    scraper.set_tls(tls)
    scraper.set_targets({member: url, other: url})
    await scraper.start()
    try:

        def settled() -> bool:
            stats = scraper.stats()
            return stats[member].last_ok_age_s is not None and stats[other].failures >= 2

        await wait_for(settled)
        stats = scraper.stats()
    finally:
        await scraper.stop()
        await runner.cleanup()
    assert member in store.snapshot(time.monotonic()) and stats[member].failures == 0
    assert other not in store.snapshot(time.monotonic())
    assert "certificate" in (stats[other].last_error or "").lower()
