"""The admin port against what an unauthenticated or careless client can send it: probes in a
loop, slow and stalled connections, odd request framing and odd endpoint names. Every test
talks to a real AdminServer on 127.0.0.1 over real sockets."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry

from control_plane.admin import http as admin_module
from control_plane.admin.api import OperatorApi
from control_plane.admin.http import AdminServer, HealthyFn, OverrideFn, StatusFn
from control_plane.admin.live_view import LiveFeed


async def always() -> bool:
    return True


class Served:
    """An AdminServer on 127.0.0.1:0, its event loop in a thread of its own."""

    def __init__(
        self,
        gets: dict[str, StatusFn] | None = None,
        posts: list[tuple[str, OverrideFn]] | None = None,
        healthy: HealthyFn = always,
        live: LiveFeed | None = None,
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = AdminServer(
            "127.0.0.1", 0, self.loop, CollectorRegistry(), gets=gets or {}, posts=posts or [],
            healthy=healthy, live=live,
        )  # fmt: skip
        self.server.start()
        self.port = self.server.port

    def stop(self) -> None:
        self.server.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


Serve = Callable[..., Served]


@pytest.fixture
def serve() -> Iterator[Serve]:
    started: list[Served] = []

    def start(**kwargs: Any) -> Served:
        started.append(Served(**kwargs))
        return started[-1]

    yield start
    for served in started:
        served.stop()


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def exchange(port: int, request: bytes) -> tuple[int, dict[str, Any]]:
    """Sends ``request`` as it is and reads the answer to the end (the admin closes after it):
    its status and JSON body. A connection closed with no answer fails the test."""
    with connect(port) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/"), f"no answer, got {answer[:200]!r}"
    return int(head.split()[1]), json.loads(body)


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()


# -- /healthz -----------------------------------------------------------------------------------


def test_healthz_asks_whether_a_snapshot_exists_and_never_builds_the_status(serve: Serve) -> None:
    """/healthz is open to anyone: on the code before, each call built the whole status (every
    endpoint's telemetry, the router's explanation, ...) on the control plane's loop."""
    built: list[int] = []

    async def status() -> dict[str, Any]:
        built.append(1)
        return {"snapshot": {"CDS": "v1"}}

    snapshot: list[object] = []
    cache = SimpleNamespace(snapshot_for=lambda group: snapshot[0] if snapshot else None)
    api = OperatorApi(cast(Any, SimpleNamespace(cache=cache)))
    admin = serve(gets={"/status": status}, healthy=api.healthy)
    assert exchange(admin.port, get("/healthz")) == (503, {"ok": False})
    snapshot.append(object())
    assert exchange(admin.port, get("/healthz")) == (200, {"ok": True})
    assert built == []


def test_a_busy_loop_still_gets_the_probe_an_answer(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the loop does not answer in time the probe gets a 503; before, the TimeoutError
    went uncaught and the probe got a closed connection."""
    monkeypatch.setattr(admin_module, "CALL_TIMEOUT_S", 0.2)
    admin = serve()
    release = threading.Event()
    admin.loop.call_soon_threadsafe(release.wait, 30)  # the loop is pinned until released
    try:
        status, body = exchange(admin.port, get("/healthz"))
    finally:
        release.set()
    assert status == 503 and "did not answer within 0.2 s" in body["error"]
