"""Readiness probes shared by compose health checks and the native launcher.

    python -m infermesh.probe grpc 127.0.0.1:8001        # KServe ServerReady is true
    python -m infermesh.probe http http://127.0.0.1:9901/ready   # HTTP 200

Exit 0 when ready, 1 otherwise (with the reason on stderr).
"""

from __future__ import annotations

import sys
import urllib.request

PROBE_TIMEOUT_S = 2.0


def grpc_ready(address: str) -> str | None:
    """None when the KServe server at ``address`` is ready, else why not."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
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
    if len(args) != 2 or args[0] not in ("grpc", "http"):
        print("usage: python -m infermesh.probe grpc HOST:PORT | http URL", file=sys.stderr)
        return 2
    problem = grpc_ready(args[1]) if args[0] == "grpc" else http_ok(args[1])
    if problem:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
