"""Readiness probes shared by compose health checks and the native launcher.

    python -m infermesh.probe grpc 127.0.0.1:8001        # KServe ServerReady is true
    python -m infermesh.probe grpc 127.0.0.1:8001 .infermesh/pki   # the same over mutual TLS,
                                                          # as the local operator
    python -m infermesh.probe grpc 10.0.0.5:8001 CERT KEY CA   # over mutual TLS as the holder
                                      # of CERT (a server probing itself with its own)
    python -m infermesh.probe http http://127.0.0.1:9901/ready   # HTTP 200
    python -m infermesh.probe certs .infermesh/pki       # the certificate keeper has made them

Exit 0 when ready, 1 otherwise (with the reason on stderr).
"""

from __future__ import annotations

import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path

PROBE_TIMEOUT_S = 2.0


def grpc_ready(address: str, pki_dir: str | None = None, own: Sequence[str] = ()) -> str | None:
    """None when the KServe server at ``address`` is ready, else why not. With ``pki_dir``:
    over mutual TLS as the local operator; with ``own`` (cert, key, CA files): as the holder
    of that certificate; either way checking the server's own name."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from infermesh import pki, tls_client

    try:
        if own:
            cert, key, ca = (Path(f) for f in own)
            opened = tls_client.server_channel(address, pki.load_credentials(cert, key, ca))
        elif pki_dir:
            opened = tls_client.server_channel(address, tls_client.operator(Path(pki_dir))[1])
        else:
            opened = grpc.insecure_channel(address)
    except pki.CertificateError as exc:
        return str(exc)
    try:
        with opened as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            ready = stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=PROBE_TIMEOUT_S)
    except grpc.RpcError as exc:
        return f"{address}: {exc.code().name}"
    return None if ready.ready else f"{address}: not ready"


def http_ok(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as response:
            return None if response.status == 200 else f"{url}: HTTP {response.status}"
    except OSError as exc:
        return f"{url}: {exc}"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    kind = args[0] if args else ""
    allowed = {"grpc": (2, 3, 5), "http": (2,), "certs": (2,)}
    if len(args) not in allowed.get(kind, ()):
        print(
            "usage: python -m infermesh.probe grpc HOST:PORT [PKI_DIR | CERT KEY CA] | "
            "http URL | certs DIR",
            file=sys.stderr,
        )
        return 2
    if kind == "grpc":
        problem = grpc_ready(
            args[1], args[2] if len(args) == 3 else None, args[2:5] if len(args) == 5 else ()
        )
    elif kind == "certs":
        from infermesh import cert_keeper

        problem = cert_keeper.ready(Path(args[1]))
    else:
        problem = http_ok(args[1])
    if problem:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
