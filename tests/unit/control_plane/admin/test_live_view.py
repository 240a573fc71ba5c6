"""The live mesh view's data (frames, history) and its HTTP: the page, the event stream, and
the admin token that guards every change."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from control_plane.admin import http as admin_module
from control_plane.admin import live_view
from control_plane.admin.http import AdminServer
from control_plane.admin.live_view import History, LiveFeed, build_frame, endpoint_state
from control_plane.admin.tokens import AdminExposureError, AdminTokens, check_exposure
from control_plane.app.cli import read_token
from tests.support import wait_for

ROUTE = {"weight": 100, "health": "HEALTHY", "score": 0.9, "reason": "score 0.90"}


@pytest.mark.parametrize(
    ("endpoint", "route", "draining", "state"),
    [
        ({"reachable": True}, ROUTE, False, "serving"),
        ({"reachable": False}, ROUTE, False, "unreachable"),
        ({"reachable": True}, {**ROUTE, "health": "UNHEALTHY"}, False, "ejected"),
        ({"reachable": True}, {**ROUTE, "health": "DRAINING"}, False, "draining"),
        ({"reachable": True, "health_override": "DRAINING"}, ROUTE, False, "draining"),
        ({"reachable": True}, ROUTE, True, "draining"),  # the server itself says so
        ({"reachable": True, "health_override": "UNHEALTHY"}, ROUTE, False, "ejected"),
        # the typed state decides; the words are for people
        ({"reachable": True}, {**ROUTE, "state": "slow_start",
                               "reason": "score 0.9, slow start -> 40"}, False, "slow start"),
        ({"reachable": True}, {**ROUTE, "state": "probation",
                               "reason": "x, probation: weight 1 until p99 <= SLA"},
         False, "probation"),
        ({"reachable": True}, {**ROUTE, "reason": "x, probation: weight 1 until p99 <= SLA"},
         False, "serving"),
    ],
)  # fmt: skip
def test_endpoint_state_in_one_word(
    endpoint: dict[str, Any], route: dict[str, Any], draining: bool, state: str
) -> None:
    assert endpoint_state(endpoint, route, draining) == state


def signal(value: float) -> dict[str, float]:
    return {"value": value, "age_s": 0.1}


def status_and_telemetry() -> tuple[dict[str, Any], dict[str, Any]]:
    status = {
        "snapshot": {"CDS": "v1"},
        "topology": {"error": None},
        "endpoints": {
            "a:1": {"reachable": True, "labels": {"device_class": "a100", "zone": "b"}},
            "b:1": {"reachable": True},
        },
        "routing": {
            "classifier": {
                "fail_open": False,
                "endpoints": {
                    "a:1": ROUTE,
                    "b:1": {**ROUTE, "weight": 1, "health": "UNHEALTHY", "reason": "ejected"},
                },
            }
        },
        "version_splits": {"classifier": {"1": 90, "2": 10}},
        "canaries": {"classifier": {"status": "running", "percent": 10}},
        "circuits": {},
        "nodes": [{"node_id": "envoy-1", "connected": True}],
        "decisions": [
            {"at": float(i), "pool": "classifier", "decision": f"d{i}"} for i in range(50)
        ],
    }  # fmt: skip
    telemetry = {
        "endpoints": {
            "a:1": {
                "stale": False,
                "p99_ms": signal(12.0),
                "memory_used_bytes": signal(100.0),
                "memory_total_bytes": signal(400.0),
                "models": [{"model": "classifier", "p99_ms": signal(11.0), "qps": signal(30.0)}],
            },
            "b:1": {
                "stale": False,
                "models": [{"model": "classifier", "p99_ms": signal(250.0), "qps": signal(10.0)}],
            },
        }
    }
    return status, telemetry


def test_a_frame_shows_each_endpoint_with_its_share_and_why() -> None:
    status, telemetry = status_and_telemetry()
    frame = build_frame(status, telemetry, 1000.0)
    (pool,) = frame["pools"]
    assert pool["model"] == "classifier" and pool["version_split"] == {"1": 90, "2": 10}
    assert pool["canary"]["percent"] == 10
    a, b = pool["endpoints"]
    assert (a["endpoint"], a["state"], a["weight"], a["p99_ms"], a["qps"]) == (
        "a:1", "serving", 100, 11.0, 30.0,
    )  # fmt: skip
    assert a["share"] == pytest.approx(0.75) and b["share"] == pytest.approx(0.25)
    assert (b["state"], b["reason"], b["memory_used_bytes"]) == ("ejected", "ejected", None)
    assert a["memory_used_bytes"] == 100.0 and a["memory_total_bytes"] == 400.0
    assert len(frame["decisions"]) == 40 and frame["decisions"][-1]["decision"] == "d49"
    assert frame["nodes"][0]["node_id"] == "envoy-1"
    assert a["labels"] == {"device_class": "a100", "zone": "b"} and b["labels"] == {}


def test_nacks_join_the_timeline_in_time_order() -> None:
    status, telemetry = status_and_telemetry()
    nack = {"version": "v7", "error": "bad cluster", "at": 45.5}
    status["nodes"] = [{"node_id": "envoy-1", "types": {"CDS": {"last_nack": nack}}}]
    decisions = build_frame(status, telemetry, 100.0)["decisions"]
    texts = [d["decision"] for d in decisions]
    assert texts.index("CDS version v7 NACKed: bad cluster") == texts.index("d45") + 1
    assert len(texts) == 40 and texts[-1] == "d49"
    assert next(d for d in decisions if d.get("nack"))["pool"] == "envoy-1"


def test_no_traffic_means_no_share_rather_than_a_division_by_zero() -> None:
    status, _ = status_and_telemetry()
    frame = build_frame(status, {"endpoints": {}}, 0.0)
    assert [row["share"] for row in frame["pools"][0]["endpoints"]] == [None, None]
    assert all(row["stale"] for row in frame["pools"][0]["endpoints"])


def test_history_keeps_the_last_points_and_forgets_endpoints_that_left() -> None:
    status, telemetry = status_and_telemetry()
    history = History(points=3)
    for at in range(5):
        history.add(build_frame(status, telemetry, float(at)))
    lines = history.as_json()["classifier"]
    assert [p["at"] for p in lines["a:1"]] == [2.0, 3.0, 4.0]
    assert lines["b:1"][-1]["p99_ms"] == 250.0 and lines["b:1"][-1]["weight"] == 1
    del status["routing"]["classifier"]["endpoints"]["b:1"]
    history.add(build_frame(status, telemetry, 5.0))
    assert set(history.as_json()["classifier"]) == {"a:1"}


def test_a_large_fleets_opening_carries_shorter_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    """A page's first event is bounded over all lines together (27 MB of JSON at 1,000
    endpoints x 300 points stalled the control plane on every page open); the newest points."""
    monkeypatch.setattr(live_view, "OPENING_POINTS", 4)
    status, telemetry = status_and_telemetry()  # two endpoints
    history = History(points=300)
    for at in range(5):
        history.add(build_frame(status, telemetry, float(at)))
    monkeypatch.setattr(live_view, "OPENING_MIN_POINTS", 1)
    lines = history.as_json()["classifier"]
    assert {e: [p["at"] for p in line] for e, line in lines.items()} == {
        "a:1": [3.0, 4.0], "b:1": [3.0, 4.0],
    }  # fmt: skip
    monkeypatch.setattr(live_view, "OPENING_MIN_POINTS", 3)  # never fewer than this
    assert [p["at"] for p in history.as_json()["classifier"]["a:1"]] == [2.0, 3.0, 4.0]


def test_a_reader_waits_for_the_next_frame_or_times_out() -> None:
    feed = LiveFeed()
    sequence, opening = feed.opening()
    assert (sequence, opening["frame"], opening["history"]) == (0, None, {})
    assert feed.next_frame(sequence, timeout=0.05) == (0, None)
    status, telemetry = status_and_telemetry()
    frame = build_frame(status, telemetry, 1.0)
    timer = threading.Timer(0.05, feed.publish, args=(frame,))
    timer.start()
    assert feed.next_frame(sequence, timeout=10) == (1, frame)
    timer.join()


# -- the admin HTTP: page, events, token -------------------------------------------------------


class Admin:
    def __init__(self, token: str | None, read: str | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.feed = LiveFeed()
        self.posts: list[dict[str, Any]] = []
        self.split_models: list[str] = []

        async def status() -> dict[str, Any]:
            return {"snapshot": {"CDS": "v1"}}

        async def healthy() -> bool:
            return True

        async def split(model: str, body: dict[str, Any]) -> dict[str, Any]:
            self.posts.append(body)
            self.split_models.append(model)
            return {"model": model}

        self.server = AdminServer(
            "127.0.0.1", 0, self.loop, CollectorRegistry(), gets={"/status": status},
            posts=[(r"/models/([^/]+)/split", split)], healthy=healthy, live=self.feed,
            tokens=AdminTokens(read, token),
        )  # fmt: skip
        self.server.start()
        self.url = f"http://127.0.0.1:{self.server.port}"

    def stop(self) -> None:
        self.server.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    def get(self, path: str, authorization: str = "") -> tuple[int, str, bytes]:
        headers = {"authorization": authorization} if authorization else {}
        request = urllib.request.Request(self.url + path, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.headers["content-type"], response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers["content-type"], exc.read()

    def post(
        self,
        path: str,
        body: dict[str, Any],
        token: str | None = None,
        authorization: str = "",
        content_type: str = "application/json",
    ) -> int:
        headers = {"content-type": content_type} if content_type else {}
        if token is not None:
            headers["authorization"] = f"Bearer {token}"
        if authorization:
            headers["authorization"] = authorization
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), method="POST", headers=headers
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return exc.code


@pytest.fixture
def admin() -> Iterator[Admin]:
    server = Admin(token=None)
    yield server
    server.stop()


@pytest.fixture
def guarded() -> Iterator[Admin]:
    server = Admin(token="a-long-enough-secret")
    yield server
    server.stop()


def test_the_page_and_its_files_are_served(admin: Admin) -> None:
    status, kind, body = admin.get("/ui")
    assert status == 200 and kind.startswith("text/html") and b"/ui/app.js" in body
    assert admin.get("/ui/")[2] == body
    status, kind, body = admin.get("/ui/app.js")
    assert status == 200 and kind.startswith("text/javascript") and b"EventSource" in body
    assert admin.get("/ui/style.css")[1].startswith("text/css")
    for bad in ("/ui/../admin.py", "/ui/nope.js", "/ui/%2e%2e/admin.py"):
        assert admin.get(bad)[0] == 404, bad


def read_events(url: str, count: int) -> list[tuple[str, Any]]:
    """The first ``count`` server-sent events from ``url``: (event name, parsed data)."""
    events: list[tuple[str, Any]] = []
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers["content-type"] == "text/event-stream"
        name = ""
        for raw in response:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
                if len(events) == count:
                    return events
    return events


def test_events_start_with_the_history_then_stream_each_frame(admin: Admin) -> None:
    status, telemetry = status_and_telemetry()
    admin.feed.publish(build_frame(status, telemetry, 1.0))
    publisher = threading.Timer(0.3, admin.feed.publish, (build_frame(status, telemetry, 2.0),))
    publisher.start()
    events = read_events(admin.url + "/events", 2)
    publisher.join()
    (first, opening), (second, frame) = events
    assert first == "history" and opening["frame"]["at"] == 1.0
    assert [p["at"] for p in opening["history"]["classifier"]["a:1"]] == [1.0]
    assert second == "frame" and frame["at"] == 2.0


def test_open_pages_are_counted_while_they_are_open(admin: Admin) -> None:
    """The control plane builds a frame a second only while someone watches."""
    assert admin.feed.viewers == 0
    with urllib.request.urlopen(admin.url + "/events", timeout=10) as stream:
        stream.readline()  # the stream is open
        wait_for(lambda: admin.feed.viewers == 1, 5, "the page counted")
    frame = build_frame(*status_and_telemetry(), 1.0)

    def gone() -> bool:  # a write is how the handler learns the page went away
        admin.feed.publish(frame)
        return admin.feed.viewers == 0

    wait_for(gone, 20, "the page uncounted")


def test_open_pages_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admin_module, "MAX_EVENT_STREAMS", 1)
    server = Admin(token=None)
    try:
        with urllib.request.urlopen(server.url + "/events", timeout=10) as first:
            first.readline()  # the stream is open
            status, _, body = server.get("/events")
            assert status == 503 and b"at most 1 live views" in body
    finally:
        server.stop()


def test_without_a_token_the_page_is_read_only_and_posts_are_open(admin: Admin) -> None:
    assert json.loads(admin.get("/ui/config")[2]) == {"actions": False}
    assert admin.post("/models/classifier/split", {"1": 100}) == 200
    assert admin.post("/models/class%69fier/split", {"1": 90}) == 200  # percent-decoded
    assert admin.split_models == ["classifier", "classifier"]


def test_with_a_token_every_change_needs_it(guarded: Admin) -> None:
    assert json.loads(guarded.get("/ui/config")[2]) == {"actions": True}
    assert guarded.post("/models/classifier/split", {"1": 100}) == 401
    assert guarded.post("/models/classifier/split", {"1": 100}, token="wrong") == 401
    assert guarded.post("/models/classifier/split", {"1": 100}, token="a-long-enough-secret") == 200
    assert guarded.posts == [{"1": 100}]  # only the authorised change arrived
    assert guarded.get("/status")[0] == 200  # reading needs no token


WRITE = "a-long-enough-secret"
READ = "a-read-only-secret-token"


@pytest.mark.parametrize("host", ["evil.example:19000", "evil.example", "10.0.0.1:19000"])
def test_on_loopback_a_foreign_host_is_refused(admin: Admin, host: str) -> None:
    """DNS rebinding: a page at evil.example whose name then resolves to 127.0.0.1 reaches the
    admin with its own Host; with no read token it read /status and /telemetry before."""
    request = urllib.request.Request(admin.url + "/status", headers={"host": host})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 421
    for mine in ("127.0.0.1", "localhost:1", "[::1]:19000"):
        ok = urllib.request.Request(admin.url + "/status", headers={"host": mine})
        with urllib.request.urlopen(ok, timeout=10) as answer:
            assert answer.status == 200


def test_a_change_needs_the_bearer_token_and_a_json_content_type(guarded: Admin) -> None:
    """What a page elsewhere can make a browser send: a form (text/plain or urlencoded, no
    preflight) with the Basic credentials the browser cached from the admin's own prompt.
    On the code before, both were taken: CSRF on splits, canaries and drains."""
    basic = "Basic " + base64.b64encode(f"operator:{WRITE}".encode()).decode()
    assert guarded.post("/models/classifier/split", {"1": 100}, authorization=basic) == 401
    for form in ("text/plain", "application/x-www-form-urlencoded", ""):
        assert guarded.post("/models/classifier/split", {"1": 100}, WRITE,
                            content_type=form) == 415, form  # fmt: skip
    assert guarded.post("/models/classifier/split", {"1": 100}, WRITE,
                        content_type="application/json; charset=utf-8") == 200  # fmt: skip
    assert guarded.posts == [{"1": 100}]


def test_with_a_read_token_every_state_read_needs_a_token() -> None:
    server = Admin(token=WRITE, read=READ)
    try:
        for path in ("/status", "/ui", "/ui/app.js", "/ui/config", "/events", "/nope"):
            status, _, body = server.get(path)
            assert status == 401, path
            assert b"read (or write) token" in body and READ.encode() not in body
            assert server.get(path, "Bearer wrong-token-of-length")[0] == 401
        basic = "Basic " + base64.b64encode(f"operator:{READ}".encode()).decode()
        assert server.get("/status", f"Bearer {READ}")[0] == 200
        assert server.get("/status", f"Bearer {WRITE}")[0] == 200  # write implies read
        assert server.get("/ui", basic)[0] == 200  # what a browser sends after its prompt
        assert server.get("/status", "Basic !!not-base64")[0] == 401
        assert server.get("/healthz")[0] == 200 and server.get("/metrics")[0] == 200
        assert server.post("/models/classifier/split", {"1": 100}, token=READ) == 403
        assert server.post("/models/classifier/split", {"1": 100}, token=WRITE) == 200
        assert server.posts == [{"1": 100}]
    finally:
        server.stop()


def test_the_401_asks_a_browser_for_basic_credentials() -> None:
    server = Admin(token=None, read=READ)
    try:
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(server.url + "/ui", timeout=10)
        assert caught.value.headers["www-authenticate"].startswith("Basic realm=")
    finally:
        server.stop()


def test_the_admin_refuses_to_bind_off_loopback_without_both_tokens() -> None:
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.5"):
        check_exposure(host, AdminTokens())
    for host, tokens in (
        ("0.0.0.0", AdminTokens()),
        ("10.1.2.3", AdminTokens(write=WRITE)),
        ("admin.example", AdminTokens(read=READ)),
    ):
        with pytest.raises(AdminExposureError, match="not loopback"):
            check_exposure(host, tokens)
    check_exposure("0.0.0.0", AdminTokens(READ, WRITE))
    assert READ not in repr(AdminTokens(READ, WRITE))


def test_the_admin_token_file(tmp_path: Path) -> None:
    good = tmp_path / "token"
    good.write_text("  a-long-enough-secret\n")
    assert read_token(good) == "a-long-enough-secret" and read_token(None) is None
    for text, message in (("short", "at least 16"), ("two tokens of some length", "one token")):
        (tmp_path / "bad").write_text(text)
        with pytest.raises(ValueError, match=message):
            read_token(tmp_path / "bad")
    with pytest.raises(ValueError, match="cannot read"):
        read_token(tmp_path / "missing")
