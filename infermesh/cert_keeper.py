"""``infermesh certs keep``: the local mesh's certificates, made at first start and renewed
while it runs.

compose.yaml's ``mesh-certs`` service (and so ``infermesh up``) runs it before anything else:

    infermesh certs keep model-server:127.0.0.1:8001 envoy:envoy-1 control-plane:control-plane \
        operator:local --every 300

- no CA in the directory: a new one (``ca.crt``, ``ca.key`` 0600);
- each listed workload whose certificate is missing, unusable (expired, not the CA's, key not
  matching, another identity) or past two thirds of its life: issued again;
- then ``READY_FILE`` is written, which ``python -m infermesh.probe certs DIR`` (the service's
  health check) waits for, and every ``--every`` seconds the same pass runs again.

The workloads read the renewed files on their own (model servers by modification time, the
control plane through its topology watch, Envoy over SDS): nothing restarts. A pass that fails
(a full disk, a CA key gone) is logged and retried at the next interval; the last good files
stay, and ``certificate_expiry_timestamp_seconds`` and ``/status`` show the time running out.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from infermesh import cert_issuer, pki
from infermesh.addresses import is_ip

READY_FILE = "keeper.ready"  # written after each full pass: the workloads listed in it


def parse_workload(text: str, trust_domain: str) -> pki.Workload:
    """``KIND:NAME`` (``model-server:127.0.0.1:8001``, ``envoy:envoy-1``) as a Workload, and
    ``KIND:NAME=HOST,HOST`` with more names it is reached by (``control-plane:control-plane=
    control-plane-1,control-plane-2``: the replicas' DNS names on a compose network)."""
    spec, more, extra = text.partition("=")
    kind, sep, name = spec.partition(":")
    hosts = [h for h in extra.split(",") if h]
    if not sep or not name or (more and not hosts):
        raise pki.CertificateError(
            f"workload {text!r}: expected KIND:NAME[=HOST,...] with KIND one of"
            f" {', '.join(pki.KINDS)}"
        )
    dns = [h for h in hosts if not is_ip(h)]
    ips = [h for h in hosts if is_ip(h)]
    return named_workload(kind, name, trust_domain, dns, ips)


def named_workload(
    kind: str, name: str, trust_domain: str, dns: Sequence[str] = (), ips: Sequence[str] = ()
) -> pki.Workload:
    """A workload by kind and name, with the names it is reached by (a model server's address
    and DNS name, a control plane's loopback names) and any extra ``dns`` and ``ips``."""
    if kind == "model-server":
        who = pki.model_server(name, trust_domain)
    elif kind == "control-plane":
        who = pki.control_plane(name, trust_domain)
    elif kind == "edge":
        who = pki.edge(name, trust_domain)
    else:
        return pki.workload(kind, tuple(name.split("/")), trust_domain, dns, ips)
    return pki.workload(kind, who.name, trust_domain, [*who.dns, *dns], [*who.ips, *ips])


def authority(directory: Path, trust_domain: str) -> tuple[pki.Authority, bool]:
    """The CA in ``directory``, made first when there is none; and whether it was made."""
    cert, key = pki.ca_paths(directory)
    if not cert.exists() and not key.exists():
        return pki.init_authority(directory, trust_domain), True
    return pki.load_authority(directory), False


def keep_once(directory: Path, names: Sequence[str], trust_domain: str, hours: float) -> list[str]:
    """One pass: the CA, then every workload's certificate that needs issuing; the SPIFFE IDs
    issued. Writes ``READY_FILE`` when every certificate is good."""
    ca, made = authority(directory, trust_domain)
    issued = [f"a new CA for {ca.trust_domain}"] if made else []
    for name in names:
        who = parse_workload(name, ca.trust_domain)
        if _usable(directory, who):
            continue
        pki.issue(ca, who, directory, hours)
        issued.append(who.spiffe_id)
    ready = directory / READY_FILE
    tmp = ready.with_name(f".{READY_FILE}.tmp")
    tmp.write_text("".join(f"{name}\n" for name in names))
    tmp.replace(ready)
    return issued


def _usable(directory: Path, who: pki.Workload) -> bool:
    try:
        pki.load_workload(directory, who)
    except pki.CertificateError:
        return False
    return not pki.needs_renewal(pki.workload_files(directory, who).cert)


def keep(
    directory: Path,
    names: Sequence[str],
    trust_domain: str,
    hours: float,
    every_s: float,
    serve_on: str = "",
) -> int:
    """``keep_once`` now and every ``every_s`` seconds (0: once) until SIGTERM or SIGINT; with
    ``serve_on`` (HOST:PORT), after the first pass, the issuer of model servers' certificates
    for their own addresses (``infermesh.cert_issuer``)."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    (directory / READY_FILE).unlink(missing_ok=True)  # ready again only after this pass
    directory.mkdir(parents=True, exist_ok=True)
    first = True
    while True:
        try:
            for what in keep_once(directory, names, trust_domain, hours):
                print(f"infermesh certs keep: issued {what}", flush=True)
        except (pki.CertificateError, OSError) as exc:
            if first:  # nothing to keep serving with: fail the start, naming the file
                print(f"infermesh certs keep: {exc}", file=sys.stderr)
                return 1
            print(f"infermesh certs keep: renewal failed, retrying: {exc}", file=sys.stderr)
        if first and serve_on:
            cert_issuer.serve(directory, serve_on, hours)
            print(f"infermesh certs keep: issuing model-server certificates on {serve_on}")
        first = False
        if every_s <= 0 or stop.wait(every_s):
            return 0


def ready(directory: Path) -> str | None:
    """None when the keeper has finished a pass and every certificate it keeps is usable now,
    else why not (``python -m infermesh.probe certs DIR``)."""
    listed = directory / READY_FILE
    try:
        names = listed.read_text().split()
        domain = pki.directory_trust_domain(directory)
    except (OSError, pki.CertificateError):
        return f"{directory}: no certificates kept yet"
    for name in names:
        try:
            pki.load_workload(directory, parse_workload(name, domain))
        except pki.CertificateError as exc:
            return str(exc)
    return None
