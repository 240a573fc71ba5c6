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
POST /models/NAME/split          {"1": 90, "2": 10}: the model's version split from now on;
                                 {} goes back to the topology's (aborts a running canary)
POST /models/NAME/canary         {"version": "2"} starts an SLO-gated canary of version 2 against
                                 the stable version (default: the one with the most weight now);
                                 optional "stable" and any canary policy field ("steps",
                                 "dwell_s", ...); {"abort": true} stops it at 0%
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 * 1024


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
    ) -> None:
        admin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                log.debug("admin: " + format, *args)

            def do_GET(self) -> None:
                path = self.path.rstrip("/") or "/"
                if path == "/metrics":
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
                    self._json(HTTPStatus.OK, admin._call(handler(match.group(1), body)))
                except AdminError as exc:
                    self._json(exc.status, {"error": str(exc)})

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
        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def _call(self, coro: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)  # type: ignore[arg-type]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
