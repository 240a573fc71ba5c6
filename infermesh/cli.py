"""``infermesh``: run the mesh natively (``up``) and see the control plane's view (``status``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.request
from pathlib import Path
from typing import Any

from infermesh.launcher import up

ROOT = Path.cwd()


def _status(admin: str, raw: bool) -> int:
    try:
        with urllib.request.urlopen(f"http://{admin}/status", timeout=5) as response:
            status: dict[str, Any] = json.loads(response.read())
    except OSError as exc:
        print(f"infermesh: control plane admin at {admin} does not answer: {exc}", file=sys.stderr)
        return 1
    if raw:
        print(json.dumps(status, indent=2, sort_keys=True))
        return 0
    print(f"snapshot: {status.get('snapshot')}  last rebuild: {status.get('last_rebuild')}")
    if status["topology"]["error"]:
        print(f"topology error (last good one kept): {status['topology']['error']}")
    print("endpoints:")
    for key, e in sorted(status["endpoints"].items()):
        state = "reachable" if e["reachable"] else f"UNREACHABLE ({e['error']})"
        overrides = {k: e[k] for k in ("weight_override", "health_override") if e[k] is not None}
        print(f"  {key:22} {state:12} ready={','.join(e['ready_models']) or '-'} {overrides or ''}")
    print("clusters:")
    for name, endpoints in sorted(status["clusters"].items()):
        members = ", ".join(f"{m['endpoint']} w={m['weight']} {m['health']}" for m in endpoints)
        print(f"  {name:28} {members or '(empty)'}")
    print("envoy nodes:")
    for node in status["nodes"]:
        connected = "connected" if node["connected"] else "disconnected"
        print(f"  {node['node_id']} ({node['mode']}, {connected})")
        for kind, t in node["types"].items():
            nack = f" last NACK: {t['last_nack']['error'][:80]!r}" if t["last_nack"] else ""
            print(f"    {kind}: acked {t['acked_version'] or '-'} sync={t['in_sync']}{nack}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="infermesh", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("up", help="start the mesh from compose.yaml as processes")
    start.add_argument("--compose", type=Path, default=ROOT / "compose.yaml")
    start.add_argument("--log-dir", type=Path, default=ROOT / ".infermesh" / "logs")
    show = commands.add_parser("status", help="the control plane's view of the mesh")
    default_admin = f"127.0.0.1:{os.environ.get('INFERMESH_ADMIN_PORT', '19000')}"
    show.add_argument("--admin", default=default_admin, help="control plane admin HOST:PORT")
    show.add_argument("--json", action="store_true", help="print the raw status JSON")
    args = parser.parse_args(argv)
    if args.command == "up":
        return up(args.compose, args.compose.resolve().parent, args.log_dir)
    return _status(args.admin, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
