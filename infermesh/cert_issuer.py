"""Model-server certificates for addresses nobody knows in advance: a scaled compose service.

A model server's mesh identity is its address (``spiffe://TD/model-server/IP/PORT``), and the
replicas of ``docker compose up --scale`` (or ``deploy.replicas``) get their addresses from
Docker when they start. So the keeper cannot make their certificates ahead of time. Instead:

- ``infermesh certs keep ... --serve HOST:PORT`` (compose.private.yaml's mesh-certs) also
  answers ``POST /v1/model-server?port=P`` with a certificate signing request in the body. It
  signs the request's key for ``model-server/<the caller's IP>/<P>``: the address the request
  came from, never one the caller names. On a Docker network a container's source address is
  set by the engine; a process there cannot take another's (it would need CAP_NET_RAW, which
  the image's non-root user does not have). So a caller can be certified only as itself.
- ``infermesh certs request --from URL --port P --ca CA --out DIR`` (in each server's
  container) makes a key (never sent), sends the request, checks that the answer is signed by
  the CA it read from the mesh's read-only volume and names a model server, writes
  ``DIR/server.key`` (0600) then ``DIR/server.crt``, and prints the certified address, which
  the server then advertises. With ``--every S`` it renews the certificate, with a new key,
  once two thirds of its life have passed; the server reads renewed files without a restart.

Nothing secret crosses the network: a request holds a public key, an answer a certificate.
The issuer is plain HTTP for that reason; what a caller could do with it is obtain a
certificate for its own address, which the control plane routes to only if Docker's DNS lists
that address under the servers' service name. Kubernetes does the same with cert-manager's
csi-driver, which trusts the kubelet for the pod's name (docs/security.md).
"""

from __future__ import annotations

import http.server
import ipaddress
import json
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature

from infermesh import pki

CERT_FILE, KEY_FILE = "server.crt", "server.key"
MAX_REQUEST_BYTES = 16 * 1024


def serve(directory: Path, listen: str, hours: float) -> http.server.ThreadingHTTPServer:
    """Starts the issuer on ``listen`` (HOST:PORT) in a daemon thread, signing with the CA in
    ``directory``; returns the server (``shutdown()`` stops it)."""
    host, _, port = listen.rpartition(":")
    authority = pki.load_authority(directory)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            if url.path != "/v1/model-server":
                self._answer(404, {"error": f"{url.path}: expected /v1/model-server"})
                return
            query = urllib.parse.parse_qs(url.query)
            try:
                port = int(query.get("port", [""])[0])
                if not 0 < port < 65536:
                    raise ValueError
            except ValueError:
                self._answer(400, {"error": "port: expected ?port=N with 1 <= N <= 65535"})
                return
            size = int(self.headers.get("content-length") or 0)
            if not 0 < size <= MAX_REQUEST_BYTES:
                expected = f"body: expected a PEM CSR of 1..{MAX_REQUEST_BYTES} bytes"
                self._answer(400, {"error": expected})
                return
            caller = self.client_address[0]
            address = f"[{caller}]:{port}" if ":" in caller else f"{caller}:{port}"
            who = pki.model_server(address, authority.trust_domain)
            try:
                cert = pki.sign_request(authority, who, self.rfile.read(size), hours)
            except pki.CertificateError as exc:
                self._answer(400, {"error": str(exc)})
                return
            print(f"infermesh certs keep: issued {who.spiffe_id} to {caller}", flush=True)
            self._answer(200, {"address": address, "certificate": cert.decode()})

        def _answer(self, status: int, body: dict[str, str]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            return  # issuances are printed above; nothing else is worth a line

    server = http.server.ThreadingHTTPServer((host or "0.0.0.0", int(port)), Handler)
    threading.Thread(target=server.serve_forever, name="cert-issuer", daemon=True).start()
    return server


def request_once(url: str, port: int, ca_path: Path, out: Path, timeout_s: float = 10) -> str:
    """One certificate from the issuer at ``url`` for this host's address and ``port``,
    checked and written to ``out``; the certified address (HOST:PORT)."""
    key_pem, csr_pem = pki.new_request()
    target = f"{url.rstrip('/')}/v1/model-server?port={port}"
    post = urllib.request.Request(target, data=csr_pem, method="POST",
                                  headers={"content-type": "application/pkcs10"})  # fmt: skip
    try:
        with urllib.request.urlopen(post, timeout=timeout_s) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise pki.CertificateError(f"{target}: {exc.code} {exc.read()[:500]!r}") from None
    except (OSError, ValueError) as exc:
        raise pki.CertificateError(f"{target}: {exc}") from None
    address, cert_pem = str(body["address"]), str(body["certificate"]).encode()
    ca = pki.read_certificate(ca_path)
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise pki.CertificateError(f"{target}: the answer is not signed by {ca_path}") from None
    expected = pki.model_server(address, pki.trust_domain_of_ca(ca)).spiffe_id
    if pki.spiffe_id_of(cert) != expected:
        raise pki.CertificateError(f"{target}: the answer names {pki.spiffe_id_of(cert)}")
    host = address.rpartition(":")[0].strip("[]")
    ipaddress.ip_address(host)  # the issuer certifies addresses only
    out.mkdir(parents=True, exist_ok=True)
    pki.write_private(out / KEY_FILE, key_pem)  # the key before its certificate
    pki.write_public(out / CERT_FILE, cert_pem)
    return address


def request(url: str, port: int, ca_path: Path, out: Path, every_s: float) -> int:
    """``request_once`` now (its address printed), then, with ``every_s``, a renewal check
    every ``every_s`` seconds, renewing past two thirds of the certificate's life. A failed
    first request fails (exit 1, naming the issuer and why); a failed renewal is retried.
    With ``every_s``, a certificate already in ``out`` and not due is kept: the renewal loop
    starts beside a server that has just read it, and must not swap its key underneath."""
    cert = out / CERT_FILE
    if not (every_s > 0 and cert.exists() and not pki.needs_renewal(cert)):
        try:
            print(request_once(url, port, ca_path, out), flush=True)
        except pki.CertificateError as exc:
            print(f"infermesh certs request: {exc}", file=sys.stderr)
            return 1
    while every_s > 0:
        time.sleep(every_s)
        if not pki.needs_renewal(out / CERT_FILE):
            continue
        try:
            request_once(url, port, ca_path, out)
        except pki.CertificateError as exc:
            print(f"infermesh certs request: renewal failed, retrying: {exc}", file=sys.stderr)
    return 0
