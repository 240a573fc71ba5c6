"""TLS on the public listener: gRPC over TLS and HTTPS, HTTP/2 negotiated by ALPN.

``listener.tls: {cert_file: F, key_file: K}`` in the topology names the certificate clients
see (a chain: the leaf first) and its key: from a public CA, the organisation's own, or the
mesh CA (``infermesh certs issue edge NAME --dns HOST``). The control plane reads them (checked
as a start-up would: PEM, within validity, the key matching the leaf, EC or RSA) and serves
them to Envoy over SDS on the ADS stream as the secret ``edge-certificate``; the listener's
filter chain terminates TLS with it and offers ``h2`` then ``http/1.1`` by ALPN, so gRPC
clients get HTTP/2 and REST clients either. A renewed file is a changed file: the control
plane re-reads it and pushes the new secret, and Envoy uses it for new connections without a
restart; a file that fails its checks keeps the last good topology in use and shows in
``/status``. Client certificates are not asked for: clients prove who they are with
``listener.auth`` (API keys or JWTs).
"""

from __future__ import annotations

import datetime as dt
import math
import time
from pathlib import Path
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.transport_sockets.tls.v3 import secret_pb2, tls_pb2

from control_plane.model.mesh import EdgeTls
from control_plane.model.schema import Checker
from control_plane.xds.envoy_values import ads_source, packed
from control_plane.xds.upstream_tls import TLS_SOCKET, certificate_secret
from infermesh import pki

EDGE_SECRET = "edge-certificate"
ALPN = ("h2", "http/1.1")
WARN_BEFORE_S = 7 * 24 * 3600  # public certificates renew 30 days ahead: a week left is late
# ... and a short-lived one (the mesh CA's edge certificate lives 24 h and is renewed with a
# third left) is late with a quarter of its life left, not from the moment it is made.
WARN_LIFETIME_SHARE = 0.25
_KEYS = {"cert_file": "path", "key_file": "path"}


def parse_edge_tls(c: Checker, value: object, path: str, base: Path) -> EdgeTls | None:
    """``listener.tls`` (None when absent): its files read and checked now."""
    if value is None:
        return None
    m = c.mapping(value, path)
    if m is None:
        return None
    c.keys(m, path, _KEYS, required=("cert_file", "key_file"))
    files = []
    for key in ("cert_file", "key_file"):
        given = m.get(key)
        if not isinstance(given, str) or not given:
            c.fail(f"{path}.{key}", "must be a file path", given)
            return None
        files.append(Path(given) if Path(given).is_absolute() else base / given)
    try:
        pair = pki.load_server_pair(files[0], files[1])
    except pki.CertificateError as exc:
        c.errors.append(f"{path}: {exc}")
        return None
    return EdgeTls(
        str(files[0]), str(files[1]), pair.cert_pem, pair.key_pem,
        pair.not_after.timestamp(), pair.names, pair.not_before.timestamp(),
    )  # fmt: skip


def secret(tls: EdgeTls) -> secret_pb2.Secret:
    return certificate_secret(EDGE_SECRET, tls.cert_pem, tls.key_pem)


def transport_socket() -> base_pb2.TransportSocket:
    """The listener's TLS: the certificate over SDS (ADS), h2 preferred by ALPN."""
    context = tls_pb2.DownstreamTlsContext(
        common_tls_context=tls_pb2.CommonTlsContext(
            tls_certificate_sds_secret_configs=[
                secret_pb2.SdsSecretConfig(name=EDGE_SECRET, sds_config=ads_source())
            ],
            alpn_protocols=list(ALPN),
        )
    )
    return base_pb2.TransportSocket(name=TLS_SOCKET, typed_config=packed(context))


def status(tls: EdgeTls | None, now: float | None = None) -> dict[str, Any] | None:
    """/status's view: the files, the names and the expiry (never the key)."""
    if tls is None:
        return None
    at = time.time() if now is None else now
    return {
        "cert_file": tls.cert_file,
        "names": list(tls.names),
        "expires": dt.datetime.fromtimestamp(tls.not_after, dt.UTC).isoformat(),
        "hours_left": round((tls.not_after - at) / 3600, 2),
        "alpn": list(ALPN),
    }


def warnings(tls: EdgeTls | None, now: float | None = None) -> list[str]:
    if tls is None:
        return []
    left = tls.not_after - (time.time() if now is None else now)
    lifetime = tls.not_after - tls.not_before if tls.not_before else math.inf
    if left >= min(WARN_BEFORE_S, lifetime * WARN_LIFETIME_SHARE):
        return []
    return [
        f"the public listener's certificate {tls.cert_file} expires in {left / 3600:.1f} h: "
        "renew it (the control plane picks the new file up without a restart)"
    ]
