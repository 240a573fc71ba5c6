"""The admin port against what an unauthenticated or careless client can send it: probes in a
loop, slow and stalled connections, odd request framing and odd endpoint names. Every test
talks to a real AdminServer on 127.0.0.1 over real sockets."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import urllib.request
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry

from control_plane.admin import http as admin_module
from control_plane.admin.api import OperatorApi
from control_plane.admin.http import AdminServer, HealthyFn, OverrideFn, StatusFn
from control_plane.admin.live_view import LiveFeed
from control_plane.model.mesh import EndpointAddress, EndpointHealth
from control_plane.model.operator_state import OperatorState
from tests.support import wait_for


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


def exchange(port: int, request: bytes, end: bool = False) -> tuple[int, dict[str, Any]]:
    """Sends ``request`` as it is (then ends the stream if ``end``) and reads the answer to
    the end (the admin closes after it): its status and JSON body. A connection closed with no
    answer fails the test."""
    with connect(port) as sock:
        sock.sendall(request)
        if end:
            sock.shutdown(socket.SHUT_WR)
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


# -- slow clients: the socket timeout and the connection cap ------------------------------------


class Splits:
    """A POST route that records what reached it."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    async def __call__(self, model: str, body: dict[str, Any]) -> dict[str, Any]:
        self.bodies.append(body)
        return {"model": model}

    def route(self) -> list[tuple[str, OverrideFn]]:
        return [(r"/models/([^/]+)/split", self)]


def test_a_client_that_stops_mid_request_line_is_let_go(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, half a request line held its thread (and socket) for as long as the client
    liked."""
    monkeypatch.setattr(admin_module, "REQUEST_TIMEOUT_S", 0.3)
    admin = serve()
    with connect(admin.port) as sock:
        sock.sendall(b"GET /heal")
        assert sock.recv(1024) == b""  # closed by the admin, well within the client's 10 s


def test_a_body_that_never_arrives_gets_408(serve: Serve, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admin_module, "REQUEST_TIMEOUT_S", 0.3)
    splits = Splits()
    admin = serve(posts=splits.route())
    head = (
        b"POST /models/m/split HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b'Content-Type: application/json\r\nContent-Length: 10\r\n\r\n{"1"'
    )
    status, body = exchange(admin.port, head)
    assert status == 408 and "did not arrive within 0.3 s" in body["error"]
    assert splits.bodies == []


def answers(port: int) -> bool:
    """Whether a GET /healthz on a new connection gets its 200."""
    try:
        with connect(port) as sock:
            sock.sendall(get("/healthz"))
            return sock.recv(1024).startswith(b"HTTP/1.0 200")
    except ConnectionError:
        return False


def test_connections_past_the_cap_are_closed_until_one_ends(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, every connection got a thread of its own, without limit (slowloris)."""
    monkeypatch.setattr(admin_module, "MAX_CONNECTIONS", 2)
    monkeypatch.setattr(admin_module, "REQUEST_TIMEOUT_S", 60.0)  # the holders stay
    admin = serve()
    holders = [connect(admin.port) for _ in range(2)]
    try:
        for holder in holders:
            holder.sendall(b"GET /hea")  # half a request line: each holds a slot
        # Connections are taken in order, so this one finds both slots held: closed at once.
        with connect(admin.port) as refused:
            assert refused.recv(1024) == b""
        holders.pop().close()
        wait_for(lambda: answers(admin.port), 10, "a freed slot served again")
    finally:
        for holder in holders:
            holder.close()


def test_a_page_that_stops_reading_ends_its_stream_and_frees_its_slot(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, a frame written to a page that no longer read blocked its thread for good, and
    the stream kept its slot."""
    monkeypatch.setattr(admin_module, "REQUEST_TIMEOUT_S", 0.5)
    monkeypatch.setattr(admin_module, "MAX_EVENT_STREAMS", 1)
    feed = LiveFeed()
    admin = serve(live=feed)
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
    stalled.settimeout(10)
    try:
        stalled.connect(("127.0.0.1", admin.port))
        stalled.sendall(get("/events"))  # and never reads
        wait_for(lambda: feed.viewers == 1, 10, "the page counted")
        big = {"at": 1.0, "pools": [], "padding": "x" * 2**18}

        def ended() -> bool:
            feed.publish(big)
            return feed.viewers == 0

        wait_for(ended, 20, "the stalled page's stream ended")
        url = f"http://127.0.0.1:{admin.port}/events"
        with urllib.request.urlopen(url, timeout=10) as page:  # the one slot is free
            assert page.status == 200 and page.readline().startswith(b"retry:")
    finally:
        stalled.close()


def test_a_quiet_stream_outlives_the_read_timeout(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live view waits between frames longer than the socket timeout: only a write that
    stalls ends it."""
    monkeypatch.setattr(admin_module, "REQUEST_TIMEOUT_S", 0.2)
    monkeypatch.setattr(admin_module, "EVENT_KEEPALIVE_S", 0.6)
    feed = LiveFeed()
    admin = serve(live=feed)
    with urllib.request.urlopen(f"http://127.0.0.1:{admin.port}/events", timeout=10) as page:
        assert b"event: history\n" in [page.readline() for _ in range(3)]
        while page.readline() != b": keep-alive\n":  # 0.6 s without a write: still open
            pass
        feed.publish({"at": 2.0, "pools": []})
        while (line := page.readline()) != b"event: frame\n":
            assert line, "the stream ended"
        assert json.loads(page.readline().removeprefix(b"data: "))["at"] == 2.0


# -- request bodies: framed by one Content-Length, nothing else ---------------------------------


def post(path: str, headers: bytes, body: bytes = b"") -> bytes:
    start = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    return start.encode() + headers + b"\r\n" + body


@pytest.mark.parametrize(
    ("headers", "status", "named"),
    [
        (b"Content-Length: -1\r\n", 400, "Content-Length"),  # passed the size check, read to EOF
        (b"Content-Length: x\r\n", 400, "Content-Length"),  # ValueError: no answer at all
        (b"Content-Length: \xb2\r\n", 400, "Content-Length"),  # "\u00b2".isdigit(), int() fails
        (b"Content-Length: 5\r\nContent-Length: 7\r\n", 400, "Content-Length"),
        (b"Content-Length: 65537\r\n", 413, "at most 65536 bytes"),
        (b"Content-Length: 00000000000000000000000000070000\r\n", 413, "at most 65536 bytes"),
        (b"", 411, "Content-Length"),  # was read as {}: a split reset
        (b"Transfer-Encoding: chunked\r\n", 501, "Transfer-Encoding"),  # likewise
        (b"Transfer-Encoding: chunked\r\nContent-Length: 8\r\n", 501, "Transfer-Encoding"),
    ],
)
def test_a_body_is_framed_by_one_content_length(
    serve: Serve, headers: bytes, status: int, named: str
) -> None:
    splits = Splits()
    admin = serve(posts=splits.route())
    got, body = exchange(admin.port, post("/models/m/split", headers))
    assert (got, named in body["error"]) == (status, True), body
    assert splits.bodies == []  # nothing reached the route


def test_a_body_that_ends_before_its_length_is_refused(serve: Serve) -> None:
    splits = Splits()
    admin = serve(posts=splits.route())
    request = post("/models/m/split", b"Content-Length: 10\r\n", b'{"1":')
    got, body = exchange(admin.port, request, end=True)
    assert got == 400 and "ended before Content-Length" in body["error"]
    assert splits.bodies == []


def test_a_framed_body_reaches_its_route(serve: Serve) -> None:
    splits = Splits()
    admin = serve(posts=splits.route())
    assert exchange(admin.port, post("/models/m/split", b"Content-Length: 0\r\n"))[0] == 200
    body = b'{"1": 90, "2": 10}'
    request = post("/models/m/split", b"Content-Length: %d\r\n" % len(body), body)
    assert exchange(admin.port, request)[0] == 200
    assert splits.bodies == [{}, {"1": 90, "2": 10}]


# -- every request gets an answer ---------------------------------------------------------------


def endpoint_api(monkeypatch: pytest.MonkeyPatch) -> tuple[OperatorApi, OperatorState]:
    """An OperatorApi over one endpoint, 10.0.0.5:8001; its status lists that endpoint."""
    operator = OperatorState()
    plane = SimpleNamespace(
        endpoints=(EndpointAddress("10.0.0.5", 8001),), operator=operator,
        rebuild=lambda reason: True,
    )  # fmt: skip
    api = OperatorApi(cast(Any, plane))

    async def status() -> dict[str, Any]:
        health = {a.key: h.value for a, h in operator.health.items()}
        return {"endpoints": {"10.0.0.5:8001": {"health_override": health.get("10.0.0.5:8001")}}}

    monkeypatch.setattr(api, "status", status)
    return api, operator


@pytest.mark.parametrize("port", ["08001", "%C2%B2", "8001%20", "+8001", "65537", ""])
def test_an_endpoint_port_is_ascii_digits_without_a_leading_zero(
    serve: Serve, monkeypatch: pytest.MonkeyPatch, port: str
) -> None:
    """Before, "08001" passed isdigit(): the override was made, then the answer looked the
    endpoint up as "10.0.0.5:08001" and the KeyError left the client with no answer; "\u00b2"
    (%C2%B2) passed isdigit() and failed int()."""
    api, operator = endpoint_api(monkeypatch)
    admin = serve(posts=[(r"/endpoints/([^/]+)", api.override)])
    body = b'{"health": "DRAINING"}'
    request = post(f"/endpoints/10.0.0.5:{port}", b"Content-Length: %d\r\n" % len(body), body)
    status, answer = exchange(admin.port, request)
    assert status == 400 and "a port 1-65535" in answer["error"]
    assert operator.health == {}  # nothing changed


def test_an_override_answers_with_the_endpoint_it_changed(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    api, operator = endpoint_api(monkeypatch)
    admin = serve(posts=[(r"/endpoints/([^/]+)", api.override)])
    body = b'{"health": "DRAINING"}'
    request = post("/endpoints/10.0.0.5:8001", b"Content-Length: %d\r\n" % len(body), body)
    assert exchange(admin.port, request) == (
        200, {"endpoint": "10.0.0.5:8001", "changed": True, "health_override": "DRAINING"},
    )  # fmt: skip
    assert operator.health == {EndpointAddress("10.0.0.5", 8001): EndpointHealth.DRAINING}


SECRET = "a-secret-that-must-not-reach-the-client"


def test_an_unforeseen_error_gets_a_500_that_does_not_repeat_it(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, anything but an AdminError left the client with a closed connection."""

    async def broken_get() -> dict[str, Any]:
        raise RuntimeError(SECRET)

    async def broken_post(target: str, body: dict[str, Any]) -> dict[str, Any]:
        raise KeyError(SECRET)

    admin = serve(gets={"/status": broken_get}, posts=[(r"/models/([^/]+)/split", broken_post)])
    caplog.set_level("ERROR", logger=admin_module.__name__)
    request = post("/models/m/split", b"Content-Length: 2\r\n", b"{}")
    for sent in (get("/status"), request):
        assert exchange(admin.port, sent) == (500, {"error": "internal error"})
    failed = [r for r in caplog.records if r.exc_info and "failed" in r.getMessage()]
    assert [r.getMessage() for r in failed] == [
        "admin: GET '/status' failed",
        "admin: POST '/models/m/split' failed",
    ]
