"""``python -m control_plane --topology FILE``: the xDS control plane process."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

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
    add_log_level(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    settings = ControlPlaneSettings(
        args.topology,
        args.xds_port,
        args.admin_port,
        args.listener_port,
        args.otlp_port,
        routing=not args.no_routing,
    )
    try:
        return asyncio.run(serve(settings))
    except TopologyError as exc:
        print(f"infermesh-control-plane: {exc}", file=sys.stderr)
        return 2
