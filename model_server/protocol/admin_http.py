"""The admin HTTP endpoint on --metrics-port: GET /metrics and, when enabled, /faults."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from model_server.core.faults import FaultError, FaultInjector
from model_server.core.validation import is_decimal

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024


class AdminServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        registry: CollectorRegistry,
        faults: FaultInjector,
        before_scrape: Callable[[], None] | None = None,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        self.registry = registry
        self.faults = faults
        self.before_scrape = before_scrape
        self.ready = ready
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: AdminServer

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("admin http: " + format, *args)

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, payload: object) -> None:
        self._send(status, json.dumps(payload).encode() + b"\n", "application/json")

    def _path(self) -> str:
        return self.path.split("?", 1)[0].rstrip("/") or "/"

    def do_GET(self) -> None:
        path = self._path()
        if path == "/metrics":
            if self.server.before_scrape is not None:
                try:
                    self.server.before_scrape()
                except Exception:  # a failed refresh still serves the last values
                    log.exception("admin http: refreshing metrics before a scrape failed")
            self._send(200, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)
        elif path == "/ready" and self.server.ready is not None:
            # Plaintext readiness for probes that cannot speak the mesh's mutual TLS (the
            # kubelet's): the gRPC health service is on the TLS port, for mesh identities.
            ready = self.server.ready()
            self._json(200 if ready else 503, {"ready": ready})
        elif path == "/faults":
            if self._faults_enabled():
                self._json(200, self.server.faults.current.as_dict())
        else:
            self._json(404, {"error": f"no such path {path!r} (try /metrics)"})

    def do_POST(self) -> None:
        path = self._path()
        if path != "/faults":
            self._json(404, {"error": f"no such path {path!r}"})
            return
        if not self._faults_enabled():
            return
        given = str(self.headers.get("Content-Length") or "0").strip()
        if not is_decimal(given):  # int() would raise on "x" and read to EOF on "-1"
            self._json(400, {"error": f"Content-Length: expected a byte count, got {given!r}"})
            return
        length = int(given)
        if length > MAX_BODY_BYTES:
            self._json(413, {"error": f"body: larger than {MAX_BODY_BYTES} bytes"})
            return
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw or b"{}")
        except ValueError as exc:
            self._json(400, {"error": f"body: not valid JSON: {exc}"})
            return
        try:
            current = self.server.faults.apply(body)
        except FaultError as exc:
            self._json(400, {"error": str(exc)})
            return
        self._json(200, current.as_dict())

    def _faults_enabled(self) -> bool:
        if self.server.faults.enabled:
            return True
        self._json(
            404,
            {"error": "fault injection is off: start the server with --enable-fault-injection"},
        )
        return False


def start_admin_server(
    host: str,
    port: int,
    registry: CollectorRegistry,
    faults: FaultInjector,
    before_scrape: Callable[[], None] | None = None,
    ready: Callable[[], bool] | None = None,
) -> AdminServer:
    """Starts the endpoint on a daemon thread; ``shutdown()`` and ``server_close()`` stop it.
    ``ready``: GET /ready answers 200 while it is true, else 503."""
    httpd = AdminServer((host, port), registry, faults, before_scrape, ready)
    thread = threading.Thread(target=httpd.serve_forever, name="admin-http", daemon=True)
    thread.start()
    return httpd
