"""Mutual TLS from the command line to model servers: the local operator's certificate (the
one ``infermesh certs keep`` makes for ``infermesh up``), and a channel that checks the
server's own name (``pki.server_name``), as Envoy and the control plane do."""

from __future__ import annotations

from pathlib import Path

import grpc

from infermesh import pki

LOCAL_OPERATOR = "local"  # compose.yaml's mesh-certs keeps operator:local


def operator(pki_dir: Path, name: str = LOCAL_OPERATOR) -> tuple[pki.IssuedFiles, pki.Credentials]:
    """The operator's files in ``pki_dir`` and their contents, checked as a start-up checks
    them (CertificateError names the file and what is wrong)."""
    who = pki.operator(name, pki.directory_trust_domain(pki_dir))
    return pki.workload_files(pki_dir, who), pki.load_workload(pki_dir, who)


def server_name(address: str, spiffe_id: str, pod: str = "") -> str:
    """The name the server at ``address`` must present (its SNI and DNS SAN), in the trust
    domain of the caller's ``spiffe_id``: its pod's when ``pod`` (NAMESPACE/POD) is given."""
    domain = spiffe_id.removeprefix("spiffe://").split("/", 1)[0]
    return pki.server_name(address, pod, domain)


def server_channel(address: str, credentials: pki.Credentials) -> grpc.Channel:
    tls = grpc.ssl_channel_credentials(
        credentials.ca_pem, credentials.key_pem, credentials.cert_pem
    )
    name = server_name(address, credentials.spiffe_id)
    return grpc.secure_channel(address, tls, options=[("grpc.ssl_target_name_override", name)])
