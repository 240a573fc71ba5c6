"""The control plane's admin HTTP: status as JSON, Prometheus metrics, and operator overrides.

It runs in a thread (http.server) and hands every request to the event loop, so it reads and
changes state exactly where the rest of the control plane does.

GET  /status                     endpoints, clusters, snapshot versions, Envoy nodes (JSON)
GET  /metrics                    Prometheus text
GET  /healthz                    200 once a snapshot is set (a cheap check: open to anyone, it
                                 never builds the status)
GET  /telemetry                  every endpoint's signals (P99, QPS, memory, ...) with their ages
GET  /decisions                  recent routing decisions (weights, ejections, returns) and why
POST /endpoints/HOST:PORT        {"weight": 9} and/or {"health": "DRAINING"|"HEALTHY"|...};
                                 {"weight": null, "health": null} clears the override
GET  /canaries                   every canary run: status, percent, reason, each step's record
GET  /ui                         the live mesh view (a page; static files from control_plane/ui)
GET  /ui/config                  what the page may do: {"actions": true} only with a token set
GET  /events                     server-sent events for the page: "history" once, then a
                                 "frame" a second (control_plane/admin/live_view.py)
POST /models/NAME/split          {"1": 90, "2": 10}: the model's version split from now on;
                                 {} goes back to the topology's (aborts a running canary)
POST /models/NAME/canary         {"version": "2"} starts an SLO-gated canary of version 2 against
                                 the stable version (default: the one with the most weight now);
                                 optional "stable" and any canary policy field ("steps",
                                 "dwell_s", ...); {"abort": true} stops it at 0%

Two tokens (``AdminTokens``):
- **write** (``--admin-token-file``): every POST needs ``Authorization: Bearer TOKEN`` (401
  without a credential, 403 with the read token), and the page offers its actions. Without
  one the page is read-only and POSTs are open to whoever reaches the port.
- **read** (``--admin-read-token-file``): every GET of state (``/status``, ``/telemetry``,
  ``/decisions``, ``/canaries``, ``/ui``, ``/events``) needs the read or the write token, as
  a bearer token or as the password of HTTP Basic (so a browser prompts for it: the 401 says
  ``WWW-Authenticate: Basic``). ``/healthz`` and ``/metrics`` stay open to probes and scrapers.
The admin binds loopback unless the topology says otherwise, and the control plane refuses to
bind it anywhere else without both tokens (``check_exposure``).
"""

from __future__ import annotations

import asyncio
import importlib.resources
import json
import logging
import re
import threading
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Future
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from control_plane.admin.bounded_server import BoundedHTTPServer
from control_plane.admin.live_view import LiveFeed
from control_plane.admin.tokens import AdminTokens, bearer_token, presented_token
from infermesh.addresses import is_loopback

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 * 1024
CALL_TIMEOUT_S = 10.0  # the most a request waits for the event loop (then 503)
# Each read of a request (line, headers, body) and each write of an answer, a live view's
# frames included, may stall this long; then the connection is closed and its slot freed.
REQUEST_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64  # served at once, live views included; more are closed when accepted
MAX_EVENT_STREAMS = 16  # open pages; each holds one HTTP thread (of MAX_CONNECTIONS)
EVENT_KEEPALIVE_S = 15.0  # a comment line when no frame came, so proxies keep the stream
UI_FILES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
            "style.css": "text/css; charset=utf-8"}  # fmt: skip


OPEN_PATHS = ("/healthz", "/metrics")  # probes and scrapers; nothing in them is a secret
BASIC_REALM = 'Basic realm="infermesh admin", charset="UTF-8"'


class AdminError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


def body_length(headers: Any) -> int:
    """A change's body length: one Content-Length of decimal digits, at most MAX_BODY_BYTES.
    Any Transfer-Encoding is refused: this server decodes none, and a chunked body taken as
    empty would be ``{}`` (which resets a split)."""
    if headers.get("transfer-encoding") is not None:
        raise AdminError(
            HTTPStatus.NOT_IMPLEMENTED,
            "Transfer-Encoding is not accepted here: send the body with a Content-Length",
        )
    given = headers.get_all("content-length") or []
    if not given:
        raise AdminError(HTTPStatus.LENGTH_REQUIRED, "a change needs a Content-Length header")
    digits = given[0].strip()
    if len(given) > 1 or not re.fullmatch(r"[0-9]+", digits):
        message = "Content-Length must be one non-negative decimal integer"
        raise AdminError(HTTPStatus.BAD_REQUEST, message)
    significant = digits.lstrip("0") or "0"
    if len(significant) > 9 or int(significant) > MAX_BODY_BYTES:  # int() of a few digits only
        message = f"body too large: at most {MAX_BODY_BYTES} bytes"
        raise AdminError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, message)
    return int(significant)


StatusFn = Callable[[], Awaitable[dict[str, Any]]]
HealthyFn = Callable[[], Awaitable[bool]]
OverrideFn = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]
# POST routes: a path pattern with one group (the endpoint or model) and what handles it.
PostRoutes = Sequence[tuple[str, OverrideFn]]


class AdminServer:
    """``gets`` maps a path ("/status") to its handler; ``posts`` are (pattern, handler);
    ``healthy`` is what /healthz asks, and must stay cheap: anyone may ask it, often."""

    def __init__(
        self,
        host: str,
        port: int,
        loop: asyncio.AbstractEventLoop,
        registry: CollectorRegistry,
        gets: Mapping[str, StatusFn],
        posts: PostRoutes,
        healthy: HealthyFn,
        live: LiveFeed | None = None,
        tokens: AdminTokens | None = None,
    ) -> None:
        guard = tokens or AdminTokens()
        admin = self
        local = is_loopback(host)
        streams = threading.BoundedSemaphore(MAX_EVENT_STREAMS)

        class Handler(BaseHTTPRequestHandler):
            timeout = REQUEST_TIMEOUT_S  # the socket's: a client that stalls is let go

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("admin: " + format, *args)

            def _foreign_host(self) -> bool:
                """On loopback, a request whose Host names anything else came through a name
                that rebinds to 127.0.0.1 (a page elsewhere reading the state): refused."""
                named = str(self.headers.get("host") or "")
                name = named.rsplit(":", 1)[0] if named.count(":") == 1 else named
                if not local or is_loopback(name.removeprefix("[").split("]")[0]):
                    return False
                self._json(
                    HTTPStatus.MISDIRECTED_REQUEST,
                    {"error": f"this admin binds loopback and answers to a loopback Host only, "
                              f"got {named[:80]!r}"},
                )  # fmt: skip
                return True

            def do_GET(self) -> None:
                self._answer(self._get)

            def do_POST(self) -> None:
                self._answer(self._post)

            def _answer(self, handle: Callable[[], None]) -> None:
                """Every request gets an answer: a refusal's, or 500 for anything else (its
                traceback to the log; its text, which may carry a secret, never to the client)."""
                try:
                    handle()
                except AdminError as exc:
                    self._json(exc.status, {"error": str(exc)})
                except (BrokenPipeError, ConnectionResetError, TimeoutError):
                    # The client went or stopped reading (waits for the loop are AdminErrors and
                    # no route talks to the network): nobody is left to answer.
                    self.close_connection = True
                except Exception:
                    path = self.path.split("?", 1)[0][:200]
                    log.exception("admin: %s %r failed", self.command, path)
                    self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "internal error"})

            def _get(self) -> None:
                if self._foreign_host():
                    return
                path = self.path.split("?", 1)[0].rstrip("/") or "/"
                if path not in OPEN_PATHS and not guard.may_read(presented_token(self.headers)):
                    self._json(
                        HTTPStatus.UNAUTHORIZED,
                        {"error": "this control plane's admin needs the read (or write) token: "
                                  "'Authorization: Bearer TOKEN' or HTTP Basic"},
                        {"www-authenticate": BASIC_REALM},
                    )  # fmt: skip
                    return
                if path == "/ui" or path.startswith("/ui/"):
                    self._ui(path.removeprefix("/ui").lstrip("/") or "index.html")
                elif path == "/events" and live is not None:
                    self._events(live)
                elif path == "/metrics":
                    self._send(HTTPStatus.OK, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path in gets:
                    self._json(HTTPStatus.OK, admin._call(gets[path]()))
                elif path == "/healthz":
                    ok = bool(admin._call(healthy()))
                    self._json(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE, {"ok": ok})
                else:
                    self._json(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path}"})

            def _post(self) -> None:
                if self._foreign_host():
                    return
                # Changes take the token as Bearer only, with a JSON Content-Type: a page
                # elsewhere can send neither without a CORS preflight this server never
                # answers, while a browser resends cached Basic credentials with any form
                # (CSRF on splits, canaries and drains).
                given = bearer_token(self.headers)
                if not guard.may_write(given):
                    if guard.is_read_token(given):
                        raise AdminError(
                            HTTPStatus.FORBIDDEN, "the read token cannot change anything"
                        )
                    raise AdminError(
                        HTTPStatus.UNAUTHORIZED,
                        "this control plane needs 'Authorization: Bearer TOKEN' (the write "
                        "token) for changes; HTTP Basic is for reading only",
                    )
                media = str(self.headers.get("content-type") or "").split(";")[0]
                if media.strip().lower() != "application/json":
                    raise AdminError(
                        HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                        f"changes need 'Content-Type: application/json', got {media[:60]!r}",
                    )
                route = next(
                    ((m, fn) for p, fn in posts if (m := re.fullmatch(p, self.path))), None
                )
                if route is None:
                    raise AdminError(HTTPStatus.NOT_FOUND, f"no such path {self.path}")
                length = body_length(self.headers)
                try:
                    data = self.rfile.read(length)
                except TimeoutError:
                    message = f"the body did not arrive within {REQUEST_TIMEOUT_S:g} s"
                    raise AdminError(HTTPStatus.REQUEST_TIMEOUT, message) from None
                if len(data) < length:
                    raise AdminError(HTTPStatus.BAD_REQUEST, "the body ended before Content-Length")
                try:
                    body = json.loads(data or b"{}")
                except json.JSONDecodeError as exc:
                    raise AdminError(HTTPStatus.BAD_REQUEST, f"body is not JSON: {exc}") from exc
                if not isinstance(body, dict):
                    raise AdminError(HTTPStatus.BAD_REQUEST, "body must be a JSON object")
                match, handler = route
                # Percent-decoded: a browser sends "127.0.0.1%3A8001" for an endpoint.
                target = urllib.parse.unquote(match.group(1))
                self._json(HTTPStatus.OK, admin._call(handler(target, body)))

            def _ui(self, name: str) -> None:
                if name == "config":
                    self._json(HTTPStatus.OK, {"actions": guard.write is not None})
                    return
                if name not in UI_FILES:
                    self._json(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path}"})
                    return
                data = (importlib.resources.files("control_plane.admin") / "ui" / name).read_bytes()
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
                # Waiting for a frame reads nothing from the socket, so the read timeout never
                # ends a healthy stream; a write a page does not read within the timeout
                # raises TimeoutError, which ends the stream and frees its slot (_events).
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

            def _json(
                self, status: HTTPStatus, body: Any, headers: Mapping[str, str] | None = None
            ) -> None:
                data = json.dumps(body, indent=2, sort_keys=True).encode()
                self._send(status, data, "application/json", headers)

            def _send(
                self,
                status: HTTPStatus,
                data: bytes,
                content_type: str,
                headers: Mapping[str, str] | None = None,
            ) -> None:
                self.send_response(status)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.loop = loop
        self.stopping = threading.Event()
        self.httpd = BoundedHTTPServer((host, port), Handler, MAX_CONNECTIONS)
        self.port = int(self.httpd.server_address[1])
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def _call(self, coro: Awaitable[Any]) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        try:
            return future.result(timeout=CALL_TIMEOUT_S)
        except TimeoutError:  # a busy loop: the client still gets an answer
            raise AdminError(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"the control plane's event loop did not answer within {CALL_TIMEOUT_S:g} s "
                "(a change asked for may still be made)",
            ) from None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self._thread.is_alive():  # shutdown() waits for serve_forever, which never started
            self.httpd.shutdown()
        self.httpd.server_close()
