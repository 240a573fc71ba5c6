"""The deployment files describe commands the server really accepts."""

from __future__ import annotations

from pathlib import Path

import yaml

from model_server.cli import build_parser
from tests.support import ROOT


def test_compose_model_server_commands_parse_with_the_real_cli() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    servers = {k: v for k, v in compose["services"].items() if k.startswith("model-server")}
    assert len(servers) >= 2
    advertised = set()
    for service in servers.values():
        args = build_parser().parse_args(service["command"])
        assert args.host == "0.0.0.0" and args.model_repository == Path("/models")
        # The drain must finish before the engine's SIGKILL.
        grace = int(service["stop_grace_period"].rstrip("s"))
        assert grace > args.drain_timeout + args.drain_delay
        advertised.add(args.advertise_address)
    assert len(advertised) == len(servers)


def test_dockerfile_runs_as_non_root_and_uses_the_install_script() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "tools/install.sh" in dockerfile
    assert "\nUSER infermesh" in dockerfile
