"""``infermesh`` talks to every control-plane replica: operator changes go to each (Envoy may
follow either), status shows each, and a replica that is down is named, not fatal."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from infermesh.cli import default_admins, main
from model_server.cli import build_parser as model_server_parser
from tests.envoy_support import free_port


class Replica(ThreadingHTTPServer):
    """A stand-in admin API that records what it is sent (the real one is tested elsewhere)."""

    def __init__(self, answer: int = 200) -> None:
        self.posts: list[tuple[str, Any]] = []
        self.answer = answer
        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: Replica

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.server.posts.append((self.path, body))
        error = {"error": "version: not READY anywhere"}
        self._reply(self.server.answer, {"ok": True} if self.server.answer == 200 else error)

    def do_GET(self) -> None:
        self._reply(200, STATUS)

    def _reply(self, code: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


STATUS = {"snapshot": "v1", "last_rebuild": "x", "topology": {"error": None}, "endpoints": {},
          "clusters": {}, "nodes": []}  # fmt: skip


@pytest.fixture
def replicas() -> Iterator[list[Replica]]:
    servers = [Replica(), Replica()]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for thread in threads:
        thread.start()
    yield servers
    for server in servers:
        server.shutdown()
        server.server_close()


def test_changes_go_to_every_replica(replicas: list[Replica], capsys: Any) -> None:
    admins = ",".join(r.address for r in replicas)
    assert main(["split", "classifier", "1=90", "2=10", "--admin", admins]) == 0
    for replica in replicas:
        assert replica.posts == [("/models/classifier/split", {"1": 90, "2": 10})]
    assert main(["canary", "classifier", "2", "--dwell-s", "5", "--admin", admins]) == 0
    assert all(r.posts[-1] == ("/models/classifier/canary", {"version": "2", "dwell_s": 5.0})
               for r in replicas)  # fmt: skip
    out = capsys.readouterr().out
    assert all(f"{r.address}: " in out for r in replicas)


def test_a_replica_that_is_down_is_named_and_the_others_still_change(
    replicas: list[Replica], capsys: Any
) -> None:
    down = f"127.0.0.1:{free_port()}"
    admins = f"{down},{replicas[0].address}"
    assert main(["split", "classifier", "1=100", "--admin", admins]) == 0
    assert replicas[0].posts == [("/models/classifier/split", {"1": 100})]
    err = capsys.readouterr().err
    assert f"{down} does not answer, not applied there" in err and "applied on 1 of 2" in err
    assert main(["split", "classifier", "1=100", "--admin", down]) == 1


def test_a_refusal_by_one_replica_still_reaches_the_others(
    replicas: list[Replica], capsys: Any
) -> None:
    """Replicas keep their canaries in memory: one that restarted refuses an abort (409, no
    canary) that another, the one Envoy may follow, still needs. Before, the first refusal
    stopped the command there."""
    replicas[0].answer = 409
    admins = ",".join(r.address for r in replicas)
    assert main(["canary", "classifier", "3", "--admin", admins]) == 1  # refused by one
    assert replicas[1].posts == [("/models/classifier/canary", {"version": "3"})]
    assert "not READY anywhere" in capsys.readouterr().err
    assert main(["canary", "classifier", "--abort", "--admin", admins]) == 0
    assert replicas[1].posts[-1] == ("/models/classifier/canary", {"abort": True})
    assert f"{replicas[0].address}: nothing to do" in capsys.readouterr().out


def test_status_shows_each_replica(replicas: list[Replica], capsys: Any) -> None:
    down = f"127.0.0.1:{free_port()}"
    admins = ",".join([replicas[0].address, down, replicas[1].address])
    assert main(["status", "--admin", admins]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("== control plane") == 2 and down in captured.err
    assert main(["status", "--json", "--admin", admins]) == 0
    assert set(json.loads(capsys.readouterr().out)) == {r.address for r in replicas}
    assert main(["status", "--admin", down]) == 1


def test_default_admins() -> None:
    assert default_admins({}) == "127.0.0.1:19000,127.0.0.1:19001"
    env = {"INFERMESH_ADMIN_PORT": "1", "INFERMESH_ADMIN2_PORT": "2"}
    assert default_admins(env) == "127.0.0.1:1,127.0.0.1:2"
    assert default_admins({**env, "INFERMESH_ADMIN": "h:3"}) == "h:3"


@pytest.mark.parametrize(
    ("value", "endpoints"),
    [("a:1", ("a:1",)), ("a:1,b:2", ("a:1", "b:2")), ("a:1, b:2,", ("a:1", "b:2"))],
)
def test_model_server_reports_to_every_replica(value: str, endpoints: tuple[str, ...]) -> None:
    args = model_server_parser().parse_args(["--otlp-endpoint", value])
    assert args.otlp_endpoint == endpoints


@pytest.mark.parametrize("value", ["a", "a:1,b", "a:1,:2", "a:99999"])
def test_bad_otlp_endpoints_are_refused(value: str, capsys: Any) -> None:
    with pytest.raises(SystemExit):
        model_server_parser().parse_args(["--otlp-endpoint", value])
    assert "is not HOST:PORT" in capsys.readouterr().err
