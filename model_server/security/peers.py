"""Mutual TLS on the model server's gRPC and REST ports, and which mesh identity may call what.

With ``--tls-cert``, ``--tls-key`` and ``--tls-ca`` the server speaks only TLS, asks every
client for a certificate signed by the mesh CA (``infermesh.pki``) and reads the caller's
SPIFFE ID from it. A plaintext client, or one with a certificate from another CA, fails the
handshake; a verified caller is then held to its kind's API groups (Triton's groups,
``model_server.security.access``):

    health                                       envoy, control-plane, operator, model-server
    metadata, model-config, statistics           envoy, control-plane, operator
    inference                                    envoy
    model-repository                             control-plane, operator
    shared-memory, trace, logging                operator

Anything else is PERMISSION_DENIED (gRPC) or 403 (REST), naming the identity and the group. An
operator certificate also satisfies ``--restricted-api`` (the header credential is for callers
without one).

Certificates are short-lived, so the files are re-read when they change: gRPC asks for its
certificate on every new handshake (``dynamic_ssl_server_credentials``), and the REST port's
``SSLContext`` is reloaded in place. A renewal that fails its checks (key not matching, expired,
another identity) is logged and counted, and the last good certificate stays in use.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from infermesh import pki
from model_server.security.access import GROUP_OF_METHOD, Restriction, check_metadata, guarded

log = logging.getLogger(__name__)

EVERY_KIND = frozenset({"envoy", "control-plane", "operator"})
ALLOWED_KINDS: Mapping[str, frozenset[str]] = {
    # A server's health probe (compose.private.yaml) calls it with the server's own
    # certificate: no container of a server then needs an operator's.
    "health": EVERY_KIND | {"model-server"},
    "metadata": EVERY_KIND,
    "model-config": EVERY_KIND,
    "statistics": EVERY_KIND,
    "inference": frozenset({"envoy"}),
    "model-repository": frozenset({"control-plane", "operator"}),
    "shared-memory": frozenset({"operator"}),
    "trace": frozenset({"operator"}),
    "logging": frozenset({"operator"}),
}
RELOAD_CHECK_S = 1.0  # how often the files' modification times are looked at, at most


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    ca: Path


def refusal(group: str | None, spiffe_id: str | None, trust_domain: str) -> str | None:
    """None when the peer may call ``group``, else why not (naming the identity, not a key)."""
    who = pki.mesh_peer(spiffe_id, trust_domain)
    if who is None:
        return f"caller {spiffe_id or 'without a SPIFFE ID'} is not a {trust_domain} workload"
    allowed = ALLOWED_KINDS.get(group or "", frozenset())
    if who.kind in allowed:
        return None
    kinds = ", ".join(sorted(allowed)) or "no one"
    return f"{spiffe_id} may not call the {group or 'unknown'} API (allowed: {kinds})"


class ServerTls:
    """The server's certificate, key and CA: checked at start, re-read when they change."""

    def __init__(self, files: TlsFiles, expect: str | None, on_reload_failure: Callable[[], None]):
        self.files = files
        self.expect = expect
        self.on_reload_failure = on_reload_failure
        # Raises pki.CertificateError (naming the file) when the server must not start.
        self.current = pki.load_credentials(files.cert, files.key, files.ca, expect)
        self.trust_domain = _trust_domain(self.current.spiffe_id)
        self._stamp = self._mtimes()
        self._checked_at = time.monotonic()
        self._contexts: list[ssl.SSLContext] = []
        self.generation = 0  # +1 with every certificate taken into use
        # The event loop and gRPC's handshake threads both look; one reload at a time.
        self._lock = threading.Lock()

    def _mtimes(self) -> tuple[int, ...]:
        stamps = []
        for path in (self.files.cert, self.files.key, self.files.ca):
            try:
                stamps.append(os.stat(path).st_mtime_ns)
            except OSError:
                stamps.append(-1)
        return tuple(stamps)

    def reload_if_changed(self) -> bool:
        """Re-reads the files if they changed since the last look (at most once a second);
        True when a new certificate is now in use."""
        if not self._lock.acquire(blocking=False):
            return False  # another thread is looking right now
        try:
            return self._reload_if_changed()
        finally:
            self._lock.release()

    def _reload_if_changed(self) -> bool:
        now = time.monotonic()
        if now - self._checked_at < RELOAD_CHECK_S:
            return False
        self._checked_at = now
        stamp = self._mtimes()
        if stamp == self._stamp:
            return False
        try:
            fresh = pki.load_credentials(
                self.files.cert, self.files.key, self.files.ca, self.expect
            )
            for context in self._contexts:
                _load_into(context, self.files)
        except (pki.CertificateError, ssl.SSLError, OSError) as exc:
            # Half-written rotations land here too; the next look retries them.
            log.warning("certificate reload failed, keeping the current one: %s", exc)
            self.on_reload_failure()
            return False
        self._stamp, self.current = stamp, fresh
        self.generation += 1
        log.info("certificate reloaded: %r", fresh)
        return True

    def grpc_credentials(self) -> grpc.ServerCredentials:
        given = [self.generation]  # what gRPC has; it asks again on every new handshake

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            self.reload_if_changed()
            if given[0] == self.generation:
                return None  # keep the current one
            given[0] = self.generation
            return self._grpc_configuration()

        return grpc.dynamic_ssl_server_credentials(
            self._grpc_configuration(), fetch, require_client_authentication=True
        )

    def _grpc_configuration(self) -> grpc.ServerCertificateConfiguration:
        creds = self.current
        return grpc.ssl_server_certificate_configuration(
            [(creds.key_pem, creds.cert_pem)], root_certificates=creds.ca_pem
        )

    def ssl_context(self) -> ssl.SSLContext:
        """A server context for the REST port: client certificates required, TLS 1.2 or
        later, reloaded in place with the files."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.verify_mode = ssl.CERT_REQUIRED
        _load_into(context, self.files)
        self._contexts.append(context)
        return context


def _load_into(context: ssl.SSLContext, files: TlsFiles) -> None:
    context.load_cert_chain(str(files.cert), str(files.key))
    context.load_verify_locations(cafile=str(files.ca))


def _trust_domain(spiffe_id: str) -> str:
    who = pki.parse_spiffe_id(spiffe_id)
    return who.trust_domain if who else pki.DEFAULT_TRUST_DOMAIN


def rest_peer_id(peercert: Mapping[str, Any] | None) -> str | None:
    """The spiffe:// URI SAN of ``SSLObject.getpeercert()``'s dict (None without one)."""
    sans = (peercert or {}).get("subjectAltName", ())
    uris = [value for kind, value in sans if kind == "URI" and value.startswith("spiffe://")]
    return uris[0] if len(uris) == 1 else None


def decide(
    group: str | None,
    spiffe_id: str | None,
    trust_domain: str,
    restrictions: Mapping[str, Restriction],
    metadata: Any,
) -> str | None:
    """The peer's permission, then ``--restricted-api`` unless the peer is an operator."""
    refused = refusal(group, spiffe_id, trust_domain)
    who = pki.mesh_peer(spiffe_id, trust_domain)  # cached: the same lookup as refusal's
    if refused is not None or (who is not None and who.kind == "operator"):
        return refused
    return check_metadata(restrictions, group, metadata)


class MeshAccessInterceptor(grpc.aio.ServerInterceptor):
    """Checks every call's peer identity (and the restricted API) before its handler runs.

    gRPC's interceptors see only the method and metadata, not the peer, so the handler is
    wrapped: the check runs first inside it, where the call's auth context is."""

    def __init__(self, trust_domain: str, restrictions: Mapping[str, Restriction]) -> None:
        self.trust_domain = trust_domain
        self.restrictions = dict(restrictions)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        group = GROUP_OF_METHOD.get(details.method)
        metadata = details.invocation_metadata or ()

        def check(context: grpc.aio.ServicerContext) -> str | None:
            peer = pki.peer_spiffe_id(context.auth_context())
            return decide(group, peer, self.trust_domain, self.restrictions, metadata)

        return guarded(handler, check)
