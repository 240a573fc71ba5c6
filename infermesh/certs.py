"""``infermesh certs init|issue|rotate|show``: the mesh CA and workload certificates.

- ``init``: a new CA in ``.infermesh/pki`` (``ca.crt``, ``ca.key`` 0600); refuses to replace one.
- ``issue KIND NAME``: a workload certificate (24 h by default) in the same directory, e.g.
  ``issue model-server 127.0.0.1:8001``, ``issue envoy envoy-1``, ``issue operator alice``.
- ``rotate``: re-issues every workload certificate there that is past two thirds of its life
  (``--force``: all of them), keeping each identity and its DNS/IP names. Processes pick the new
  files up on their own (Envoy through the control plane's SDS); nothing restarts.
- ``show``: each certificate's identity and how long it has left.
- ``keep KIND:NAME ... [--every S] [--serve HOST:PORT]``: the CA and each listed certificate
  made when missing or unusable and renewed when due, once or every S seconds
  (``infermesh.cert_keeper``; compose's ``mesh-certs`` service); ``--serve``: also certify
  model servers for their own addresses (``infermesh.cert_issuer``).
- ``request --from URL --port P --ca FILE --out DIR [--every S]``: a model server's
  certificate for this host's address from such an issuer; prints the address.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from cryptography import x509

from infermesh import cert_issuer, cert_keeper, pki

PKI_DIR = Path(".infermesh") / "pki"


def add_parser(commands: Any, root: Path) -> None:
    certs = commands.add_parser("certs", help="the mesh CA and workload certificates (mTLS)")
    certs.add_argument("action", choices=("init", "issue", "rotate", "show", "keep", "request"))
    certs.add_argument(
        "workload",
        nargs="*",
        help=f"issue: KIND NAME (KIND one of {', '.join(pki.KINDS)}; NAME is HOST:PORT for a "
        "model server); keep: KIND:NAME ... (infermesh.cert_keeper); before any option",
    )
    certs.add_argument("--dir", type=Path, default=root / PKI_DIR, help="the CA and certs")
    certs.add_argument("--trust-domain", default=pki.DEFAULT_TRUST_DOMAIN, help="init: the CA's")
    certs.add_argument("--hours", type=float, default=pki.WORKLOAD_HOURS, help="issue, rotate")
    certs.add_argument("--dns", action="append", default=[], help="issue: an extra DNS name")
    certs.add_argument("--ip", action="append", default=[], help="issue: an extra IP address")
    certs.add_argument("--force", action="store_true", help="rotate: every certificate, now")
    certs.add_argument(
        "--every",
        type=float,
        default=0.0,
        help="keep: run again every this many seconds; request: check for renewal as often",
    )
    certs.add_argument(
        "--serve",
        default="",
        metavar="HOST:PORT",
        help="keep: certify model servers for their own addresses here",
    )
    certs.add_argument(
        "--from",
        dest="issuer",
        default="",
        metavar="URL",
        help="request: the issuer (keep --serve), e.g. http://mesh-certs:8443",
    )
    certs.add_argument("--port", type=int, default=8001, help="request: the server's gRPC port")
    certs.add_argument("--ca", type=Path, help="request: the mesh CA to check the answer with")
    certs.add_argument("--out", type=Path, help="request: where server.crt and server.key go")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except pki.CertificateError as exc:
        print(f"infermesh certs {args.action}: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    directory: Path = args.dir
    if args.action == "init":
        authority = pki.init_authority(directory, args.trust_domain)
        print(f"infermesh: a new CA for {authority.trust_domain} in {directory}")
        return 0
    if args.action == "keep":
        return cert_keeper.keep(
            directory, args.workload, args.trust_domain, args.hours, args.every, args.serve
        )
    if args.action == "request":
        if not (args.issuer and args.ca and args.out):
            print("infermesh certs request: needs --from, --ca and --out", file=sys.stderr)
            return 2
        return cert_issuer.request(args.issuer, args.port, args.ca, args.out, args.every)
    if args.action == "show":
        for path in sorted(directory.glob("*.crt")):
            print(pki.describe(path))
        return 0
    authority = pki.load_authority(directory)
    if args.action == "issue":
        if len(args.workload) != 2:
            print("infermesh certs issue: needs KIND and NAME", file=sys.stderr)
            return 2
        kind, name = args.workload
        who = cert_keeper.named_workload(kind, name, authority.trust_domain, args.dns, args.ip)
        files = pki.issue(authority, who, directory, args.hours)
        print(f"infermesh: {who.spiffe_id} -> {files.cert}, {files.key}")
        return 0
    renewed = rotate(authority, directory, args.hours, args.force)
    print(f"infermesh: renewed {len(renewed)} certificate(s)")
    for spiffe_id in renewed:
        print(f"  {spiffe_id}")
    return 0


def rotate(authority: pki.Authority, directory: Path, hours: float, force: bool) -> list[str]:
    """Re-issue the workload certificates in ``directory`` that need it; their SPIFFE IDs."""
    renewed = []
    for path in sorted(directory.glob("*.crt")):
        if path.name == "ca.crt" or not (force or pki.needs_renewal(path)):
            continue
        who = workload_of(pki.read_certificate(path))
        if who is None:
            continue  # not one of ours (a file someone put here): left alone
        pki.issue(authority, who, directory, hours)
        renewed.append(who.spiffe_id)
    return renewed


def workload_of(cert: x509.Certificate) -> pki.Workload | None:
    """The identity and names a certificate was issued for (to issue it again)."""
    spiffe = pki.spiffe_id_of(cert)
    who = pki.parse_spiffe_id(spiffe) if spiffe else None
    if who is None:
        return None
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns = san.get_values_for_type(x509.DNSName)
    ips = [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]
    return pki.workload(who.kind, who.name, who.trust_domain, dns, ips)
