"""Mutual TLS from the command line to model servers: the local operator's certificate (the
one ``infermesh certs keep`` makes for ``infermesh up``), and a channel that checks the
server's own name (``pki.server_dns_name``), as Envoy and the control plane do."""

from __future__ import annotations

from pathlib import Path

import grpc

from infermesh import pki

LOCAL_OPERATOR = "local"  # compose.yaml's mesh-certs keeps operator:local


def operator_files(pki_dir: Path, name: str = LOCAL_OPERATOR) -> tuple[Path, Path, Path]:
    """The operator's CA, key and certificate files in ``pki_dir``, checked as a start-up
    checks them (CertificateError names the file and what is wrong)."""
    ca = pki.ca_paths(pki_dir)[0]
    domain = pki.trust_domain_of_ca(pki.read_certificate(ca))
    who = pki.operator(name, domain)
    cert, key = (pki_dir / f"{who.file_stem}.{ext}" for ext in ("crt", "key"))
    pki.load_credentials(cert, key, ca, expect=who.spiffe_id)
    return ca, key, cert


def operator(pki_dir: Path, name: str = LOCAL_OPERATOR) -> pki.Credentials:
    """The operator's checked credentials in ``pki_dir``."""
    ca, key, cert = operator_files(pki_dir, name)
    return pki.load_credentials(cert, key, ca)


def server_name(address: str, spiffe_id: str) -> str:
    """The name the server at ``address`` must present (its SNI and DNS SAN), in the trust
    domain of the caller's ``spiffe_id``."""
    domain = spiffe_id.removeprefix("spiffe://").split("/", 1)[0]
    return pki.server_dns_name(address, domain)


def server_channel(address: str, credentials: pki.Credentials) -> grpc.Channel:
    tls = grpc.ssl_channel_credentials(
        credentials.ca_pem, credentials.key_pem, credentials.cert_pem
    )
    name = server_name(address, credentials.spiffe_id)
    return grpc.secure_channel(address, tls, options=[("grpc.ssl_target_name_override", name)])
