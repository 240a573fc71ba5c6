"""Endpoint addresses from the topology's sources: static addresses as they are, DNS names
re-resolved to all their records, Kubernetes Services to their ready pods as last watched."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Iterable

from control_plane.config.kubernetes_source import KubernetesEndpoint
from control_plane.config.topology import DnsEndpoint, EndpointSource, StaticEndpoint, Topology
from control_plane.model.mesh import EndpointAddress

log = logging.getLogger(__name__)

DNS_TIMEOUT_S = 5.0


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
                loop.getaddrinfo(source.name, source.port, type=socket.SOCK_STREAM),
                self.timeout_s,
            )
            found = {
                EndpointAddress(str(info[4][0]), source.port)
                for info in infos
                if info[0] in (socket.AF_INET, socket.AF_INET6)
            }
            if not found:
                raise OSError("no IPv4 or IPv6 address")
        except (OSError, TimeoutError, UnicodeError, ValueError) as exc:
            if source not in self._failing:
                self._failing.add(source)
                log.warning("endpoint %s does not resolve, skipped: %r", source.key, exc)
            return set()
        if source in self._failing:
            self._failing.discard(source)
            log.info("endpoint %s resolves again (%d addresses)", source.key, len(found))
        return found


async def resolve_endpoints(
    topology: Topology, timeout_s: float = DNS_TIMEOUT_S
) -> tuple[EndpointAddress, ...]:
    """Every endpoint address of the topology now: unique, sorted; failing names are skipped."""
    return await EndpointResolver(timeout_s).resolve(topology.endpoints)
