"""``python -m control_plane --topology FILE``: the xDS control plane process."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from control_plane.gc_tuning import tune_gc
from control_plane.server import ControlPlaneSettings, serve
from control_plane.topology import TopologyError
from infermesh.logs import add_log_level, configure_logging


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infermesh-control-plane",
        description="xDS control plane for InferMesh (ADS, state-of-the-world and delta).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--topology", type=Path, required=True, help="topology YAML file")
    p.add_argument("--xds-port", type=int, default=None, help="override the topology's xds.port")
    p.add_argument("--admin-port", type=int, default=None, help="override admin.port")
    p.add_argument("--listener-port", type=int, default=None, help="override listener.port")
    p.add_argument("--otlp-port", type=int, default=None, help="override telemetry.port")
    p.add_argument(
        "--no-routing",
        action="store_true",
        help="no telemetry-driven weights or ejection: Envoy balances alone (for comparison)",
    )
    p.add_argument(
        "--admin-token-file",
        type=Path,
        default=None,
        help="a file holding the admin token: every admin POST then needs 'Authorization: "
        "Bearer TOKEN', and the live view (/ui) offers its actions; default: read-only view",
    )
    add_log_level(p)
    return p


def read_token(path: Path | None) -> str | None:
    """The admin token from its file (surrounding whitespace dropped); None without a file."""
    if path is None:
        return None
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ValueError(f"--admin-token-file {path}: cannot read it: {exc}") from exc
    if len(token) < 16 or any(c.isspace() for c in token):
        raise ValueError(f"--admin-token-file {path}: expected one token of at least 16 characters")
    return token


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        token = read_token(args.admin_token_file)
    except ValueError as exc:
        print(f"infermesh-control-plane: {exc}", file=sys.stderr)
        return 2
    settings = ControlPlaneSettings(
        args.topology,
        args.xds_port,
        args.admin_port,
        args.listener_port,
        args.otlp_port,
        routing=not args.no_routing,
        admin_token=token,
    )
    tune_gc()
    try:
        return asyncio.run(serve(settings))
    except TopologyError as exc:
        print(f"infermesh-control-plane: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a port taken, a shard that cannot start
        print(f"infermesh-control-plane: cannot start: {exc}", file=sys.stderr)
        return 1
