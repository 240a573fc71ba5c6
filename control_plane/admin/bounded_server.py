"""The admin's HTTP server with a cap on the connections it serves at once.

``ThreadingHTTPServer`` starts a thread for every connection it accepts, without limit: a
client that opens connections and sends nothing (slowloris) would pile up threads. This one
serves at most ``max_connections`` at once; past that it closes a new connection as soon as it
is accepted, and a connection's slot is free again when its thread ends. The handler's own
timeout (``Handler.timeout``) bounds how long a served connection may stall.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)
WARN_EVERY_S = 60.0  # refusals are logged at most this often


class BoundedHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: Any, max_connections: int) -> None:
        super().__init__(address, handler)
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._warned = -math.inf

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, request: socket.socket) -> None:
        now = time.monotonic()
        if now - self._warned >= WARN_EVERY_S:
            self._warned = now
            log.warning(
                "admin: %d connections open, the most it serves at once: closing new ones "
                "until some end (logged at most once a minute)",
                self.max_connections,
            )
        self.shutdown_request(request)
