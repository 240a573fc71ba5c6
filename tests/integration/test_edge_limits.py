"""The listener's limits act, through the real Envoy: a slowloris connection is closed, a header
flood and oversized metadata are refused before any server sees them, one HTTP/2 connection
cannot open more streams than allowed, a body sent a byte at a time is cut off, and good
traffic goes on meanwhile. (How much the good traffic suffers under each attack at full size
is bench/bench_hostile.py's to measure, not a test's.)"""

from __future__ import annotations

import functools
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.edge_mesh_support import EdgeMesh, edge_mesh, image_input, rest
from tests.support import wait_for

pytestmark = pytest.mark.integration
HEADERS_KB, HEADERS_COUNT, STREAMS, CONNECTIONS_PER_S = 16, 40, 20, 50
HEADERS_TIMEOUT_S, DURATION_S = 1.0, 3.0
LIMITS = {
    "max_request_headers_kb": HEADERS_KB,
    "max_headers_count": HEADERS_COUNT,
    "request_headers_timeout_s": HEADERS_TIMEOUT_S,
    "max_stream_duration_s": DURATION_S,
    "max_concurrent_streams": STREAMS,
    "max_new_connections_per_s": CONNECTIONS_PER_S,
}
INFER = "/inference.GRPCInferenceService/ModelInfer"


@pytest.fixture(scope="module")
def mesh(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EdgeMesh]:
    workdir = tmp_path_factory.mktemp("edge-limits")
    with edge_mesh(demo_repo, workdir, {"limits": LIMITS}) as the_mesh:
        yield the_mesh


def good(mesh: EdgeMesh) -> None:
    client = grpcclient.InferenceServerClient(mesh.url)
    result = client.infer("classifier", [image_input()], headers={"x-model-name": "classifier"})
    assert result.as_numpy("probs").shape == (1, 10)


def test_a_slowloris_connection_is_closed_at_the_headers_timeout(mesh: EdgeMesh) -> None:
    before = mesh.listener_stat("downstream_rq_header_timeout")
    sockets = []
    for _ in range(20):
        sock = socket.create_connection(("127.0.0.1", mesh.port), timeout=10)
        sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nX-Slow: a")  # never ends
        sockets.append(sock)
    started = time.monotonic()
    try:
        good(mesh)  # others are served meanwhile
        for sock in sockets:
            answer = sock.recv(4096)  # Envoy answers 408 and closes, or just closes
            assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer[:80]
        assert time.monotonic() - started < HEADERS_TIMEOUT_S + 5
    finally:
        for sock in sockets:
            sock.close()
    wait_for(
        lambda: mesh.listener_stat("downstream_rq_header_timeout") >= before + 20,
        10,
        "Envoy to count the header timeouts",
    )
    good(mesh)


def test_a_header_flood_and_oversized_metadata_are_refused_before_any_server(
    mesh: EdgeMesh,
) -> None:
    many = {f"x-flood-{i}": "v" for i in range(HEADERS_COUNT + 10)}
    status, _, _ = rest(mesh, "GET", "/v2/health/ready", headers=many)
    assert status == 431
    big = {"x-big": "v" * (HEADERS_KB * 1024 + 1)}
    status, _, _ = rest(mesh, "GET", "/v2/health/ready", headers=big)
    assert status == 431
    client = grpcclient.InferenceServerClient(mesh.url)
    served = _served(mesh)
    for headers in (many, big):
        with pytest.raises(InferenceServerException) as caught:
            client.infer("classifier", [image_input()], headers={"x-model-name": "classifier",
                                                                   **headers})  # fmt: skip
        assert caught.value.status() in ("StatusCode.INTERNAL", "StatusCode.UNAVAILABLE")
    assert _served(mesh) == served  # refused at the edge
    good(mesh)


def _served(mesh: EdgeMesh) -> int:
    total = 0
    for server in mesh.servers:
        stats = server.client().get_inference_statistics("classifier").model_stats
        total += sum(s.inference_stats.success.count + s.inference_stats.fail.count
                     for s in stats)  # fmt: skip
    return total


def test_one_connection_cannot_open_more_streams_than_allowed(mesh: EdgeMesh) -> None:
    """A client that ignores SETTINGS_MAX_CONCURRENT_STREAMS and opens 10,000 streams on one
    connection gets the ones over the limit refused (RST_STREAM REFUSED_STREAM) or the
    connection closed (GOAWAY); good traffic on other connections is served."""
    sock = socket.create_connection(("127.0.0.1", mesh.port), timeout=10)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    headers = [
        (":method", "POST"), (":scheme", "http"), (":path", INFER),
        (":authority", mesh.url), ("content-type", "application/grpc"), ("te", "trailers"),
        ("x-model-name", "classifier"),
    ]  # fmt: skip
    # The server's SETTINGS are not read yet, so h2 does not enforce its limit: a hostile
    # client's view. Streams stay open (no body, no end of stream).
    sent = 0
    try:
        for index in range(10_000):
            conn.send_headers(1 + 2 * index, headers)
            sent += 1
            if index % 200 == 199:
                sock.sendall(conn.data_to_send())
        sock.sendall(conn.data_to_send())
    except (h2.exceptions.ProtocolError, OSError):
        pass  # the connection was closed under the flood: also a refusal
    refused, closed = 0, False
    sock.settimeout(5)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not closed and refused < sent - STREAMS:
        try:
            data = sock.recv(65536)
        except (TimeoutError, OSError):
            break
        if not data:
            closed = True
            break
        try:
            events = conn.receive_data(data)
        except h2.exceptions.ProtocolError:
            closed = True
            break
        for event in events:
            if isinstance(event, h2.events.StreamReset):
                refused += 1
            elif isinstance(event, h2.events.ConnectionTerminated):
                closed = True
    sock.close()
    assert closed or refused >= sent - STREAMS, (sent, refused)
    good(mesh)


def test_a_body_sent_a_byte_at_a_time_is_cut_off(mesh: EdgeMesh) -> None:
    before = mesh.listener_stat("downstream_rq_max_duration_reached")
    sock = socket.create_connection(("127.0.0.1", mesh.port), timeout=15)
    try:
        sock.sendall(
            b"POST /v2/models/classifier/infer HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
        )
        started = time.monotonic()
        answer = b""
        sock.settimeout(0.2)
        while time.monotonic() - started < DURATION_S + 8:
            try:
                sock.sendall(b" ")
                chunk = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                break
            if not chunk:
                break
            answer += chunk
            break
        elapsed = time.monotonic() - started
        assert elapsed < DURATION_S + 8, "the slow body was never cut off"
        assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer[:80]
    finally:
        sock.close()
    wait_for(
        lambda: mesh.listener_stat("downstream_rq_max_duration_reached") > before,
        10,
        "Envoy to count the stream cut at its maximum duration",
    )
    good(mesh)


def test_streams_are_exempt_from_the_request_duration(mesh: EdgeMesh) -> None:
    """ModelStreamInfer may outlive max_stream_duration_s (a long generation): requests one
    after another for longer than it, each answered, none reset."""
    results: list[object] = []
    client = grpcclient.InferenceServerClient(mesh.url)
    client.start_stream(
        lambda result, error: results.append(error or result),
        headers={"x-model-name": "classifier"},
    )
    try:
        started = time.monotonic()
        sent = 0
        while time.monotonic() - started < DURATION_S + 2:
            client.async_stream_infer("classifier", [image_input()])
            sent += 1
            wait_for(functools.partial(_answered, results, sent), 10, "the stream's answer")
    finally:
        client.stop_stream()
    errors = [r for r in results if isinstance(r, Exception)]
    assert time.monotonic() - started > DURATION_S
    assert not errors and sent >= 6, errors


def _answered(results: list[object], count: int) -> bool:
    return len(results) >= count


def test_connections_over_the_rate_are_closed_at_once(mesh: EdgeMesh) -> None:
    """A burst of new connections beyond max_new_connections_per_s: the ones over it are
    closed before any byte of HTTP is read; once the bucket refills, new clients are served."""
    started = time.monotonic()
    sockets = [socket.create_connection(("127.0.0.1", mesh.port), timeout=5) for _ in range(200)]
    # The bucket holds a second's worth and refills each second while the burst is made.
    admitted_at_most = CONNECTIONS_PER_S * (2 + int(time.monotonic() - started))
    closed = 0
    try:
        for sock in sockets:
            sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
        for sock in sockets:
            try:
                answer = sock.recv(4096)
            except OSError:
                answer = b""
            closed += answer == b""
    finally:
        for sock in sockets:
            sock.close()
    assert 200 - admitted_at_most <= closed < 200, (closed, admitted_at_most)
    wait_for(lambda: _serves(mesh), 10, "new connections served again")


def _serves(mesh: EdgeMesh) -> bool:
    try:
        good(mesh)
    except InferenceServerException:
        return False
    return True
