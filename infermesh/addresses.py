"""What an address looks like, for every package that reads or writes one (one rule)."""

from __future__ import annotations

import ipaddress


def is_ip(value: object) -> bool:
    """Whether ``value`` is an IPv4 or IPv6 address as text (a host name is not)."""
    try:
        return isinstance(value, str) and bool(ipaddress.ip_address(value))
    except ValueError:
        return False


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine only (a host name other than localhost may resolve
    anywhere, so it is not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
