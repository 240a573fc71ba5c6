"""The ports ``infermesh up`` checks before it starts anything (issue 28): every port the
compose services listen on, read from their command lines, and who holds a busy one."""

from __future__ import annotations

import os
import socket

from infermesh.compose import Service, load_services
from infermesh.ports import (
    BusyPort,
    busy_ports,
    describe_busy,
    holder,
    in_use,
    needed_ports,
    parse_ports,
    service_ports,
)
from tests.support import ROOT


def test_port_values_in_every_form() -> None:
    assert parse_ports("8001") == [8001]
    assert parse_ports("18000,18001") == [18000, 18001]
    assert parse_ports("127.0.0.1:9090,[::1]:9091") == [9090, 9091]
    assert parse_ports("0") == parse_ports("-1") == parse_ports("") == []  # pick one, off


def test_a_model_servers_metrics_and_rest_ports_follow_its_grpc_port() -> None:
    server = Service("s", ("/venv/bin/infermesh-model-server", "--port", "8005"))
    assert [p for p, _ in service_ports(server)] == [8005, 9005, 10005]
    explicit = Service("s", ("infermesh-model-server", "--port=8005", "--metrics-port", "-1",
                             "--http-port", "7000"))  # fmt: skip
    assert sorted(p for p, _ in service_ports(explicit)) == [7000, 8005]
    other = Service("p", ("prometheus", "--web.listen-address=127.0.0.1:9090", "--port", "5"))
    assert sorted(p for p, _ in service_ports(other)) == [5, 9090]  # no offsets: not a server


def test_the_compose_meshs_ports() -> None:
    needed = needed_ports(load_services(ROOT / "compose.yaml", env={}))
    assert sorted(needed) == [
        8001, 8002, 8003, 8080, 9001, 9002, 9003, 9090, 9901, 10001, 10002, 10003,
        14317, 14318, 18000, 18001, 19000, 19001,
    ]  # fmt: skip
    assert needed[8080] == "control-plane-1 --listener-port"  # Envoy's listener, as configured
    assert needed[18001] == "control-plane-2 --xds-port"  # Envoy's bootstrap names it later
    assert needed[9002] == "model-server-2 --metrics-port (default: --port + 1000)"


def test_a_busy_port_is_named_with_its_holder() -> None:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]
        assert in_use(port)
        assert holder(port).startswith(f"PID {os.getpid()} (")
        busy = busy_ports({port: "envoy --admin-port"})
    assert busy == [BusyPort(port, "envoy --admin-port", busy[0].holder)]
    assert not in_use(port) and busy_ports({port: "envoy --admin-port"}) == []
    text = describe_busy(busy)
    assert f"port {port} (envoy --admin-port): held by PID {os.getpid()}" in text
    assert "nothing was started" in text
