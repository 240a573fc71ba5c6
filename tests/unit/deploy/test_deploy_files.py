"""The deployment files describe commands the programs really accept, with matching ports."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from control_plane.app.cli import build_parser as control_plane_parser
from control_plane.config.topology import load_topology
from infermesh import cert_keeper, pki
from infermesh.api_keys import ensure_local_credentials
from infermesh.compose import interpolate, load_services
from model_server.cli import build_parser as model_server_parser
from tests.support import ROOT


def services() -> dict[str, tuple[str, ...]]:
    return {s.name: s.command for s in load_services(ROOT / "compose.yaml", env={})}


def test_compose_commands_parse_with_the_real_command_lines(tmp_path: Path) -> None:
    commands = services()
    # As the mesh reads it: beside the .infermesh/ that `infermesh up` makes.
    (tmp_path / "deploy").mkdir()
    shutil.copy(ROOT / "deploy" / "topology.yaml", tmp_path / "deploy")
    ensure_local_credentials(tmp_path)
    # The certificates mesh-certs keeps: every server's, Envoy's, the control plane's.
    # sh -c "infermesh keys init && exec infermesh certs keep KIND:NAME ...": the credentials
    # first, in containers too (the mesh-state volume starts empty)
    shell = commands["mesh-certs"]
    assert shell[:2] == ("sh", "-c")
    first, _, keep_line = shell[2].partition(" && exec ")
    assert first.split() == ["infermesh", "keys", "init"]
    keep = tuple(keep_line.split())
    assert keep[:3] == ("infermesh", "certs", "keep")
    kept = [w for w in keep[3:] if ":" in w]
    cert_keeper.keep_once(tmp_path / ".infermesh" / "pki", kept, "infermesh.local", 24)
    topology = load_topology(tmp_path / "deploy" / "topology.yaml")
    assert topology.xds_tls and topology.telemetry.tls and topology.listener.upstream_tls
    # Edge TLS too, with the certificate mesh-certs keeps for localhost (clients dial
    # 127.0.0.1): the topology load above checked its files.
    edge = topology.listener.tls
    assert edge is not None and "edge:localhost" in kept
    assert Path(edge.cert_file).name == f"{pki.edge('localhost').file_stem}.crt"
    assert topology.listener.auth.mode == "api_keys" and len(topology.listener.auth.api_keys) == 1
    endpoints = {e.address.key for e in topology.endpoints}  # type: ignore[union-attr]
    servers = [c for name, c in commands.items() if name.startswith("model-server")]
    assert len(servers) >= 2
    advertised = set()
    otlp_ports: set[tuple[int, ...]] = set()
    for command in servers:
        assert command[0] == "infermesh-model-server"
        args = model_server_parser().parse_args(list(command[1:]))
        assert args.model_repository == Path("models")
        advertised.add(args.advertise_address)
        assert f"{args.host}:{args.port}" == args.advertise_address
        otlp_ports.add(tuple(int(e.rpartition(":")[2]) for e in args.otlp_endpoint))
        # mTLS with the server's own certificate, which mesh-certs keeps
        assert f"model-server:{args.advertise_address}" in kept
        who = pki.model_server(args.advertise_address)
        assert args.tls_cert == Path(".infermesh/pki") / f"{who.file_stem}.crt"
    assert advertised == endpoints  # the control plane polls exactly the servers compose runs
    planes = [
        control_plane_parser().parse_args(list(c[1:]))
        for name, c in commands.items()
        if name.startswith("control-plane")
    ]
    assert [(p.xds_port, p.admin_port, p.listener_port, p.otlp_port) for p in planes] == [
        (18000, 19000, 8080, 14317),
        (18001, 19001, 8080, 14318),
    ]
    assert all((ROOT / plane.topology).is_file() for plane in planes)
    # Every server reports to every replica, and Envoy follows (and reports to) either one.
    assert otlp_ports == {(14317, 14318)}
    envoy = commands["envoy"]
    assert envoy[envoy.index("--xds-port") + 1] == "18000,18001"
    assert envoy[envoy.index("--otlp-port") + 1] == "14317,14318"
    assert envoy[envoy.index("--xds-tls") + 1] == ".infermesh/pki" and "envoy:envoy-1" in kept


def test_dependency_order_and_stop_grace() -> None:
    loaded = load_services(ROOT / "compose.yaml", env={"INFERMESH_ENVOY_PORT": "18080"})
    order = [s.name for s in loaded]
    for name in ("control-plane-1", "control-plane-2"):
        assert order.index("envoy") > order.index(name) > order.index("model-server-3")
    for service in loaded:
        if service.name.startswith("model-server"):
            args = model_server_parser().parse_args(list(service.command[1:]))
            assert service.stop_grace_s > args.drain_delay + args.drain_timeout
    for plane in (s for s in loaded if s.name.startswith("control-plane")):
        assert plane.command[plane.command.index("--listener-port") + 1] == "18080"


def test_compose_files_follow_the_compose_specification(tmp_path: Path) -> None:
    """compose.yaml, compose.gpu.yaml and compose.private.yaml against the Compose
    specification's JSON schema (v2's; the copy check-jsonschema vendors); a broken file is
    refused, so the check can fail. Compose 1.29 itself checks them in the container tier
    (tests/containers/test_compose_files.py)."""
    files = [ROOT / "compose.yaml", ROOT / "compose.gpu.yaml", ROOT / "compose.private.yaml"]
    assert check_compose(*files).returncode == 0, check_compose(*files).stdout
    broken = tmp_path / "compose.yaml"
    broken.write_text(
        (ROOT / "compose.yaml").read_text().replace("stop_grace_period:", "stop_grace:", 1)
    )
    refused = check_compose(broken)
    assert refused.returncode == 1 and "stop_grace" in refused.stdout, refused.stdout


def check_compose(*paths: Path) -> subprocess.CompletedProcess[str]:
    command = [str(Path(sys.executable).parent / "check-jsonschema"),
               "--builtin-schema", "vendor.compose-spec", *map(str, paths)]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def test_gpu_override_reserves_a_gpu_for_every_model_server() -> None:
    base = interpolate(yaml.safe_load((ROOT / "compose.yaml").read_text())["services"], {})
    gpu = interpolate(yaml.safe_load((ROOT / "compose.gpu.yaml").read_text())["services"], {})
    servers = {name for name in base if name.startswith("model-server")}
    assert set(gpu) == servers
    for name, service in gpu.items():
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
        assert service["build"]["args"] == {"VARIANT": "gpu"}
        args = model_server_parser().parse_args(service["command"][1:])
        assert args.device == "cuda"
        # Only the device differs from the CPU service's command line.
        cpu = model_server_parser().parse_args(base[name]["command"][1:])
        assert vars(args) == {**vars(cpu), "device": "cuda"}


def test_dockerfile_is_multi_stage_non_root_with_a_gpu_variant() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "tools/install.sh" in dockerfile
    assert len(re.findall(r"^FROM ", dockerfile, re.M)) == 2  # build, then a slim runtime
    assert "COPY --from=build /opt/infermesh /opt/infermesh" in dockerfile
    assert re.search(r"^USER 10001$", dockerfile, re.M)  # numeric: runAsNonRoot can verify
    assert "ARG VARIANT=cpu" in dockerfile and 'gpu) extra="[cuda,cudnn]"' in dockerfile
