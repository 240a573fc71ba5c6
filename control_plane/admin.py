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
POST /models/NAME/split          {"1": 90, "2": 10}: the model's version split from now on;
                                 {} goes back to the topology's
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from collections.abc import Awaitable, Callable
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


class AdminServer:
    def __init__(
        self,
        host: str,
        port: int,
        loop: asyncio.AbstractEventLoop,
        registry: CollectorRegistry,
        status: StatusFn,
        override: OverrideFn,
        telemetry: StatusFn,
        decisions: StatusFn,
        set_split: OverrideFn,
    ) -> None:
        admin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                log.debug("admin: " + format, *args)

            def do_GET(self) -> None:
                if self.path == "/metrics":
                    self._send(HTTPStatus.OK, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif self.path in ("/decisions", "/decisions/"):
                    self._json(HTTPStatus.OK, admin._call(decisions()))
                elif self.path in ("/telemetry", "/telemetry/"):
                    self._json(HTTPStatus.OK, admin._call(telemetry()))
                elif self.path in ("/status", "/status/"):
                    self._json(HTTPStatus.OK, admin._call(status()))
                elif self.path == "/healthz":
                    body = admin._call(status())
                    ok = bool(body.get("snapshot"))
                    self._json(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE, {"ok": ok})
                else:
                    self._json(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path}"})

            def do_POST(self) -> None:
                try:
                    split = re.fullmatch(r"/models/([^/]+)/split", self.path)
                    if not self.path.startswith("/endpoints/") and split is None:
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
                    if split is not None:
                        self._json(HTTPStatus.OK, admin._call(set_split(split.group(1), body)))
                        return
                    key = self.path.removeprefix("/endpoints/")
                    self._json(HTTPStatus.OK, admin._call(override(key, body)))
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
