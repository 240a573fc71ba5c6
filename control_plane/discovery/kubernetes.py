"""Model servers from a Kubernetes Service: an EndpointSlice watch through the Kubernetes API.

The source (``endpoints: - kubernetes: {...}``) is parsed by ``config.kubernetes_source``.

The API server is the in-cluster one (``KUBERNETES_SERVICE_HOST``/``_PORT``, the service
account's token, re-read on every connection, and CA) unless ``INFERMESH_KUBERNETES_API`` names
another (``http://127.0.0.1:8001`` for ``kubectl proxy``, or a test's fake), with optional
``INFERMESH_KUBERNETES_TOKEN_FILE``, ``INFERMESH_KUBERNETES_CA_FILE`` and
``INFERMESH_KUBERNETES_INSECURE=1`` (no TLS verification).

Protocol: LIST the slices labelled ``kubernetes.io/service-name=SERVICE`` for a
resourceVersion, then WATCH from it (bookmarks on; a watch the server ends is resumed). A 410
Gone or an ERROR event re-lists at once; a dropped connection or a failed request starts over
(LIST, WATCH) after a capped exponential back-off, logged once when it starts failing and once
when it recovers; the last known addresses are kept meanwhile. An endpoint is
routed to when ``conditions.ready`` is not false and ``conditions.terminating`` is not true:
a terminating pod that is still ``serving`` is draining its in-flight work and gets no new
requests. Of an endpoint's (fungible) addresses the first is used. An endpoint's ``targetRef``
(a Pod) is kept with its address: with mutual TLS the server's certificate names its pod
(``pki.model_server_pod``), and the control plane checks it by that name (``ServerPods``). The
names are as trustworthy as the API server that gave them. Only the standard library.

Why it is one module of this length: LIST and WATCH, resumption, back-off and the HTTP client
are one protocol with the API server; only the standard library is used, so the client is here
too.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import re
import ssl
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from control_plane.config.kubernetes_source import (
    NAMESPACE_NAME,
    SERVICE_ACCOUNT,
    KubernetesEndpoint,
)
from control_plane.discovery.pod_addresses import api_on_loopback, pod_address
from control_plane.model.mesh import EndpointAddress
from control_plane.model.schema import show

log = logging.getLogger(__name__)
T = TypeVar("T")

CONNECT_TIMEOUT_S = 10.0
LIST_TIMEOUT_S = 30.0
WATCH_TIMEOUT_S = 300  # the API server ends a watch after this; it is then resumed at once
WATCH_IDLE_S = WATCH_TIMEOUT_S + 30.0  # nothing at all for this long: the connection is dead
# A watch that ends sooner with no event is a failure (as client-go treats it): resumed at
# once, an API server or proxy that closes watches at once would get a request a turn.
MIN_WATCH_S = 1.0
MAX_BODY_BYTES = 64 * 1024 * 1024
_POD_NAME = re.compile(r"[a-z0-9]([-.a-z0-9]{0,251}[a-z0-9])?")  # DNS-1123 subdomain


def slice_addresses(
    item: Mapping[str, Any], port: str | int, allow_loopback: bool = False
) -> dict[EndpointAddress, str]:
    """The routable addresses of one EndpointSlice object on the named or numbered port, each
    with the pod behind it (``NAMESPACE/POD`` from its ``targetRef``; "" when it names none):
    a model server's certificate names its pod (``pki.model_server_pod``). Addresses no pod
    serves from are left out (``pod_address``)."""
    if item.get("addressType") not in ("IPv4", "IPv6"):
        return {}  # FQDN slices: not addresses Envoy can take as they are
    ports = [p for p in item.get("ports") or () if p.get("protocol", "TCP") == "TCP"]
    if isinstance(port, str):
        number = next((p.get("port") for p in ports if p.get("name", "") == port), None)
    elif any(p.get("port") == port for p in ports) or not item.get("ports"):
        number = port
    else:
        number = None
    if not isinstance(number, int):
        return {}
    namespace = str((item.get("metadata") or {}).get("namespace", ""))
    found = {}
    for endpoint in item.get("endpoints") or ():
        conditions = endpoint.get("conditions") or {}
        if conditions.get("ready") is False or conditions.get("terminating") is True:
            continue
        with contextlib.suppress(IndexError, TypeError, ValueError):
            ip = ipaddress.ip_address(endpoint["addresses"][0])
            if not pod_address(ip, allow_loopback, item):
                continue
            found[EndpointAddress(str(ip), number)] = _pod(endpoint.get("targetRef"), namespace)
    return found


def _pod(target: object, namespace: str) -> str:
    """``NAMESPACE/POD`` of an endpoint's targetRef when it is a pod with a legal name."""
    if not isinstance(target, Mapping) or target.get("kind") != "Pod":
        return ""
    name, ns = target.get("name"), target.get("namespace") or namespace
    legal = isinstance(name, str) and _POD_NAME.fullmatch(name)
    return f"{ns}/{name}" if legal and isinstance(ns, str) and NAMESPACE_NAME.fullmatch(ns) else ""


@dataclass(frozen=True)
class ApiConfig:
    url: str  # scheme://host:port
    token_file: Path | None = None
    ca_file: Path | None = None
    insecure: bool = False

    @staticmethod
    def from_environment(env: Mapping[str, str] | None = None) -> ApiConfig | None:
        """The override variables if set, else in-cluster; None outside a cluster."""
        env = os.environ if env is None else env
        if url := env.get("INFERMESH_KUBERNETES_API", ""):
            token, ca = (env.get(f"INFERMESH_KUBERNETES_{k}_FILE", "") for k in ("TOKEN", "CA"))
            insecure = env.get("INFERMESH_KUBERNETES_INSECURE", "") in ("1", "true", "yes")
            return ApiConfig(
                url.rstrip("/"), Path(token) if token else None, Path(ca) if ca else None, insecure
            )
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            return None
        host = f"[{host}]" if ":" in host else host
        return ApiConfig(
            f"https://{host}:{port}", SERVICE_ACCOUNT / "token", SERVICE_ACCOUNT / "ca.crt"
        )


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class _Gone(Exception):
    """The resourceVersion is too old (410, as an answer or an ERROR event): list again."""


@dataclass(frozen=True)
class Backoff:
    initial_s: float = 0.5
    max_s: float = 30.0


class SliceWatcher:
    """Keeps the current address set of one ``KubernetesEndpoint``; calls ``on_change``."""

    def __init__(
        self,
        source: KubernetesEndpoint,
        config: ApiConfig | None,
        on_change: Callable[[], None],
        backoff: Backoff = Backoff(),
    ) -> None:
        self.source, self.config, self.on_change, self.backoff = source, config, on_change, backoff
        self.allow_loopback = config is not None and api_on_loopback(config.url)
        self.slices: dict[str, dict[EndpointAddress, str]] = {}
        self.addresses: frozenset[EndpointAddress] = frozenset()
        self.pods: dict[str, str] = {}  # HOST:PORT -> NAMESPACE/POD
        self.synced = asyncio.Event()  # set by the first successful LIST
        self.resource_version = ""
        self.events = 0  # watch events taken in (ERROR events aside)
        self.failing = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task})  # a cancellation of the caller still propagates

    async def _run(self) -> None:
        delay = self.backoff.initial_s
        while True:
            listed_at = 0.0
            try:
                await self._list()
                listed_at = time.monotonic()
                self._recovered()
                while True:
                    started, events = time.monotonic(), self.events
                    await self._watch()  # returns when the server ends the watch: resume
                    if self.events == events and time.monotonic() - started < MIN_WATCH_S:
                        raise ApiError(200, "the watch ended at once with no event")
                    delay = self.backoff.initial_s  # a watch that worked: back-off over
            except _Gone:
                if time.monotonic() - listed_at > 1.0:
                    continue  # list again at once; but never in a tight loop:
                self._failed(ApiError(410, "Gone right after a LIST"))
            except Exception as exc:  # I/O, HTTP, or a malformed answer: never die, back off
                self._failed(exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.backoff.max_s)

    def _failed(self, exc: Exception) -> None:
        if not self.failing:
            self.failing = True
            log.warning(
                "endpoint %s: Kubernetes API failing, retrying with back-off (keeping %d "
                "addresses): %s: %s", self.source.key, len(self.addresses), type(exc).__name__, exc,
            )  # fmt: skip
        else:
            log.debug("endpoint %s: still failing: %r", self.source.key, exc)

    def _recovered(self) -> None:
        if self.failing:
            self.failing = False
            log.info("endpoint %s: Kubernetes API reachable again", self.source.key)

    def _path(self, **params: str) -> str:
        ns, service = self.source.namespace, self.source.service
        query = {"labelSelector": f"kubernetes.io/service-name={service}", **params}
        return (
            f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?"
            f"{urllib.parse.urlencode(query)}"
        )

    async def _list(self) -> None:
        try:
            async with _request(self.config, self._path(), LIST_TIMEOUT_S) as response:
                body = await _within(response.body(), LIST_TIMEOUT_S)
        except _Gone:  # a LIST has no resourceVersion to be too old: a failure, back off
            raise ApiError(410, "Gone (on a LIST)") from None
        data = json.loads(body)
        self.resource_version = str(data.get("metadata", {}).get("resourceVersion", ""))
        self.slices = {
            str(item.get("metadata", {}).get("name", "")): slice_addresses(
                item, self.source.port, self.allow_loopback
            )
            for item in data.get("items") or ()
        }
        self._publish()
        self.synced.set()

    async def _watch(self) -> None:
        path = self._path(
            watch="1", resourceVersion=self.resource_version, allowWatchBookmarks="true",
            timeoutSeconds=str(WATCH_TIMEOUT_S),
        )  # fmt: skip
        async with _request(self.config, path, CONNECT_TIMEOUT_S) as response:
            async for line in response.lines(WATCH_IDLE_S):
                if line.strip():
                    self._event(json.loads(line))

    def _event(self, event: Mapping[str, Any]) -> None:
        kind, item = event.get("type"), event.get("object") or {}
        metadata = item.get("metadata") or {}
        if kind == "ERROR":  # a Status: 410 lists again at once, anything else backs off
            if item.get("code") == 410:
                log.info("endpoint %s: watch expired, listing again: %s", self.source.key,
                         show(item))  # fmt: skip
                raise _Gone
            raise ApiError(int(item.get("code") or 0), f"watch ERROR event: {show(item)}")
        self.events += 1
        if rv := metadata.get("resourceVersion"):
            self.resource_version = str(rv)
        name = str(metadata.get("name", ""))
        if kind in ("ADDED", "MODIFIED"):
            self.slices[name] = slice_addresses(item, self.source.port, self.allow_loopback)
        elif kind == "DELETED":
            self.slices.pop(name, None)
        else:
            return  # BOOKMARK: only the resourceVersion
        self._publish()

    def _publish(self) -> None:
        addresses = frozenset().union(*self.slices.values())
        pods = {a.key: pod for found in self.slices.values() for a, pod in found.items() if pod}
        if addresses != self.addresses or pods != self.pods:
            self.addresses, self.pods = addresses, pods
            log.info("endpoint %s: %s", self.source.key, sorted(a.key for a in addresses) or "none")
            self.on_change()


class EndpointSlices:
    """One watcher per ``KubernetesEndpoint`` of the topology; ``sync`` follows reloads."""

    def __init__(
        self,
        on_change: Callable[[], None],
        config: ApiConfig | None = None,
        backoff: Backoff = Backoff(),
    ) -> None:
        self.on_change, self.backoff = on_change, backoff
        self.config = config if config is not None else ApiConfig.from_environment()
        self.watchers: dict[KubernetesEndpoint, SliceWatcher] = {}

    async def sync(self, sources: Iterable[object], wait_s: float = 5.0) -> None:
        """Starts watching new sources (waiting up to ``wait_s`` for their first list) and
        stops watching the ones no longer listed."""
        wanted = {s for s in sources if isinstance(s, KubernetesEndpoint)}
        for source in set(self.watchers) - wanted:
            await self.watchers.pop(source).stop()
        started = []
        for source in wanted - set(self.watchers):
            watcher = self.watchers[source] = SliceWatcher(
                source, self.config, self.on_change, self.backoff
            )
            watcher.start()
            started.append(watcher.synced)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                for synced in started:
                    await synced.wait()

    def addresses(self, source: KubernetesEndpoint) -> frozenset[EndpointAddress]:
        watcher = self.watchers.get(source)
        return watcher.addresses if watcher else frozenset()

    def pods(self) -> dict[str, str]:
        """Every watched address's pod (HOST:PORT -> NAMESPACE/POD), where a slice named it."""
        return {key: pod for w in self.watchers.values() for key, pod in w.pods.items()}

    async def stop(self) -> None:
        for watcher in self.watchers.values():
            await watcher.stop()
        self.watchers.clear()


class _Response:
    def __init__(self, status: int, headers: dict[str, str], reader: asyncio.StreamReader) -> None:
        self.status, self.headers, self.reader = status, headers, reader

    async def chunks(self, idle_s: float) -> AsyncIterator[bytes]:
        """The body, de-chunked; EOF in the middle of a chunked body is an error."""
        read = self.reader
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size_line = await _within(read.readline(), idle_s)
                if not size_line.endswith(b"\n"):
                    raise ConnectionError("the API server closed the stream")
                size = int(size_line.split(b";")[0].strip() or b"x", 16)
                if size == 0:
                    return
                data = await _within(read.readexactly(size + 2), idle_s)
                yield data[:-2]
        elif (length := self.headers.get("content-length")) is not None:
            yield await _within(read.readexactly(int(length)), idle_s)
        else:
            while data := await _within(read.read(65536), idle_s):
                yield data

    async def body(self) -> bytes:
        parts, size = [], 0
        async for chunk in self.chunks(LIST_TIMEOUT_S):
            parts.append(chunk)
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise ValueError(f"response over {MAX_BODY_BYTES} bytes")
        return b"".join(parts)

    async def lines(self, idle_s: float) -> AsyncIterator[bytes]:
        buffer = b""
        async for chunk in self.chunks(idle_s):
            buffer += chunk
            *complete, buffer = buffer.split(b"\n")
            for line in complete:
                yield line
            if len(buffer) > MAX_BODY_BYTES:
                raise ValueError("watch event over the size limit")
        if buffer.strip():
            yield buffer


def _ssl_context(config: ApiConfig) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(config.ca_file) if config.ca_file else None)
    if config.insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def _read_token(config: ApiConfig) -> str:
    return config.token_file.read_text(encoding="utf-8").strip() if config.token_file else ""


async def _within(awaitable: Awaitable[T], seconds: float) -> T:
    """``asyncio.wait_for``, minus its 3.11 habit of swallowing a cancellation that races
    the result (a stopped watcher would go on)."""
    async with asyncio.timeout(seconds):
        return await awaitable


@contextlib.asynccontextmanager
async def _request(
    config: ApiConfig | None, path: str, timeout_s: float
) -> AsyncIterator[_Response]:
    """One GET on its own connection (``Connection: close``); the response once its status is
    200, else ApiError (410: _Gone)."""
    if config is None:
        raise ApiError(0, "not in a cluster, and INFERMESH_KUBERNETES_API is not set")
    url = urllib.parse.urlsplit(config.url)
    secure = url.scheme == "https"
    host, port = url.hostname or "", url.port or (443 if secure else 80)
    # Blocking file reads (token, CA) off the event loop, on every (re)connection.
    token = await asyncio.to_thread(_read_token, config)
    context = await asyncio.to_thread(_ssl_context, config) if secure else None
    reader, writer = await _within(
        asyncio.open_connection(host, port, ssl=context, limit=1 << 20), CONNECT_TIMEOUT_S
    )
    try:
        headers = [f"GET {url.path.rstrip('/')}{path} HTTP/1.1", f"Host: {url.netloc}",
                   "Accept: application/json", "User-Agent: infermesh-control-plane",
                   "Connection: close"]  # fmt: skip
        if token:
            headers.append(f"Authorization: Bearer {token}")
        writer.write(("\r\n".join(headers) + "\r\n\r\n").encode())
        await writer.drain()
        status_line = await _within(reader.readline(), timeout_s)
        parts = status_line.decode("latin-1").split(" ", 2)
        if len(parts) < 2 or not parts[1].isdigit():
            raise ConnectionError(f"not an HTTP response: {status_line[:80]!r}")
        fields: dict[str, str] = {}
        while (line := await _within(reader.readline(), timeout_s)) not in (
            b"\r\n",
            b"\n",
        ):
            if not line:
                raise ConnectionError("the API server closed the connection")
            name, _, value = line.decode("latin-1").partition(":")
            fields[name.strip().lower()] = value.strip()
        response = _Response(int(parts[1]), fields, reader)
        if response.status == 410:
            raise _Gone
        if response.status != 200:
            text = (await _within(response.body(), timeout_s))[:300]
            raise ApiError(response.status, text.decode("utf-8", "replace").strip())
        yield response
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await _within(writer.wait_closed(), 1.0)
