"""The Aggregated Discovery Service: state-of-the-world and incremental (delta) streams.

Transport only: each stream reads the current snapshot from the ``SnapshotCache`` and keeps,
per resource type, what it sent, what the Envoy acknowledged and what it rejected. A request
opens a watch; a response answers it; the ACK opens the next one. So a slow Envoy is sent only
the newest state once it catches up, never a queue of stale ones, and a rejected (NACKed)
version is never sent again: the next push waits for a new version.

Behaviour of Envoy 1.40 this relies on (measured against the real Envoy; the tests hold it):
- a reconnecting Envoy sends its old version and no nonce: always answer a request without one;
- after a CDS update Envoy re-requests EDS with the nonce it already ACKed: answer it again, or
  the re-created clusters wait out initial_fetch_timeout (15 s).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from control_plane.metrics import ControlPlaneMetrics
from control_plane.xds.nodes import NodeRegistry, NodeStatus
from control_plane.xds.snapshot import (
    CLUSTER_TYPE,
    DEFAULT_GROUP,
    LISTENER_TYPE,
    SHORT_NAMES,
    TYPE_ORDER,
    Snapshot,
    SnapshotCache,
)
from infermesh import pki

log = logging.getLogger(__name__)
WILDCARD_TYPES = (LISTENER_TYPE, CLUSTER_TYPE)
_CHANGED = object()  # queue marker: the snapshot changed
_stream_ids = itertools.count(1)


def _short(type_url: str) -> str:
    return SHORT_NAMES.get(type_url, type_url.rsplit(".", 1)[-1])


def _nack_message(request: Any) -> str | None:
    detail = request.error_detail
    if detail.code or detail.message:
        return detail.message or f"code {detail.code}"
    return None


class _Session:
    """What SotW and delta streams share: node bookkeeping, the event pump, nonces."""

    mode = ""

    def __init__(self, cache: SnapshotCache, nodes: NodeRegistry, metrics: ControlPlaneMetrics):
        self.cache = cache
        self.nodes = nodes
        self.metrics = metrics
        self.node: NodeStatus | None = None
        self.group = DEFAULT_GROUP
        self._nonces = itertools.count(1)
        self._prefix = f"{next(_stream_ids)}.{secrets.token_hex(3)}"
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._change_pending = False
        self._sent_at: dict[str, float] = {}

    def _nonce(self) -> str:
        return f"{self._prefix}.{next(self._nonces)}"

    def _notify(self) -> None:
        if not self._change_pending:  # coalesce: one marker however many changes
            self._change_pending = True
            self._queue.put_nowait(_CHANGED)

    def snapshot(self) -> Snapshot | None:
        return self.cache.snapshot_for(self.group)

    @property
    def node_id(self) -> str:
        return self.node.node_id if self.node is not None else ""

    def _identify(self, request: Any) -> None:
        if self.node is None:
            node_id = request.node.id or f"anonymous-{self._prefix}"
            self.group = request.node.cluster or DEFAULT_GROUP
            self.node = self.nodes.connect(node_id, request.node.cluster, self.mode)
            self.metrics.streams.labels(self.mode).inc()
            log.info("xds: %s stream from node %r (group %r)", self.mode, node_id, self.group)
        self.node.last_seen = time.time()

    def _record_sent(self, type_url: str, version: str) -> None:
        assert self.node is not None
        status = self.node.of(_short(type_url))
        status.sent_version = version
        status.responses += 1
        self._sent_at[type_url] = time.monotonic()
        self.metrics.responses.labels(_short(type_url), self.mode).inc()

    def _record_ack(self, type_url: str, version: str) -> None:
        assert self.node is not None
        self.node.of(_short(type_url)).acked_version = version
        sent_at = self._sent_at.pop(type_url, None)
        if sent_at is not None:
            self.metrics.push_to_ack.labels(_short(type_url)).observe(time.monotonic() - sent_at)

    def _record_in_sync(self, type_url: str, version: str) -> None:
        """The Envoy already holds exactly this version's resources: nothing to send."""
        assert self.node is not None
        status = self.node.of(_short(type_url))
        status.sent_version = status.acked_version = version

    def _record_nack(self, type_url: str, version: str, message: str) -> None:
        assert self.node is not None
        status = self.node.of(_short(type_url))
        status.nacks += 1
        status.last_nack = {"version": version, "error": message, "at": round(time.time(), 3)}
        self.metrics.nacks.labels(_short(type_url)).inc()
        log.warning(
            "xds: node %r rejected %s version %s: %s",
            self.node.node_id, _short(type_url), version, message,
        )  # fmt: skip

    async def run(self, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async def read() -> None:
            try:
                async for request in requests:
                    await self._queue.put(request)
            finally:
                await self._queue.put(None)

        reader = asyncio.get_running_loop().create_task(read())
        self.cache.subscribe(self._notify)
        try:
            while True:
                item = await self._queue.get()
                if item is None:
                    return
                if item is _CHANGED:
                    self._change_pending = False
                    for type_url in TYPE_ORDER:
                        for response in self.respond(type_url):
                            yield response
                    continue
                self._identify(item)
                self.handle(item)
                for response in self.respond(item.type_url):
                    yield response
        finally:
            self.cache.unsubscribe(self._notify)
            reader.cancel()
            if self.node is not None:
                self.nodes.disconnect(self.node)
                self.metrics.streams.labels(self.mode).dec()
                log.info("xds: %s stream from node %r closed", self.mode, self.node.node_id)

    def handle(self, request: Any) -> None:
        raise NotImplementedError

    def respond(self, type_url: str) -> list[Any]:
        raise NotImplementedError


@dataclass
class _SotwWatch:
    names: tuple[str, ...] | None = None  # None: every resource of the type (wildcard)
    open: bool = False  # a request waits for an answer
    force: bool = False  # answer even if the version did not change
    sent_version: str = ""
    sent_nonce: str = ""
    acked_nonce: str = ""


class SotwSession(_Session):
    mode = "sotw"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.watches: dict[str, _SotwWatch] = {}

    def handle(self, request: Any) -> None:
        type_url = request.type_url
        watch = self.watches.setdefault(type_url, _SotwWatch())
        names = tuple(request.resource_names)
        wanted = None if (type_url in WILDCARD_TYPES and not names) else names
        nonce = request.response_nonce
        nack = _nack_message(request)
        if nonce and nonce != watch.sent_nonce:
            return  # an answer to an older response: a newer one is on its way
        if nack is not None:
            self._record_nack(type_url, watch.sent_version, nack)
        elif not nonce:
            watch.force = True  # first request, or a reconnecting Envoy: always answer
        elif nonce == watch.acked_nonce:
            watch.force = True  # re-request after an ACK (EDS after a CDS update): answer
        else:
            watch.acked_nonce = nonce
            self._record_ack(type_url, request.version_info)
            if wanted != watch.names:
                watch.force = True
        watch.names = wanted
        watch.open = True

    def respond(self, type_url: str) -> list[Any]:
        watch = self.watches.get(type_url)
        snapshot = self.snapshot()
        if watch is None or not watch.open or snapshot is None:
            return []
        typed = snapshot.of(type_url, self.node_id)
        version = typed.subset_version(watch.names)
        if version == watch.sent_version and not watch.force:
            return []
        response = discovery_pb2.DiscoveryResponse(
            version_info=version,
            resources=[r.packed for r in typed.subset(watch.names)],
            type_url=type_url,
            nonce=self._nonce(),
        )
        watch.open = watch.force = False
        watch.sent_version, watch.sent_nonce = version, response.nonce
        self._record_sent(type_url, version)
        return [response]


@dataclass
class _DeltaWatch:
    wildcard: bool = False
    subscribed: set[str] = field(default_factory=set)
    known: dict[str, str] = field(default_factory=dict)  # what the Envoy has (or is being sent)
    rejected: dict[str, str] = field(default_factory=dict)  # name -> version it NACKed
    pending_nonce: str = ""
    pending_before: dict[str, str | None] = field(default_factory=dict)  # to undo on NACK
    pending_version: str = ""
    force: bool = False


class DeltaSession(_Session):
    mode = "delta"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.watches: dict[str, _DeltaWatch] = {}

    def handle(self, request: Any) -> None:
        type_url = request.type_url
        watch = self.watches.get(type_url)
        subscribe = list(request.resource_names_subscribe)
        if watch is None:
            watch = self.watches[type_url] = _DeltaWatch()
            watch.wildcard = type_url in WILDCARD_TYPES and (not subscribe or "*" in subscribe)
            watch.known = dict(request.initial_resource_versions)
            watch.force = True  # the first request is always answered
        for name in subscribe:
            if name == "*":
                watch.wildcard = True
            else:
                watch.subscribed.add(name)
                if name not in request.initial_resource_versions:
                    watch.known.pop(name, None)  # a (re)subscription wants the resource again
        for name in request.resource_names_unsubscribe:
            if name == "*":
                watch.wildcard = False
            watch.subscribed.discard(name)
            watch.known.pop(name, None)
        nonce = request.response_nonce
        if nonce and nonce == watch.pending_nonce:
            nack = _nack_message(request)
            if nack is None:
                self._record_ack(type_url, watch.pending_version)
            else:
                self._record_nack(type_url, watch.pending_version, nack)
                for name, before in watch.pending_before.items():
                    if name in watch.known:
                        watch.rejected[name] = watch.known[name]
                    if before is None:
                        watch.known.pop(name, None)
                    else:
                        watch.known[name] = before
            watch.pending_nonce = ""
            watch.pending_before = {}

    def respond(self, type_url: str) -> list[Any]:
        watch = self.watches.get(type_url)
        snapshot = self.snapshot()
        if watch is None or snapshot is None:
            return []
        if watch.pending_nonce and not watch.force:
            return []  # wait for the ACK of what is in flight: the newest state goes next
        typed = snapshot.of(type_url, self.node_id)
        in_scope = (lambda n: True) if watch.wildcard else watch.subscribed.__contains__
        changed = [
            r
            for name, r in sorted(typed.items.items())
            if in_scope(name)
            and watch.known.get(name) != r.version
            and watch.rejected.get(name) != r.version
        ]
        removed = sorted(n for n in watch.known if n not in typed.items and in_scope(n))
        if not changed and not removed and not watch.force:
            held_back = any(
                watch.rejected.get(name) == r.version
                for name, r in typed.items.items()
                if in_scope(name)
            )
            if not watch.pending_nonce and not held_back:
                self._record_in_sync(type_url, typed.version)  # e.g. back to what it holds
            return []
        response = discovery_pb2.DeltaDiscoveryResponse(
            system_version_info=typed.version,
            resources=[
                discovery_pb2.Resource(name=r.name, version=r.version, resource=r.packed)
                for r in changed
            ],
            removed_resources=removed,
            type_url=type_url,
            nonce=self._nonce(),
        )
        watch.pending_before = {r.name: watch.known.get(r.name) for r in changed}
        watch.pending_before.update({n: watch.known.get(n) for n in removed})
        for r in changed:
            watch.known[r.name] = r.version
        for name in removed:
            watch.known.pop(name, None)
        watch.pending_nonce, watch.pending_version = response.nonce, typed.version
        watch.force = False
        self._record_sent(type_url, typed.version)
        return [response]


class AdsServicer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    """``trust_domain`` (xds.tls): the stream's peer must be an Envoy of the mesh whose
    certificate names the node id it sends, or it is refused before anything is sent: a node
    is served its own private key over SDS, so a node id is never taken on its word."""

    def __init__(
        self,
        cache: SnapshotCache,
        nodes: NodeRegistry,
        metrics: ControlPlaneMetrics,
        trust_domain: str | None = None,
    ) -> None:
        self._make: Callable[[type[_Session]], _Session] = lambda kind: kind(cache, nodes, metrics)
        self.trust_domain = trust_domain

    async def StreamAggregatedResources(
        self, request_iterator: AsyncIterator[Any], context: Any
    ) -> AsyncIterator[Any]:
        requests = await self._checked(request_iterator, context)
        async for response in self._make(SotwSession).run(requests):
            yield response

    async def DeltaAggregatedResources(
        self, request_iterator: AsyncIterator[Any], context: Any
    ) -> AsyncIterator[Any]:
        requests = await self._checked(request_iterator, context)
        async for response in self._make(DeltaSession).run(requests):
            yield response

    async def _checked(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        """The requests, once the first one's node id is the peer certificate's (with TLS)."""
        if self.trust_domain is None:
            return requests
        peer = pki.peer_spiffe_id(context.auth_context()) or ""
        who = pki.mesh_peer(peer, self.trust_domain)
        if who is None or who.kind != "envoy":
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, f"{peer or 'this peer'} is not a mesh Envoy"
            )
        assert who is not None
        iterator = aiter(requests)
        first = await anext(iterator, None)
        if first is None:
            return _empty()
        if first.node.id != who.name[0]:
            log.warning("xds: %s claimed node %r: refused", peer, first.node.id)
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{peer} may speak as node {who.name[0]!r} only, not {first.node.id!r}",
            )
        return _prepend(first, iterator)


async def _prepend(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item


async def _empty() -> AsyncIterator[Any]:
    return
    yield  # pragma: no cover - makes this an async generator
