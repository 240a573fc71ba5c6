"""The scenario harness's ports: a model server's implicit metrics (+1000) and REST (+2000)
ports never collide with the ports given to the other services."""

from __future__ import annotations

import socket

from tests.scenarios.harness import SERVER_PORT_OFFSETS, mesh_ports


def test_server_ports_leave_room_for_their_metrics_and_rest_ports() -> None:
    for _ in range(20):
        servers, others = mesh_ports(3, 9)
        implied = [p + k for p in servers for k in (0, *SERVER_PORT_OFFSETS)]
        assert len(set(implied + others)) == len(implied) + len(others) == 9 + 9
        for port in implied + others:  # all released, and free now
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port))
