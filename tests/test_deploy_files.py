"""The deployment files describe commands the programs really accept, with matching ports."""

from __future__ import annotations

from pathlib import Path

from control_plane.cli import build_parser as control_plane_parser
from control_plane.topology import load_topology
from infermesh.compose import load_services
from model_server.cli import build_parser as model_server_parser
from tests.support import ROOT


def services() -> dict[str, tuple[str, ...]]:
    return {s.name: s.command for s in load_services(ROOT / "compose.yaml", env={})}


def test_compose_commands_parse_with_the_real_command_lines() -> None:
    commands = services()
    topology = load_topology(ROOT / "deploy" / "topology.yaml")
    endpoints = {e.address.key for e in topology.endpoints}  # type: ignore[union-attr]
    servers = [c for name, c in commands.items() if name.startswith("model-server")]
    assert len(servers) >= 2
    advertised = set()
    for command in servers:
        assert command[0] == "infermesh-model-server"
        args = model_server_parser().parse_args(list(command[1:]))
        assert args.model_repository == Path("models")
        advertised.add(args.advertise_address)
        assert f"{args.host}:{args.port}" == args.advertise_address
    assert advertised == endpoints  # the control plane polls exactly the servers compose runs
    plane = control_plane_parser().parse_args(list(commands["control-plane"][1:]))
    assert (plane.xds_port, plane.admin_port, plane.listener_port) == (18000, 19000, 8080)
    assert (ROOT / plane.topology).is_file()
    envoy = commands["envoy"]
    assert envoy[envoy.index("--xds-port") + 1] == "18000"


def test_dependency_order_and_stop_grace() -> None:
    loaded = load_services(ROOT / "compose.yaml", env={"INFERMESH_ENVOY_PORT": "18080"})
    order = [s.name for s in loaded]
    assert order.index("envoy") > order.index("control-plane") > order.index("model-server-2")
    for service in loaded:
        if service.name.startswith("model-server"):
            args = model_server_parser().parse_args(list(service.command[1:]))
            assert service.stop_grace_s > args.drain_delay + args.drain_timeout
    plane = next(s for s in loaded if s.name == "control-plane")
    assert plane.command[plane.command.index("--listener-port") + 1] == "18080"


def test_dockerfile_runs_as_non_root_and_uses_the_install_script() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "tools/install.sh" in dockerfile
    assert "\nUSER infermesh" in dockerfile
