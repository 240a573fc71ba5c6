"""``python -m control_plane --topology FILE``: the xDS control plane process."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from control_plane.admin.tokens import AdminExposureError
from control_plane.app.server import ControlPlaneSettings, serve
from control_plane.config.topology import TopologyError
from control_plane.gc_tuning import tune_gc
from infermesh.logs import add_log_level, configure_logging
from infermesh.secrets import SecretError, parse_header_secret, read_secret

MIN_TOKEN_LENGTH = 16


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
        help="a file holding the admin write token: every admin POST then needs "
        "'Authorization: Bearer TOKEN', and the live view (/ui) offers its actions; default: "
        "read-only view",
    )
    p.add_argument(
        "--admin-read-token-file",
        type=Path,
        default=None,
        help="a file holding the admin read token: GETs of /status, /telemetry, /decisions, "
        "/canaries, /ui and /events then need it (or the write token); default: open reads",
    )
    p.add_argument(
        "--model-server-credential",
        default=None,
        metavar="HEADER=@FILE",
        help="the header and credential file the placement poller sends with RepositoryIndex, "
        "for model servers started with --restricted-api model-repository:HEADER=@FILE",
    )
    add_log_level(p)
    return p


def read_token(path: Path | None, flag: str = "--admin-token-file") -> str | None:
    """An admin token from its file (surrounding whitespace dropped); None without a file."""
    return None if path is None else read_secret(path, flag, MIN_TOKEN_LENGTH)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        token = read_token(args.admin_token_file)
        read = read_token(args.admin_read_token_file, "--admin-read-token-file")
        credential = (
            parse_header_secret(args.model_server_credential, "--model-server-credential")
            if args.model_server_credential
            else None
        )
    except SecretError as exc:
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
        admin_read_token=read,
        model_server_credential=credential,
    )
    tune_gc()
    try:
        return asyncio.run(serve(settings))
    except (TopologyError, AdminExposureError) as exc:
        print(f"infermesh-control-plane: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a port taken, a shard that cannot start
        print(f"infermesh-control-plane: cannot start: {exc}", file=sys.stderr)
        return 1
