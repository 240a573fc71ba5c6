"""The servers the topology's endpoint sources name now, and the Kubernetes pod at each.

``DiscoveredEndpoints`` owns what finds them: the resolver (static addresses, DNS names), the
EndpointSlice watches, and the two loops that follow them (``refresh_dns`` every
``DNS_REFRESH_INTERVAL_S``; ``follow_slices`` at once). The control plane reads
``addresses`` and ``pods`` and is told when either changes; it decides what follows (probe,
rebuild)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from control_plane.config.topology import EndpointSource
from control_plane.discovery.kubernetes import EndpointSlices
from control_plane.discovery.resolver import EndpointResolver
from control_plane.model.mesh import NO_PODS, EndpointAddress, ServerPods

log = logging.getLogger(__name__)

DNS_REFRESH_INTERVAL_S = 5.0

# Called after a change: why, and whether the pods moved (not just the addresses).
OnChange = Callable[[str, bool], Awaitable[None]]


class DiscoveredEndpoints:
    def __init__(
        self,
        sources: Callable[[], Sequence[EndpointSource]],
        on_change: OnChange,
        dns_interval_s: float = DNS_REFRESH_INTERVAL_S,
    ) -> None:
        self._sources = sources  # the current topology's
        self._on_change = on_change
        self.dns_interval_s = dns_interval_s
        self._slices_changed = asyncio.Event()
        self.slices = EndpointSlices(self._slices_changed.set)
        self.resolver = EndpointResolver(watched=self.slices.addresses)
        self.addresses: tuple[EndpointAddress, ...] = ()
        self.pods: ServerPods = NO_PODS

    async def sync(self) -> bool:
        """Follows the sources as they are now (starting and stopping watches, waiting a
        bounded time for each new one's first LIST), then resolves; True when the pods moved."""
        await self.slices.sync(self._sources())
        return (await self.resolve())[1]

    async def resolve(self) -> tuple[bool, bool]:
        """(anything changed, the pods moved): the sources resolved, unique and sorted, with
        the pod each EndpointSlice names at its address."""
        addresses = await self.resolver.resolve(self._sources())
        pods = self.slices.pods()
        moved = pods != self.pods.as_dict()
        changed = moved or addresses != self.addresses
        self.addresses = addresses
        if moved:
            self.pods = ServerPods(pods)  # a new object: caches keyed on it see the change
        return changed, moved

    async def stop(self) -> None:
        await self.slices.stop()

    # The two loops (the control plane runs each supervised): until cancelled.
    async def refresh_dns(self) -> None:
        """DNS names re-resolved every ``dns_interval_s``."""
        while True:
            await asyncio.sleep(self.dns_interval_s)
            await self._refresh("DNS answers changed")

    async def follow_slices(self) -> None:
        """A watched Service's ready pods changed: at once, not at the next DNS refresh."""
        while True:
            await self._slices_changed.wait()
            self._slices_changed.clear()  # changes during the refresh set it again
            await self._refresh("EndpointSlices changed")

    async def _refresh(self, reason: str) -> None:
        changed, moved = await self.resolve()
        if changed:
            log.info("endpoints changed (%s): %s", reason, [e.key for e in self.addresses])
            await self._on_change(reason, moved)
