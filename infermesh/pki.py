"""The mesh's certificate authority and workload certificates (the ``cryptography`` library).

Every process inside the mesh proves who it is with a short-lived X.509 certificate signed by
the mesh CA. The identity is a SPIFFE ID in the certificate's URI SAN:

    spiffe://<trust-domain>/model-server/<host>/<port>
    spiffe://<trust-domain>/model-server/pod/<namespace>/<pod>   (Kubernetes: model_server_pod)
    spiffe://<trust-domain>/envoy/<node-id>
    spiffe://<trust-domain>/control-plane/<name>
    spiffe://<trust-domain>/operator/<name>

(SPIFFE path segments allow only letters, digits, ``.``, ``-`` and ``_``, so a server's
address is two segments rather than ``host:port``.) The DNS and IP SANs a workload is reached
by ride along, so TLS hostname checks work too.

Keys are ECDSA P-256: a handshake costs a fraction of an RSA one, which matters on reconnect
storms. Files are PEM; private keys are written 0600 and never logged. Loading a workload's
files checks everything a start-up should refuse on, with a message naming the file and the
problem: missing or unreadable, not PEM, expired or not yet valid, key not matching the
certificate, not signed by the CA, or not the identity the process was told to be.

Why it is one module of this length: issuing, writing, loading and checking a certificate share
the identity rules (SAN forms, trust domain, lifetimes); split, each half would re-state them.
Its sections (files, loading and checking, helpers) read on their own.
"""

from __future__ import annotations

import datetime as dt
import functools
import ipaddress
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from infermesh.addresses import is_ip

DEFAULT_TRUST_DOMAIN = "infermesh.local"
WORKLOAD_HOURS = 24.0  # a workload certificate's default lifetime
CA_DAYS = 365
# Renew once this share of the lifetime has passed (16 h of 24): a failed renewal then has
# hours to be noticed and retried before anything expires.
RENEW_AFTER = 2 / 3
KINDS = ("model-server", "envoy", "control-plane", "operator", "edge")
_SEGMENT = re.compile(r"^[A-Za-z0-9._-]+$")
_TRUST_DOMAIN = re.compile(r"^[a-z0-9._-]+$")


class CertificateError(ValueError):
    """A certificate or key that cannot be used; names the file and the problem, never a key."""


@dataclass(frozen=True)
class Workload:
    """Who a certificate is for: its SPIFFE ID and the names it is reached by."""

    kind: str
    name: tuple[str, ...]  # path segments after the kind
    trust_domain: str = DEFAULT_TRUST_DOMAIN
    dns: tuple[str, ...] = ()
    ips: tuple[str, ...] = ()

    @property
    def spiffe_id(self) -> str:
        return f"spiffe://{self.trust_domain}/{self.kind}/" + "/".join(self.name)

    @property
    def file_stem(self) -> str:
        """A file name for it: ``model-server_127.0.0.1_8001``."""
        return "_".join((self.kind, *self.name))


def model_server(address: str, trust_domain: str = DEFAULT_TRUST_DOMAIN) -> Workload:
    """The identity of the model server at ``host:port`` (its advertised address). Besides
    its SPIFFE ID and address it names ``server_dns_name``: Envoy sends that as the SNI of
    each connection to the server and checks the certificate carries it, so a certificate
    for one server does not pass at another's address."""
    host, port = _split_address(address)
    ips, dns = ((host,), ()) if is_ip(host) else ((), (host,))
    dns = (*dns, server_dns_name(address, trust_domain))
    return workload("model-server", (host.replace(":", "."), port), trust_domain, dns, ips)


def server_dns_name(address: str, trust_domain: str = DEFAULT_TRUST_DOMAIN) -> str:
    """``p8001.127.0.0.1.model-server.infermesh.local`` for ``127.0.0.1:8001``: a DNS name
    per server (an SNI cannot be an IP address), port first so labels stay short."""
    host, port = _split_address(address)
    if ":" in host:  # IPv6: every group written out, so no label starts or ends with '-'
        host = ipaddress.ip_address(host).exploded.replace(":", "-")
    return f"p{port}.{host}.model-server.{trust_domain}"


def model_server_pod(
    namespace: str, pod: str, trust_domain: str = DEFAULT_TRUST_DOMAIN
) -> Workload:
    """The identity of the model server that is Kubernetes pod ``namespace/pod``. On a
    cluster a server's address is its pod IP, which is given only after its volumes are
    mounted, so cert-manager's csi-driver cannot put it in a certificate; it can name the pod
    (``${POD_NAMESPACE}``, ``${POD_NAME}``). The control plane learns which pod holds which
    address from the EndpointSlices' ``targetRef`` (``ServerPods``) and checks the pod's
    name wherever it would check the address's: Envoy's SNI, placement probes, telemetry."""
    return workload(
        "model-server", ("pod", namespace, pod), trust_domain,
        (pod_dns_name(namespace, pod, trust_domain),),
    )  # fmt: skip


def pod_dns_name(namespace: str, pod: str, trust_domain: str = DEFAULT_TRUST_DOMAIN) -> str:
    """``model-server-7d9f-x2x.infermesh.pod.model-server.infermesh.local``: the pod's
    certificate name, sent as SNI (as ``server_dns_name`` is for an address)."""
    return f"{pod}.{namespace}.pod.model-server.{trust_domain}"


def server_workload(
    address: str, pod: str = "", trust_domain: str = DEFAULT_TRUST_DOMAIN
) -> Workload:
    """The server at ``address``: the pod's identity when discovery knows it (``pod`` is
    ``NAMESPACE/POD``), else the address's."""
    if pod:
        return model_server_pod(*split_pod(pod), trust_domain)
    return model_server(address, trust_domain)


def server_name(address: str, pod: str = "", trust_domain: str = DEFAULT_TRUST_DOMAIN) -> str:
    """The DNS name the server at ``address`` is checked against (SNI and hostname check):
    its pod's (``pod_dns_name``) when discovery knows it, else ``server_dns_name``."""
    if pod:
        return pod_dns_name(*split_pod(pod), trust_domain)
    return server_dns_name(address, trust_domain)


def split_pod(pod: str) -> tuple[str, str]:
    """``NAMESPACE/POD`` as (namespace, pod); CertificateError unless both are there."""
    namespace, sep, name = pod.partition("/")
    if not sep or not namespace or not name:
        raise CertificateError(f"pod {pod!r}: expected NAMESPACE/POD")
    return namespace, name


def _split_address(address: str) -> tuple[str, str]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise CertificateError(f"model server address {address!r}: expected host:port")
    return host.strip("[]"), port


def envoy(node_id: str, trust_domain: str = DEFAULT_TRUST_DOMAIN) -> Workload:
    return workload("envoy", (node_id,), trust_domain)


def control_plane(
    name: str = "control-plane",
    trust_domain: str = DEFAULT_TRUST_DOMAIN,
    hosts: Sequence[str] = ("127.0.0.1", "localhost"),
) -> Workload:
    ips = tuple(h for h in hosts if is_ip(h))
    dns = tuple(h for h in hosts if not is_ip(h))
    return workload("control-plane", (name,), trust_domain, dns, ips)


def edge(host: str, trust_domain: str = DEFAULT_TRUST_DOMAIN) -> Workload:
    """The public listener's certificate, when the mesh CA makes it (clients then trust
    ``ca.crt``): named ``host``, and for ``localhost`` the loopback addresses too (the quick
    start's clients dial 127.0.0.1). No model server accepts it as a client."""
    if is_ip(host):
        return workload("edge", (host.replace(":", "."),), trust_domain, (), (host,))
    ips = ("127.0.0.1", "::1") if host == "localhost" else ()
    return workload("edge", (host,), trust_domain, (host,), ips)


def operator(name: str, trust_domain: str = DEFAULT_TRUST_DOMAIN) -> Workload:
    return workload("operator", (name,), trust_domain)


def workload(
    kind: str,
    name: Sequence[str],
    trust_domain: str = DEFAULT_TRUST_DOMAIN,
    dns: Sequence[str] = (),
    ips: Sequence[str] = (),
) -> Workload:
    """A checked ``Workload``: a known kind, SPIFFE-legal segments and trust domain."""
    if kind not in KINDS:
        raise CertificateError(f"workload kind {kind!r}: expected one of {', '.join(KINDS)}")
    if not _TRUST_DOMAIN.match(trust_domain):
        raise CertificateError(
            f"trust domain {trust_domain!r}: expected lower-case letters, digits, '.', '-', '_'"
        )
    for segment in name:
        if not _SEGMENT.match(segment) or segment in (".", ".."):
            raise CertificateError(
                f"{kind} name segment {segment!r}: expected letters, digits, '.', '-', '_'"
            )
    for ip in ips:
        if not is_ip(ip):
            raise CertificateError(f"{kind} IP SAN {ip!r}: not an IP address")
    return Workload(kind, tuple(name), trust_domain, tuple(dns), tuple(ips))


def parse_spiffe_id(text: str) -> Workload | None:
    """The workload a SPIFFE ID names, or None when it is not one of the mesh's kinds."""
    match = re.match(r"^spiffe://([^/]+)/([^/]+)/(.+)$", text)
    if not match:
        return None
    domain, kind, rest = match.groups()
    try:
        return workload(kind, tuple(rest.split("/")), domain)
    except CertificateError:
        return None


@functools.lru_cache(maxsize=4096)
def mesh_peer(spiffe_id: str | None, trust_domain: str) -> Workload | None:
    """The workload a verified peer is, if it is one of ``trust_domain``'s (else None).
    Cached: a server asks on every call, and its peers are few."""
    who = parse_spiffe_id(spiffe_id) if spiffe_id else None
    return who if who is not None and who.trust_domain == trust_domain else None


def peer_spiffe_id(auth_context: Mapping[str, Sequence[bytes]]) -> str | None:
    """The SPIFFE ID gRPC read from the peer's certificate (``context.auth_context()``)."""
    values = auth_context.get("peer_spiffe_id") or []
    return values[0].decode() if values else None


# --- files ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Authority:
    """The mesh CA: its certificate and key (the key only where certificates are issued)."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    trust_domain: str


@dataclass(frozen=True)
class IssuedFiles:
    cert: Path
    key: Path


def ca_paths(directory: Path) -> tuple[Path, Path]:
    return directory / "ca.crt", directory / "ca.key"


def init_authority(
    directory: Path, trust_domain: str = DEFAULT_TRUST_DOMAIN, days: int = CA_DAYS
) -> Authority:
    """A new CA in ``directory`` (``ca.crt``, ``ca.key`` 0600). Refuses to replace one."""
    cert_path, key_path = ca_paths(directory)
    if cert_path.exists() or key_path.exists():
        raise CertificateError(f"{cert_path}: a CA is already there (remove it to start over)")
    workload("operator", ("ca",), trust_domain)  # checks the trust domain
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "InferMesh"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"InferMesh CA {trust_domain}"),
        ]
    )
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    _write_private(key_path, _key_pem(key))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return Authority(cert, key, trust_domain)


def load_authority(directory: Path) -> Authority:
    """The CA in ``directory``, key included (for issuing)."""
    cert_path, key_path = ca_paths(directory)
    cert = read_certificate(cert_path)
    key = read_private_key(key_path)
    _check_pair(key, cert, key_path, cert_path)
    return Authority(cert, key, trust_domain_of_ca(cert))


def issue(
    authority: Authority,
    who: Workload,
    directory: Path,
    hours: float = WORKLOAD_HOURS,
    start: dt.datetime | None = None,
) -> IssuedFiles:
    """A certificate and key for ``who``, written as ``<stem>.crt`` and ``<stem>.key`` (0600),
    replacing any before (the key is written first, then the certificate, each atomically, so
    a reader never sees a certificate without its key). ``start``: when its validity begins
    (now; an earlier time makes certificates that have already expired, for tests)."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _signed(authority, who, key.public_key(), hours, start)
    directory.mkdir(parents=True, exist_ok=True)
    files = workload_files(directory, who)
    _write_private(files.key, _key_pem(key))
    _write_atomic(files.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return files


def _signed(
    authority: Authority,
    who: Workload,
    public_key: ec.EllipticCurvePublicKey,
    hours: float,
    start: dt.datetime | None = None,
) -> x509.Certificate:
    """``who``'s certificate for ``public_key``, signed by the CA."""
    if who.trust_domain != authority.trust_domain:
        raise CertificateError(
            f"{who.spiffe_id}: the CA is for trust domain {authority.trust_domain!r}"
        )
    now = start or _now()
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(who.spiffe_id)]
    names += [x509.DNSName(d) for d in who.dns]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in who.ips]
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, who.file_stem[:64])]))
        .issuer_name(authority.cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(hours=hours))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(authority.key.public_key()),
            critical=False,
        )
        .sign(authority.key, hashes.SHA256())
    )


def sign_request(
    authority: Authority, who: Workload, request_pem: bytes, hours: float = WORKLOAD_HOURS
) -> bytes:
    """A certificate (PEM) for ``who`` with the public key of a certificate signing request,
    which must be PEM, self-signed (proof that its sender holds the key) and for a P-256
    key. Only the key is taken from it: ``who`` (its names) is the caller's decision."""
    try:
        request = x509.load_pem_x509_csr(request_pem)
    except ValueError as exc:
        raise CertificateError(f"certificate request: not a PEM CSR ({exc})") from None
    if not request.is_signature_valid:
        raise CertificateError("certificate request: its signature does not verify")
    public_key = request.public_key()
    if (
        not isinstance(public_key, ec.EllipticCurvePublicKey)
        or public_key.curve.name != "secp256r1"
    ):
        raise CertificateError("certificate request: expected an ECDSA P-256 key")
    cert = _signed(authority, who, public_key, hours)
    return cert.public_bytes(serialization.Encoding.PEM)


def new_request() -> tuple[bytes, bytes]:
    """A fresh P-256 key and a CSR for it: (key PEM, CSR PEM). The CSR names nothing: the
    issuer decides the names (``sign_request``)."""
    key = ec.generate_private_key(ec.SECP256R1())
    request = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .sign(key, hashes.SHA256())
    )
    return _key_pem(key), request.public_bytes(serialization.Encoding.PEM)


# --- loading and checking --------------------------------------------------------------------


@dataclass(frozen=True)
class Credentials:
    """A workload's checked certificate, key and the CA that verifies its peers (PEM bytes,
    as gRPC, Envoy's SDS and ``ssl`` take them)."""

    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes
    spiffe_id: str
    not_after: dt.datetime
    not_before: dt.datetime

    def __repr__(self) -> str:  # never the key
        return f"Credentials({self.spiffe_id}, not_after={self.not_after.isoformat()})"


def workload_files(directory: Path, who: Workload) -> IssuedFiles:
    """Where ``issue`` writes ``who``'s certificate and key in ``directory``."""
    return IssuedFiles(directory / f"{who.file_stem}.crt", directory / f"{who.file_stem}.key")


def directory_trust_domain(directory: Path) -> str:
    """The trust domain of the CA in ``directory`` (its ``ca.crt``)."""
    return trust_domain_of_ca(read_certificate(ca_paths(directory)[0]))


def load_workload(directory: Path, who: Workload) -> Credentials:
    """``who``'s files in ``directory``, checked against its CA and identity
    (``load_credentials``)."""
    files = workload_files(directory, who)
    return load_credentials(files.cert, files.key, ca_paths(directory)[0], who.spiffe_id)


def load_credentials(
    cert_path: Path, key_path: Path, ca_path: Path, expect: str | None = None
) -> Credentials:
    """A workload's files, checked as a start-up must: readable PEM, within their validity,
    key matching, signed by the CA, and (``expect``) carrying that SPIFFE ID."""
    ca = read_certificate(ca_path)
    _check_validity(ca, ca_path)
    cert = read_certificate(cert_path)
    key_pem = _read(key_path, "private key")  # read once: the key checked is the key returned
    _check_pair(_private_key(key_pem, key_path), cert, key_path, cert_path)
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise CertificateError(f"{cert_path}: not signed by the mesh CA in {ca_path}") from None
    _check_validity(cert, cert_path)
    identity = spiffe_id_of(cert)
    if identity is None:
        raise CertificateError(f"{cert_path}: no spiffe:// URI SAN (not a mesh certificate)")
    if expect is not None and identity != expect:
        raise CertificateError(f"{cert_path}: is for {identity}, expected {expect}")
    return Credentials(
        cert.public_bytes(serialization.Encoding.PEM),
        key_pem,
        ca.public_bytes(serialization.Encoding.PEM),
        identity,
        cert.not_valid_after_utc,
        cert.not_valid_before_utc,
    )


@dataclass(frozen=True)
class ServerPair:
    """A server certificate (chain) and key that need not be the mesh's: the public
    listener's, from a public CA or the organisation's own."""

    cert_pem: bytes  # the file as read: the leaf first, then any intermediates
    key_pem: bytes = field(repr=False)
    not_after: dt.datetime = dt.datetime.min
    names: tuple[str, ...] = ()  # the leaf's DNS and IP names
    not_before: dt.datetime = dt.datetime.min


def load_server_pair(cert_path: Path, key_path: Path) -> ServerPair:
    """A server's files, checked as a start-up must: PEM, within validity, key matching the
    leaf (EC or RSA). The message names the file and the problem, never the key."""
    cert_pem = _read(cert_path, "certificate")
    leaf = _certificate(cert_pem, cert_path)  # the first in the file
    key_pem = _read(key_path, "private key")
    _check_pair(_any_private_key(key_pem, key_path), leaf, key_path, cert_path)
    _check_validity(leaf, cert_path)
    try:
        san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = [*san.get_values_for_type(x509.DNSName)]
        names += [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]
    except x509.ExtensionNotFound:
        names = []
    return ServerPair(
        cert_pem, key_pem, leaf.not_valid_after_utc, tuple(names), leaf.not_valid_before_utc
    )


def spiffe_id_of(cert: x509.Certificate) -> str | None:
    """The certificate's one spiffe:// URI SAN (None without exactly one)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    spiffe = [u for u in uris if u.startswith("spiffe://")]
    return spiffe[0] if len(spiffe) == 1 else None


def read_certificate(path: Path) -> x509.Certificate:
    return _certificate(_read(path, "certificate"), path)


def _certificate(data: bytes, path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError:
        raise CertificateError(f"{path}: not a PEM certificate") from None


def read_private_key(path: Path) -> ec.EllipticCurvePrivateKey:
    return _private_key(_read(path, "private key"), path)


def _any_private_key(data: bytes, path: Path) -> PrivateKeyTypes:
    try:
        return serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise CertificateError(f"{path}: not an unencrypted PEM private key") from None


def _private_key(data: bytes, path: Path) -> ec.EllipticCurvePrivateKey:
    """A mesh key: EC only (the mesh issues P-256)."""
    key = _any_private_key(data, path)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertificateError(f"{path}: expected an EC private key")
    return key


def needs_renewal(path: Path, now: dt.datetime | None = None) -> bool:
    """True when the certificate at ``path`` is missing, unreadable or past its renewal point."""
    try:
        cert = read_certificate(path)
    except CertificateError:
        return True
    begin, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    return (now or _now()) >= begin + (end - begin) * RENEW_AFTER


def describe(path: Path) -> str:
    """One line about a certificate: identity, validity, issuer (for ``infermesh certs show``)."""
    cert = read_certificate(path)
    left = cert.not_valid_after_utc - _now()
    state = "EXPIRED" if left.total_seconds() <= 0 else f"{_hours(left)} left"
    who = spiffe_id_of(cert) or cert.subject.rfc4514_string()
    return f"{path.name}: {who}; valid until {cert.not_valid_after_utc:%Y-%m-%d %H:%M}Z ({state})"


# --- helpers ---------------------------------------------------------------------------------


def _check_pair(
    key: PrivateKeyTypes, cert: x509.Certificate, key_path: Path, cert_path: Path
) -> None:
    if key.public_key() != cert.public_key():
        raise CertificateError(f"{key_path}: this key does not belong to {cert_path}")


def _check_validity(cert: x509.Certificate, path: Path) -> None:
    now = _now()
    if now < cert.not_valid_before_utc:
        raise CertificateError(
            f"{path}: not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M:%S}Z"
        )
    if now >= cert.not_valid_after_utc:
        raise CertificateError(f"{path}: expired at {cert.not_valid_after_utc:%Y-%m-%d %H:%M:%S}Z")


def trust_domain_of_ca(cert: x509.Certificate) -> str:
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    text = str(names[0].value) if names else ""
    prefix = "InferMesh CA "
    return text[len(prefix) :] if text.startswith(prefix) else DEFAULT_TRUST_DOMAIN


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise CertificateError(f"{path}: {what} file not found") from None
    except OSError as exc:
        raise CertificateError(f"{path}: cannot read the {what}: {exc.strerror}") from None


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def write_private(path: Path, data: bytes) -> None:
    """A key file: 0600, written atomically."""
    _write_private(path, data)


def write_public(path: Path, data: bytes) -> None:
    """A certificate file: 0644, written atomically."""
    _write_atomic(path, data, 0o644)


def _write_private(path: Path, data: bytes) -> None:
    _write_atomic(path, data, 0o600)


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _hours(delta: dt.timedelta) -> str:
    hours = delta.total_seconds() / 3600
    return f"{hours:.1f} h" if hours < 48 else f"{hours / 24:.0f} days"
