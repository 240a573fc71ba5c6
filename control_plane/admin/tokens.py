"""The admin's two tokens, how a request presents one, and the refusal to expose the admin
off loopback without both (what each guards: ``control_plane.admin.http``)."""

from __future__ import annotations

import base64
import binascii
import hmac
from dataclasses import dataclass
from typing import Any

from infermesh.addresses import is_loopback


@dataclass(frozen=True)
class AdminTokens:
    """The admin's read and write tokens (None: that side is open)."""

    read: str | None = None
    write: str | None = None

    def __repr__(self) -> str:  # never the tokens
        return f"AdminTokens(read={self.read is not None}, write={self.write is not None})"

    def may_read(self, given: str | None) -> bool:
        return self.read is None or _equal(given, self.read) or _equal(given, self.write)

    def may_write(self, given: str | None) -> bool:
        return self.write is None or _equal(given, self.write)

    def is_read_token(self, given: str | None) -> bool:
        return _equal(given, self.read)


class AdminExposureError(ValueError):
    """The admin would be reachable off this host without the tokens that guard it."""


def check_exposure(host: str, tokens: AdminTokens) -> None:
    """Refuses an admin bound off loopback without both tokens."""
    if is_loopback(host):
        return
    missing = [
        flag
        for flag, token in (
            ("--admin-read-token-file", tokens.read),
            ("--admin-token-file", tokens.write),
        )
        if token is None
    ]
    if missing:
        raise AdminExposureError(
            f"the admin binds {host}, which is not loopback: give {' and '.join(missing)} "
            "(status, telemetry and overrides would be open to the network), or bind "
            "admin.host to 127.0.0.1"
        )


def _equal(given: str | None, token: str | None) -> bool:
    if given is None or token is None:
        return False
    return hmac.compare_digest(given.encode(), token.encode())


def bearer_token(headers: Any) -> str | None:
    """The token of ``Authorization: Bearer TOKEN``; None for anything else."""
    scheme, _, value = str(headers.get("authorization") or "").partition(" ")
    return (value.strip() or None) if scheme.lower() == "bearer" else None


def presented_token(headers: Any) -> str | None:
    """The token a request presents: ``Bearer TOKEN``, or the password of HTTP Basic."""
    scheme, _, value = str(headers.get("authorization") or "").partition(" ")
    if scheme.lower() == "bearer":
        return value.strip() or None
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value.strip(), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None
        return decoded.partition(":")[2] or None
    return None
