"""``infermesh keys add|list|revoke|init``: the listener's API keys, in the control plane's key
file.

``add TENANT`` makes a key, appends its hash and prints the key once (it is stored nowhere
else: hand it to the tenant). ``list`` prints the key ids (never a hash). ``revoke KEYID``
removes one. ``init`` makes what a local mesh reads and lacks (the operator key, the admin
token, the local client's API key and its hash, each 0600) and names what it made: compose's
mesh-certs service runs it, so a mesh in containers starts from nothing. The control plane
re-reads the file when it changes, so Envoy's keys follow within
its topology watch interval; no restart.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from infermesh.api_keys import API_KEYS_FILE, add_key, ensure_local_credentials, new_key, revoke_key
from infermesh.secrets import SecretError


def add_parser(commands: Any, root: Path) -> None:
    keys = commands.add_parser(
        "keys", help="API keys of the public listener: add, list, revoke; init a local mesh's"
    )
    keys.add_argument("action", choices=("add", "list", "revoke", "init"))
    keys.add_argument("name", nargs="?", help="add: the tenant; revoke: the key id")
    keys.add_argument(
        "--file", type=Path, default=root / API_KEYS_FILE,
        help="the control plane's key file (listener.auth.api_keys_file)",
    )  # fmt: skip
    keys.set_defaults(keys_root=root)


def key_ids(path: Path) -> list[str]:
    lines = [line.strip() for line in path.read_text().splitlines()] if path.exists() else []
    return [line.split(":", 1)[0] for line in lines if line and not line.startswith("#")]


def run(args: argparse.Namespace) -> int:
    path: Path = args.file
    if args.action == "init":
        try:
            made = ensure_local_credentials(args.keys_root)
        except (OSError, SecretError) as exc:
            print(f"infermesh keys init: {exc}", file=sys.stderr)
            return 1
        for made_path in made:
            print(f"infermesh: made {made_path}")
        return 0
    if args.action == "list":
        for key_id in key_ids(path):
            print(key_id)
        return 0
    if not args.name:
        what = "tenant" if args.action == "add" else "key id"
        print(f"infermesh keys {args.action}: needs a {what}", file=sys.stderr)
        return 2
    if args.action == "revoke":
        if not revoke_key(path, args.name):
            print(f"infermesh keys revoke: no key {args.name!r} in {path}", file=sys.stderr)
            return 1
        print(f"infermesh: revoked {args.name} (the control plane reloads {path})")
        return 0
    try:
        key = new_key(args.name)
    except SecretError as exc:
        print(f"infermesh keys add: {exc}", file=sys.stderr)
        return 2
    try:
        key_id = add_key(path, key)
    except SecretError as exc:  # a key id already there (32 random bits: rare): try again
        print(f"infermesh keys add: {exc}", file=sys.stderr)
        return 1
    print(f"infermesh: added {key_id} to {path}; tenant {args.name!r} gets its entry under "
          "`tenants:` in the topology, else the `other` policy (refused if there is none). "
          "The key, shown once (send it as HTTP Basic, curl -u KEY):", file=sys.stderr)  # fmt: skip
    print(key)
    return 0
