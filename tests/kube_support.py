"""A fake Kubernetes API server for tests: EndpointSlices of one namespace, served over real HTTP
with LIST and WATCH (resourceVersions, bookmarks, 410 Gone), as ``discovery.kubernetes`` reads
them."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import urllib.parse
import urllib.request
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

READY = {"ready": True, "serving": True, "terminating": False}


class FakeKubeApi:
    """EndpointSlices of one namespace, with the history a watch resumes from."""

    def __init__(self, token: str = "secret-token") -> None:
        self.token = token
        self.slices: dict[str, dict[str, Any]] = {}
        self.history: list[tuple[int, dict[str, Any]]] = []  # (resourceVersion, event)
        self.rv = 100
        self.compacted = 0  # a watch from a resourceVersion below this gets 410 Gone
        self.generation = 0  # drop_watches() bumps it: open watches are cut (or ended)
        self.clean_end = False
        self.short_watches = False  # every watch ends at once, with no event (a bad proxy)
        self.requests: list[tuple[str, str]] = []  # (path and query, Authorization)
        self.cond = threading.Condition()
        self.closed = False
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeKubeApi:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)

    def apply(self, item: dict[str, Any]) -> None:
        with self.cond:
            name = item["metadata"]["name"]
            self._record("MODIFIED" if name in self.slices else "ADDED", item)
            self.slices[name] = item

    def delete(self, name: str) -> None:
        with self.cond:
            self._record("DELETED", self.slices.pop(name))

    def send(self, event: dict[str, Any]) -> None:
        """A raw event (BOOKMARK, ERROR) to the open watches."""
        with self.cond:
            self.rv += 1
            self.history.append((self.rv, event))
            self.cond.notify_all()

    def expire(self) -> None:
        """Compacts the history: a watch resuming from before now gets 410 Gone."""
        with self.cond:
            self.rv += 1
            self.compacted = self.rv

    def drop_watches(self, clean: bool = False) -> None:
        """Cuts the open watches, or with ``clean`` ends them (as ``timeoutSeconds`` does)."""
        with self.cond:
            self.generation += 1
            self.clean_end = clean
            self.cond.notify_all()

    def count(self, fragment: str) -> int:
        with self.cond:
            return sum(fragment in path for path, _ in self.requests)

    def lists(self) -> int:
        with self.cond:
            return sum("watch=1" not in path for path, _ in self.requests)

    def news(self, since: int, generation: int) -> bool:
        """Whether an open watch has something to do (called holding the lock)."""
        return (
            self.closed
            or self.generation != generation
            or any(rv > since for rv, _ in self.history)
        )

    def _record(self, kind: str, item: dict[str, Any]) -> None:
        self.rv += 1
        item = json.loads(json.dumps(item))
        item["metadata"]["resourceVersion"] = str(self.rv)
        self.history.append((self.rv, {"type": kind, "object": item}))
        self.cond.notify_all()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def handle(self) -> None:
                with contextlib.suppress(ConnectionError):  # a client that went away
                    super().handle()

            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(url.query))
                with api.cond:
                    api.requests.append((self.path, self.headers.get("Authorization", "")))
                    token = api.token
                if self.headers.get("Authorization") != f"Bearer {token}":
                    return self._json(401, {"kind": "Status", "code": 401})
                wanted = f"{PREFIX}test/endpointslices"
                selector = "kubernetes.io/service-name=model-server"
                if url.path != wanted or query.get("labelSelector") != selector:
                    return self._json(404, {"kind": "Status", "code": 404})
                if query.get("watch") == "1":
                    return self._watch(int(query.get("resourceVersion") or 0))
                with api.cond:
                    items, rv = list(api.slices.values()), api.rv
                body = {"kind": "EndpointSliceList", "metadata": {"resourceVersion": str(rv)}}
                return self._json(200, {**body, "items": items})

            def _json(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _watch(self, since: int) -> None:
                with api.cond:
                    if since < api.compacted:
                        return self._json(410, {"kind": "Status", "code": 410})
                    generation = api.generation
                    short = api.short_watches
                if short:
                    return self._json(200, {})  # a body of no event: the watch is over
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.wfile.flush()
                while True:
                    with api.cond:
                        api.cond.wait_for(partial(api.news, since, generation), timeout=0.5)
                        if api.closed or api.generation != generation:
                            clean = api.clean_end and not api.closed
                            break
                        pending = [(rv, e) for rv, e in api.history if rv > since]
                    for rv, event in pending:
                        data = json.dumps(event).encode() + b"\n"
                        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                        self.wfile.flush()
                        since = rv
                self.close_connection = True
                if clean:  # the last chunk: the watch is over, the connection fine
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                    return
                # Cut without the terminating chunk, as when the API server goes away.
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)

        return Handler


PREFIX = "/apis/discovery.k8s.io/v1/namespaces/"
