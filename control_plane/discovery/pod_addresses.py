"""Which EndpointSlice addresses a pod can serve from.

Whoever may write an EndpointSlice in the namespace chooses its addresses, and the API server
does not refuse special ones. Unchecked, the placement poller would probe them (with the
operator credential) and Envoy would route tenants' requests there: the control plane's own
host (loopback), a cloud's metadata service (link-local), or nowhere (unspecified, multicast),
also written IPv4-mapped. Loopback is taken only from a Kubernetes API that is itself on
loopback (a development cluster on this host, such as the tests' fake API server): a real
cluster's API is never reached there.
"""

from __future__ import annotations

import ipaddress
import logging
import urllib.parse
from collections.abc import Mapping
from typing import Any

from infermesh.addresses import is_loopback

log = logging.getLogger(__name__)

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_LOGGED: set[str] = set()  # addresses already refused in the log: a watch re-reads every slice
_MAX_LOGGED = 1024


def pod_address(ip: IpAddress, allow_loopback: bool, item: Mapping[str, Any]) -> bool:
    """Whether ``ip`` (from EndpointSlice ``item``) may be routed to; logs a refusal once."""
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    for address in (ip, mapped):
        if address is None:
            continue
        if address.is_link_local or address.is_unspecified or address.is_multicast:
            break
        if address.is_loopback and not allow_loopback:
            break
    else:
        return True
    if str(ip) not in _LOGGED and len(_LOGGED) < _MAX_LOGGED:
        _LOGGED.add(str(ip))
        log.warning(
            "EndpointSlice %r lists %s, an address no pod serves from (loopback, link-local, "
            "unspecified or multicast): not routed to",
            str((item.get("metadata") or {}).get("name", "")),
            ip,
        )
    return False


def api_on_loopback(url: str) -> bool:
    """Whether the Kubernetes API at ``url`` is on this host's loopback."""
    return is_loopback(urllib.parse.urlsplit(url).hostname or "")
