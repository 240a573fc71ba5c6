"""Endpoint addresses from the topology's sources: static addresses as they are, DNS names
re-resolved to all their records, Kubernetes Services to their ready pods as last watched."""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from control_plane.config.kubernetes_source import KubernetesEndpoint
from control_plane.config.topology import DnsEndpoint, EndpointSource, StaticEndpoint, Topology
from control_plane.model.mesh import EndpointAddress

log = logging.getLogger(__name__)

DNS_TIMEOUT_S = 5.0
# A name that fails to resolve for a moment (a DNS server restarting, EAI_AGAIN, a slow
# answer) keeps its last good addresses this long: dropping them took the name's servers out
# of every cluster (503s) until DNS answered again. Placement's probes still judge each
# address. An authoritative "no such name" drops them at once (the service is gone).
KEEP_LAST_GOOD_S = 300.0
# Lookups run on threads of their own: a timed-out getaddrinfo keeps its thread, which in the
# event loop's default executor would hold up everything else that runs there.
_LOOKUPS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dns")


class EndpointResolver:
    """Resolves endpoint sources, skipping (never raising on) names that fail. Logs a name when
    it starts and stops failing: keep one resolver so a dead name is not logged every poll.
    ``watched`` gives a Kubernetes source's current addresses (``EndpointSlices.addresses``);
    without it such sources have none."""

    def __init__(
        self,
        timeout_s: float = DNS_TIMEOUT_S,
        watched: Callable[[KubernetesEndpoint], Iterable[EndpointAddress]] | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.watched = watched
        self._failing: set[DnsEndpoint] = set()
        self._last_good: dict[DnsEndpoint, tuple[float, set[EndpointAddress]]] = {}

    async def resolve(self, sources: Iterable[EndpointSource]) -> tuple[EndpointAddress, ...]:
        """Static addresses as they are, DNS names to all their addresses, Kubernetes Services
        to their ready pods' (as last watched); unique, sorted."""
        sources = tuple(sources)
        found = {s.address for s in sources if isinstance(s, StaticEndpoint)}
        if self.watched is not None:
            for s in sources:
                if isinstance(s, KubernetesEndpoint):
                    found.update(self.watched(s))
        names = [s for s in sources if isinstance(s, DnsEndpoint)]
        for addresses in await asyncio.gather(*(self._lookup(n) for n in names)):
            found.update(addresses)
        return tuple(sorted(found))

    async def _lookup(self, source: DnsEndpoint) -> set[EndpointAddress]:
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.run_in_executor(
                    _LOOKUPS,
                    functools.partial(
                        socket.getaddrinfo, source.name, source.port, type=socket.SOCK_STREAM
                    ),
                ),
                self.timeout_s,
            )
            found = {
                EndpointAddress(str(info[4][0]), source.port)
                for info in infos
                if info[0] in (socket.AF_INET, socket.AF_INET6)
            }
            if not found:
                raise socket.gaierror(socket.EAI_NONAME, "no IPv4 or IPv6 address")
        except (OSError, TimeoutError, UnicodeError, ValueError) as exc:
            return self._failed(source, exc, loop.time())
        if source in self._failing:
            self._failing.discard(source)
            log.info("endpoint %s resolves again (%d addresses)", source.key, len(found))
        self._last_good[source] = (loop.time(), found)
        return found

    def _failed(self, source: DnsEndpoint, exc: BaseException, now: float) -> set[EndpointAddress]:
        gone = isinstance(exc, socket.gaierror) and exc.errno == socket.EAI_NONAME
        at, last = self._last_good.get(source, (now, set()))
        keep = not gone and last and now - at <= KEEP_LAST_GOOD_S
        if source not in self._failing:
            self._failing.add(source)
            if keep:
                log.warning("endpoint %s does not resolve (%r): keeping its %d last addresses "
                            "for up to %.0f s", source.key, exc, len(last),
                            KEEP_LAST_GOOD_S - (now - at))  # fmt: skip
            else:
                log.warning("endpoint %s does not resolve, skipped: %r", source.key, exc)
        if keep:
            return set(last)
        self._last_good.pop(source, None)
        return set()


async def resolve_endpoints(
    topology: Topology, timeout_s: float = DNS_TIMEOUT_S
) -> tuple[EndpointAddress, ...]:
    """Every endpoint address of the topology now: unique, sorted; failing names are skipped."""
    return await EndpointResolver(timeout_s).resolve(topology.endpoints)
