"""The control plane's admin HTTP: status as JSON, Prometheus metrics, and operator overrides.

It runs in a thread (http.server) and hands every request to the event loop, so it reads and
changes state exactly where the rest of the control plane does.

GET  /status                     endpoints, clusters, snapshot versions, Envoy nodes (JSON)
GET  /metrics                    Prometheus text
GET  /healthz                    200 once a snapshot is set
GET  /telemetry                  every endpoint's signals (P99, QPS, memory, ...) with their ages
GET  /decisions                  recent routing decisions (weights, ejections, returns) and why
POST /endpoints/HOST:PORT        {"weight": 9} and/or {"health": "DRAINING"|"HEALTHY"|...};
                                 {"weight": null, "health": null} clears the override
GET  /canaries                   every canary run: status, percent, reason, each step's record
GET  /ui                         the live mesh view (a page; static files from control_plane/ui)
GET  /ui/config                  what the page may do: {"actions": true} only with a token set
GET  /events                     server-sent events for the page: "history" once, then a
                                 "frame" a second (control_plane/live_view.py)
POST /models/NAME/split          {"1": 90, "2": 10}: the model's version split from now on;
                                 {} goes back to the topology's (aborts a running canary)
POST /models/NAME/canary         {"version": "2"} starts an SLO-gated canary of version 2 against
                                 the stable version (default: the one with the most weight now);
                                 optional "stable" and any canary policy field ("steps",
                                 "dwell_s", ...); {"abort": true} stops it at 0%

With an admin token (``--admin-token-file``) every POST needs ``Authorization: Bearer TOKEN``
(401 otherwise) and the page offers its actions; without one the page is read-only and POSTs
are open to whoever reaches the admin port, which binds loopback unless the topology says
otherwise.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.resources
import json
import logging
import re
import threading
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from control_plane.live_view import LiveFeed

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 * 1024
MAX_EVENT_STREAMS = 16  # open pages; each holds one HTTP thread
EVENT_KEEPALIVE_S = 15.0  # a comment line when no frame came, so proxies keep the stream
UI_FILES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
            "style.css": "text/css; charset=utf-8"}  # fmt: skip


class AdminError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


StatusFn = Callable[[], Awaitable[dict[str, Any]]]
OverrideFn = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]
# POST routes: a path pattern with one group (the endpoint or model) and what handles it.
PostRoutes = Sequence[tuple[str, OverrideFn]]


class AdminServer:
    """``gets`` maps a path ("/status") to its handler; ``posts`` are (pattern, handler)."""

    def __init__(
        self,
        host: str,
        port: int,
        loop: asyncio.AbstractEventLoop,
        registry: CollectorRegistry,
        gets: Mapping[str, StatusFn],
        posts: PostRoutes,
        live: LiveFeed | None = None,
        token: str | None = None,
    ) -> None:
        admin = self
        streams = threading.BoundedSemaphore(MAX_EVENT_STREAMS)

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                log.debug("admin: " + format, *args)

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0].rstrip("/") or "/"
                if path == "/ui" or path.startswith("/ui/"):
                    self._ui(path.removeprefix("/ui").lstrip("/") or "index.html")
                elif path == "/events" and live is not None:
                    self._events(live)
                elif path == "/metrics":
                    self._send(HTTPStatus.OK, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path in gets:
                    self._json(HTTPStatus.OK, admin._call(gets[path]()))
                elif path == "/healthz":
                    body = admin._call(gets["/status"]())
                    ok = bool(body.get("snapshot"))
                    self._json(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE, {"ok": ok})
                else:
                    self._json(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path}"})

            def do_POST(self) -> None:
                try:
                    if token is not None and not _bearer_matches(self.headers, token):
                        raise AdminError(
                            HTTPStatus.UNAUTHORIZED,
                            "this control plane needs 'Authorization: Bearer TOKEN' for changes",
                        )
                    route = next(
                        ((m, fn) for p, fn in posts if (m := re.fullmatch(p, self.path))), None
                    )
                    if route is None:
                        raise AdminError(HTTPStatus.NOT_FOUND, f"no such path {self.path}")
                    length = int(self.headers.get("content-length") or 0)
                    if length > MAX_BODY_BYTES:
                        raise AdminError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "body too large")
                    try:
                        body = json.loads(self.rfile.read(length) or b"{}")
                    except json.JSONDecodeError as exc:
                        raise AdminError(
                            HTTPStatus.BAD_REQUEST, f"body is not JSON: {exc}"
                        ) from exc
                    if not isinstance(body, dict):
                        raise AdminError(HTTPStatus.BAD_REQUEST, "body must be a JSON object")
                    match, handler = route
                    # Percent-decoded: a browser sends "127.0.0.1%3A8001" for an endpoint.
                    target = urllib.parse.unquote(match.group(1))
                    self._json(HTTPStatus.OK, admin._call(handler(target, body)))
                except AdminError as exc:
                    self._json(exc.status, {"error": str(exc)})

            def _ui(self, name: str) -> None:
                if name == "config":
                    self._json(HTTPStatus.OK, {"actions": token is not None})
                    return
                if name not in UI_FILES:
                    self._json(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path}"})
                    return
                data = (importlib.resources.files("control_plane") / "ui" / name).read_bytes()
                self._send(HTTPStatus.OK, data, UI_FILES[name])

            def _events(self, feed: LiveFeed) -> None:
                """Server-sent events until the page goes: the history, then each frame."""
                if not streams.acquire(blocking=False):
                    message = f"at most {MAX_EVENT_STREAMS} live views at once"
                    self._json(HTTPStatus.SERVICE_UNAVAILABLE, {"error": message})
                    return
                try:
                    with feed.watching():
                        self._stream(feed)
                except (BrokenPipeError, ConnectionResetError, TimeoutError):
                    pass  # the page went away
                finally:
                    streams.release()

            def _stream(self, feed: LiveFeed) -> None:
                self.send_response(HTTPStatus.OK)
                self.send_header("content-type", "text/event-stream")
                self.send_header("cache-control", "no-cache")
                self.end_headers()
                sequence, opening = feed.opening()
                self._event("history", opening, retry_ms=1000)
                while not admin.stopping.is_set():
                    sequence, frame = feed.next_frame(sequence, EVENT_KEEPALIVE_S)
                    if frame is None:
                        self.wfile.write(b": keep-alive\n\n")
                        self.wfile.flush()
                    else:
                        self._event("frame", frame)

            def _event(self, name: str, body: Any, retry_ms: int | None = None) -> None:
                retry = f"retry: {retry_ms}\n" if retry_ms is not None else ""
                data = json.dumps(body, separators=(",", ":"))
                self.wfile.write(f"{retry}event: {name}\ndata: {data}\n\n".encode())
                self.wfile.flush()

            def _json(self, status: HTTPStatus, body: Any) -> None:
                data = json.dumps(body, indent=2, sort_keys=True).encode()
                self._send(status, data, "application/json")

            def _send(self, status: HTTPStatus, data: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.loop = loop
        self.stopping = threading.Event()
        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def _call(self, coro: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)  # type: ignore[arg-type]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self._thread.is_alive():  # shutdown() waits for serve_forever, which never started
            self.httpd.shutdown()
        self.httpd.server_close()


def _bearer_matches(headers: Any, token: str) -> bool:
    scheme, _, given = str(headers.get("authorization") or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip(), token)
