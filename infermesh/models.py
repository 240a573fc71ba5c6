"""``infermesh models index|load|unload``: model control for the whole pool, as an operator.

Model control never goes through Envoy's public listener (it refuses it). This talks to each
model server's own gRPC port, with the operator credential the servers require for their
model-repository API (``--restricted-api``): by default the header ``infermesh-operator-key``
with the key in ``.infermesh/operator.key``, which ``infermesh up`` creates. The servers are
the ones the control plane knows (``/status``), or those given with ``--server``. Where the
mesh runs mutual TLS (``.infermesh/pki`` holds the local operator's certificate, as ``infermesh
up`` makes it), the calls go over it as that operator, each server's own name checked (on
Kubernetes its pod's, as the control plane's /status or ``--pod`` gives it); an operator
certificate alone satisfies the servers' ``--restricted-api``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from infermesh import pki, tls_client
from infermesh.secrets import OPERATOR_KEY_FILE, SecretError, parse_header_secret
from infermesh.wire import OPERATOR_HEADER

DEFAULT_CREDENTIAL = f"{OPERATOR_HEADER}=@{OPERATOR_KEY_FILE}"


def add_parser(commands: Any, admin_help: str, default_admin: str) -> None:
    models = commands.add_parser(
        "models", help="model control on every model server: index, load, unload"
    )
    models.add_argument("action", choices=("index", "load", "unload"))
    models.add_argument("model", nargs="?", help="the model to load or unload")
    models.add_argument("--config", help="load: Triton's JSON config override")
    models.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a model server's gRPC address (repeatable); default: every endpoint the control "
        "plane knows",
    )
    models.add_argument("--admin", default=default_admin, help=admin_help)
    models.add_argument(
        "--credential",
        default=DEFAULT_CREDENTIAL,
        metavar="HEADER=@FILE",
        help="the servers' --restricted-api header and the file holding its credential",
    )
    models.add_argument(
        "--pki",
        type=Path,
        default=Path(".infermesh") / "pki",
        metavar="DIR",
        help="mutual TLS as the operator (operator_NAME.crt/.key, ca.crt there) when that "
        "certificate is there, as `infermesh up` makes it; else plaintext",
    )
    models.add_argument(
        "--operator",
        default=tls_client.LOCAL_OPERATOR,
        metavar="NAME",
        help="the operator certificate's name in --pki (Kubernetes: platform, the "
        "infermesh-operator-platform Certificate)",
    )
    models.add_argument(
        "--pod",
        default="",
        metavar="NAMESPACE/POD",
        help="with one --server (a kubectl port-forward): the Kubernetes pod it is, whose "
        "name its certificate carries; servers from the control plane come with theirs",
    )


def servers_of(
    admins: list[str], fetch: Callable[[str, str], dict[str, Any] | None]
) -> list[tuple[str, str]]:
    """The gRPC endpoints the first answering control-plane replica knows, each with the
    Kubernetes pod it is ("" where discovery names none)."""
    for admin in admins:
        status = fetch(admin, "/status")
        if status is not None:
            pods = (status.get("upstream_tls") or {}).get("pods") or {}
            return [(e, str(pods.get(e, ""))) for e in sorted(status.get("endpoints", {}))]
    return []


def run(
    args: argparse.Namespace,
    admins: list[str],
    fetch: Callable[[str, str], dict[str, Any] | None],
) -> int:
    """``admins``: the control-plane replicas to ask for the servers (without --server)."""
    if args.action != "index" and not args.model:
        print(f"infermesh: models {args.action} needs a model name", file=sys.stderr)
        return 2
    if args.pod and len(args.server) != 1:
        print("infermesh: --pod names the pod of one --server", file=sys.stderr)
        return 2
    try:
        if args.pod:
            pki.split_pod(args.pod)
        tls = _operator_tls(args.pki, args.operator)
    except pki.CertificateError as exc:
        print(f"infermesh: {exc}", file=sys.stderr)
        return 2
    headers: dict[str, str] = {}
    try:
        header, value = parse_header_secret(args.credential, "--credential")
        headers[header] = value
    except SecretError as exc:
        # The operator certificate alone satisfies the servers (the key stays in the
        # cluster's Secret): the default key file may be absent then.
        if tls is None or args.credential != DEFAULT_CREDENTIAL:
            print(f"infermesh: {exc}", file=sys.stderr)
            return 2
    servers = [(s, args.pod) for s in args.server] or servers_of(admins, fetch)
    if not servers:
        print("infermesh: no model servers: give --server or start the mesh", file=sys.stderr)
        return 1
    failed = 0
    for server, pod in servers:
        try:
            print(_on_server(_client(server, tls, pod), server, args, headers))
        except InferenceServerException as exc:  # the server's own message, never the key
            failed += 1
            print(f"{server}: {exc.status()}: {exc.message()}", file=sys.stderr)
    return 1 if failed else 0


OperatorTls = tuple[pki.IssuedFiles, pki.Credentials]


def _operator_tls(pki_dir: Path, name: str) -> OperatorTls | None:
    """The operator's files and checked credentials, or None (plaintext) when the directory
    has no certificate for that operator."""
    who = pki.operator(name)  # the file's name; the domain is the CA's
    if not pki.workload_files(pki_dir, who).cert.exists():
        return None
    return tls_client.operator(pki_dir, name)


def _client(server: str, tls: OperatorTls | None, pod: str) -> grpcclient.InferenceServerClient:
    if tls is None:
        return grpcclient.InferenceServerClient(server)
    files, credentials = tls
    name = tls_client.server_name(server, credentials.spiffe_id, pod)
    return grpcclient.InferenceServerClient(
        server, ssl=True, root_certificates=str(pki.ca_paths(files.cert.parent)[0]),
        private_key=str(files.key), certificate_chain=str(files.cert),
        channel_args=[("grpc.ssl_target_name_override", name)],
    )  # fmt: skip


def _on_server(
    client: grpcclient.InferenceServerClient,
    server: str,
    args: argparse.Namespace,
    headers: dict[str, str],
) -> str:
    try:
        if args.action == "index":
            rows = client.get_model_repository_index(headers=headers).models
            return (
                "\n".join(
                    f"{server}  {r.name} v{r.version or '-'}  {r.state} {r.reason}".rstrip()
                    for r in rows
                )
                or f"{server}  (no models)"
            )
        if args.action == "load":
            client.load_model(args.model, headers=headers, config=args.config)
            return f"{server}  {args.model} loaded"
        client.unload_model(args.model, headers=headers)
        return f"{server}  {args.model} unloaded"
    finally:
        client.close()
