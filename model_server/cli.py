"""Command line: ``python -m model_server`` / ``infermesh-model-server``."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from infermesh.logs import add_log_level, configure_logging
from model_server.memory import parse_bytes
from model_server.server import ServerSettings, serve


def _models(text: str) -> tuple[str, ...] | None:
    if text == "*":
        return None
    return tuple(name.strip() for name in text.split(",") if name.strip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infermesh-model-server",
        description="KServe v2 / Triton gRPC inference server on ONNX Runtime.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    p.add_argument("--port", type=int, default=8001, help="gRPC port (0 picks a free one)")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="Prometheus /metrics port; default gRPC port + 1000; -1 disables",
    )
    p.add_argument("--model-repository", type=Path, default=Path("models"))
    p.add_argument(
        "--models",
        type=_models,
        default=None,
        help="comma-separated models to load at start and require for readiness; "
        "'*' (default) loads every model in the repository, '' loads none",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--memory-budget",
        type=parse_bytes,
        default=None,
        help="CPU host memory budget (e.g. 4GiB); default: cgroup limit, else 80%% of RAM",
    )
    p.add_argument(
        "--drain-delay",
        type=float,
        default=2.0,
        help="seconds to keep accepting after NOT_SERVING, so load balancers see it first",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds from SIGTERM to exit, in-flight work included",
    )
    p.add_argument(
        "--advertise-address",
        default=None,
        help="host:port peers reach this server at (default host:port)",
    )
    p.add_argument("--max-request-bytes", type=parse_bytes, default=parse_bytes("64MiB"))
    p.add_argument(
        "--repository-poll-interval",
        type=float,
        default=0.0,
        help="seconds between repository scans for changed models; 0 disables",
    )
    add_log_level(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        model_repository=args.model_repository,
        models=args.models,
        device=args.device,
        memory_budget=args.memory_budget,
        drain_delay=args.drain_delay,
        drain_timeout=args.drain_timeout,
        advertise_address=args.advertise_address,
        max_request_bytes=args.max_request_bytes,
        repository_poll_interval=args.repository_poll_interval,
    )
    try:
        return asyncio.run(serve(settings))
    except KeyboardInterrupt:
        return 1
