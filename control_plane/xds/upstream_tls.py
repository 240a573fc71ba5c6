"""Mutual TLS from Envoy to the model servers, with the certificates served over SDS.

``listener.upstream_tls: {pki_dir: DIR}`` in the topology names the directory ``infermesh
certs`` writes: the mesh CA (``ca.crt``) and one certificate and key per Envoy node
(``envoy_<node-id>.crt``/``.key``). The control plane reads them (checked as a start-up would:
signed by the CA, within their validity, the key matching, the identity the file name says)
and puts them in the snapshot as SDS ``Secret`` resources on the same ADS stream:

- ``mesh-ca``: the validation context, the same for every node;
- ``envoy-identity``: each node's own certificate and key, served to that node alone.

Every model cluster (and its REST twin) then connects with an ``UpstreamTlsContext`` that
presents ``envoy-identity``, trusts ``mesh-ca`` only, sends each endpoint's
``pki.server_dns_name`` as SNI (the EDS entry's hostname) and accepts the server only if its
certificate carries that name (``auto_host_sni`` + ``auto_sni_san_validation``): a server with
another server's certificate, or one from another CA, gets no connection, and Envoy's health
checks (the same transport socket) mark it down.

A renewed file is a changed file: the control plane re-reads it and pushes the new secret, and
Envoy uses it for new connections without a restart. A file that fails its checks keeps the
last good topology (and so the last good secret) in use and shows in ``/status``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from cryptography.hazmat.primitives import serialization
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.extensions.transport_sockets.raw_buffer.v3 import raw_buffer_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, secret_pb2, tls_pb2

from control_plane.model.mesh import UpstreamTls, WorkloadKeys
from control_plane.model.schema import Checker
from control_plane.xds.envoy_values import ads_source, packed
from infermesh import pki

MATCH_FILTER = "envoy.transport_socket_match"  # the endpoint metadata transport socket matches read
PLAINTEXT = {"infermesh_plaintext": True}  # on "tls: false" members' EDS entries
log = logging.getLogger(__name__)
CA_SECRET = "mesh-ca"
IDENTITY_SECRET = "envoy-identity"
TLS_SOCKET = "envoy.transport_sockets.tls"
_KEYS = {"pki_dir": "path", "control_plane": "name"}
DEFAULT_CONTROL_PLANE = "control-plane"
# A workload certificate is renewed at 2/3 of its life (16 h of 24): one with less than this
# left was not renewed in time, and /status says so.
OVERDUE_S = 6 * 3600


def parse_upstream_tls(c: Checker, value: object, path: str, base: Path) -> UpstreamTls | None:
    """``listener.upstream_tls`` (None when absent): its files read and checked now."""
    if value is None:
        return None
    m = c.mapping(value, path)
    if m is None:
        return None
    c.keys(m, path, _KEYS, required=("pki_dir",))
    given = m.get("pki_dir")
    if not isinstance(given, str) or not given:
        c.fail(f"{path}.pki_dir", "must be a directory (infermesh certs --dir)", given)
        return None
    name = m.get("control_plane", DEFAULT_CONTROL_PLANE)
    directory = Path(given) if Path(given).is_absolute() else base / given
    tls, errors = read_pki(directory, str(name))
    c.errors.extend(f"{path}.pki_dir: {e}" for e in errors)
    return tls


def read_pki(
    directory: Path, control_plane: str = DEFAULT_CONTROL_PLANE
) -> tuple[UpstreamTls | None, list[str]]:
    """The CA, every Envoy identity and the control plane's in ``directory``, and what is
    wrong with them (each naming the file; never key material)."""
    ca_path = directory / "ca.crt"
    try:
        ca = pki.read_certificate(ca_path)
    except pki.CertificateError as exc:
        return None, [str(exc)]
    domain = pki.trust_domain_of_ca(ca)
    errors: list[str] = []

    def load(who: pki.Workload) -> WorkloadKeys | None:
        try:
            creds = pki.load_workload(directory, who)
        except pki.CertificateError as exc:
            errors.append(str(exc))
            return None
        return WorkloadKeys(
            who.name[-1], creds.cert_pem, creds.key_pem, creds.not_after.timestamp()
        )

    envoys = []
    for cert_path in sorted(directory.glob("envoy_*.crt")):
        node_id = cert_path.stem.removeprefix("envoy_")
        try:
            who = pki.envoy(node_id, domain)
        except pki.CertificateError as exc:
            errors.append(f"{cert_path}: {exc}")
            continue
        if (keys := load(who)) is not None:
            envoys.append(keys)
    if not envoys and not errors:
        errors.append(f"{directory}: no envoy_<node-id>.crt (infermesh certs issue envoy NODE)")
    own = pki.control_plane(control_plane, domain)
    me = load(own)
    ca_pem = ca.public_bytes(serialization.Encoding.PEM)  # the CA checked, not a second read
    return UpstreamTls(str(directory), domain, ca_pem, tuple(envoys), me), errors


class PkiWatch:
    """The mesh's certificates as read by a process of their own (a telemetry shard): read
    at start, again when a file changes (checked at most once a second); a renewal that
    fails its checks is logged and the last good files stay in use."""

    CHECK_EVERY_S = 1.0

    def __init__(self, directory: str, control_plane: str) -> None:
        self.directory, self.name = Path(directory), control_plane
        tls, errors = read_pki(self.directory, control_plane)
        if tls is None or errors:
            raise pki.CertificateError("; ".join(errors) or f"{directory}: no CA")
        self._tls, self._seen, self._checked = tls, self._stamp(), time.monotonic()

    def current(self) -> UpstreamTls | None:
        return self._tls

    def refresh(self) -> None:
        if time.monotonic() - self._checked < self.CHECK_EVERY_S:
            return
        self._checked = time.monotonic()
        stamp = self._stamp()
        if stamp == self._seen:
            return
        tls, errors = read_pki(self.directory, self.name)
        if tls is None or errors:
            log.warning("certificates in %s not reloaded: %s", self.directory, "; ".join(errors))
            return  # tried again at the next change
        self._tls, self._seen = tls, stamp

    def _stamp(self) -> tuple[tuple[str, int, int], ...]:
        found = []
        for path in sorted(self.directory.glob("*.crt")) + sorted(self.directory.glob("*.key")):
            with contextlib.suppress(OSError):
                info = path.stat()
                found.append((path.name, info.st_mtime_ns, info.st_size))
        return tuple(found)


def ca_secret(tls: UpstreamTls) -> secret_pb2.Secret:
    trusted = base_pb2.DataSource(inline_bytes=tls.ca_pem)
    context = common_pb2.CertificateValidationContext(trusted_ca=trusted)
    return secret_pb2.Secret(name=CA_SECRET, validation_context=context)


def identity_secret(identity: WorkloadKeys) -> secret_pb2.Secret:
    return certificate_secret(IDENTITY_SECRET, identity.cert_pem, identity.key_pem)


def certificate_secret(name: str, cert_pem: bytes, key_pem: bytes) -> secret_pb2.Secret:
    """An SDS secret holding a certificate (chain) and its key, inline."""
    certificate = common_pb2.TlsCertificate(
        certificate_chain=base_pb2.DataSource(inline_bytes=cert_pem),
        private_key=base_pb2.DataSource(inline_bytes=key_pem),
    )
    return secret_pb2.Secret(name=name, tls_certificate=certificate)


def node_secrets(tls: UpstreamTls | None) -> dict[str, dict[str, Any]]:
    """Node id -> the secrets only that node gets (its identity)."""
    if tls is None:
        return {}
    return {e.name: {IDENTITY_SECRET: identity_secret(e)} for e in tls.envoys}


def transport_socket(alpn: str) -> base_pb2.TransportSocket:
    """The model clusters' TLS: Envoy's identity and the CA over SDS (ADS), the SNI from each
    endpoint's hostname, and the server's certificate checked against that name."""
    sds = [secret_pb2.SdsSecretConfig(name=IDENTITY_SECRET, sds_config=ads_source())]
    context = tls_pb2.UpstreamTlsContext(
        common_tls_context=tls_pb2.CommonTlsContext(
            tls_certificate_sds_secret_configs=sds,
            validation_context_sds_secret_config=secret_pb2.SdsSecretConfig(
                name=CA_SECRET, sds_config=ads_source()
            ),
            alpn_protocols=[alpn],
        ),
        auto_host_sni=True,
        auto_sni_san_validation=True,
    )
    return base_pb2.TransportSocket(name=TLS_SOCKET, typed_config=packed(context))


def plaintext_match() -> cluster_pb2.Cluster.TransportSocketMatch:
    """The raw (plaintext) transport socket for members whose EDS entry carries
    ``PLAINTEXT``; every other member keeps the cluster's mTLS."""
    match = cluster_pb2.Cluster.TransportSocketMatch(
        name="plaintext-member",
        transport_socket=base_pb2.TransportSocket(
            name="envoy.transport_sockets.raw_buffer",
            typed_config=packed(raw_buffer_pb2.RawBuffer()),
        ),
    )
    match.match.update(PLAINTEXT)
    return match


def served_identities(tls: UpstreamTls) -> list[tuple[str, float]]:
    """(SPIFFE ID, expiry as Unix time) of every certificate the control plane serves or uses."""
    found = [(pki.envoy(e.name, tls.trust_domain).spiffe_id, e.not_after) for e in tls.envoys]
    if tls.control_plane is not None:
        me = pki.control_plane(tls.control_plane.name, tls.trust_domain).spiffe_id
        found.append((me, tls.control_plane.not_after))
    return found


def status(tls: UpstreamTls | None, now: float | None = None) -> dict[str, Any] | None:
    """/status's view: the trust domain and each identity with its expiry (never a key)."""
    if tls is None:
        return None
    at = time.time() if now is None else now
    return {
        "pki_dir": tls.pki_dir,
        "trust_domain": tls.trust_domain,
        "plaintext_members": sorted(tls.plaintext),
        # Kubernetes: the pod at each server address, whose name its certificate carries
        "pods": dict(sorted(tls.pods.as_dict().items())),
        "identities": [
            {
                "identity": spiffe_id,
                "expires": dt.datetime.fromtimestamp(expiry, dt.UTC).isoformat(),
                "hours_left": round((expiry - at) / 3600, 2),
            }
            for spiffe_id, expiry in served_identities(tls)
        ],
    }


def warnings(tls: UpstreamTls | None, now: float | None = None) -> list[str]:
    """Certificates not renewed in time: a renewal job that stopped shows here first."""
    if tls is None:
        return []
    at = time.time() if now is None else now
    plaintext = [
        f"endpoint {key} is a plaintext member (tls: false): its traffic, health checks and "
        "probes are neither encrypted nor authenticated"
        for key in sorted(tls.plaintext)
    ]
    return plaintext + [
        f"certificate for {spiffe_id} expires in {(expiry - at) / 3600:.1f} h: it was due for "
        f"renewal (infermesh certs rotate --dir {tls.pki_dir})"
        for spiffe_id, expiry in served_identities(tls)
        if expiry - at < OVERDUE_S
    ]


def server_credentials(tls: Callable[[], UpstreamTls | None]) -> grpc.ServerCredentials:
    """The control plane's certificate for its own ports (OTLP, xDS), client certificates from
    the mesh CA required; the files' current state is asked for (``tls()``) on each handshake,
    so a renewed certificate is used without a restart."""
    given: list[UpstreamTls | None] = [tls()]

    def configuration(current: UpstreamTls) -> grpc.ServerCertificateConfiguration:
        me = current.control_plane
        if me is None:
            raise pki.CertificateError(f"{current.pki_dir}: no control-plane certificate")
        return grpc.ssl_server_certificate_configuration(
            [(me.key_pem, me.cert_pem)], root_certificates=current.ca_pem
        )

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        current = tls()
        if current is given[0] or current is None or current.control_plane is None:
            return None
        given[0] = current
        return configuration(current)

    first = given[0]
    if first is None:
        raise pki.CertificateError("mutual TLS needs listener.upstream_tls")
    return grpc.dynamic_ssl_server_credentials(
        configuration(first), fetch, require_client_authentication=True
    )
