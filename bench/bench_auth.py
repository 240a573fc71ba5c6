"""What client identity costs at the edge: the same mesh with ``listener.auth`` off, API keys
and JWTs, switched by rewriting the topology (the control plane reloads it and pushes the new
listener), alternating within each round; medians of the rounds, ratios to "off".

gRPC ModelInfer with ``x-model-name`` (no Lua), h2load with one worker, two model servers, the
control plane, Envoy with one worker. Every setup sends the same credential headers, so the
bytes on the wire are the same; with auth on, one tenant (rate limit none) is configured, and
each run checks that Envoy refused nothing (its basic_auth / jwt_authn "denied" counters).

    flock /tmp/infermesh-bench.lock .venv/bin/python bench/bench_auth.py \
        [--duration 8 --rounds 3 --concurrency 1,16]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import bench_edge as be
import bench_mesh as bm
import bench_model_server as bms
import jwt
import yaml
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

from infermesh.api_keys import add_key, basic_authorization, new_key
from model_server.demo_models import MODEL_NAME

HOST = bms.HOST
OFF, KEYS, JWT = "auth off", "API key (basic_auth)", "JWT (jwt_authn, RS256)"
ISSUER, AUDIENCE = "https://issuer.bench", "infermesh"
DENIED = ("http.infermesh.basic_auth.denied", "http.infermesh.jwt_authn.denied")


def credentials(workdir: Path) -> dict[str, tuple[dict[str, Any], str]]:
    """Each setup's listener.auth and the Authorization header a client sends with it."""
    key = new_key("bench")
    add_key(workdir / "api-keys", key)
    signing = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = json.loads(RSAAlgorithm.to_jwk(signing.public_key()))
    (workdir / "jwks.json").write_text(json.dumps({"keys": [{**public, "kid": "k"}]}))
    claims = {"iss": ISSUER, "aud": AUDIENCE, "sub": "bench", "exp": time.time() + 86400}
    token = jwt.encode(claims, signing, algorithm="RS256", headers={"kid": "k"})
    jwt_auth = {"issuer": ISSUER, "audiences": [AUDIENCE], "jwks_file": str(workdir / "jwks.json")}
    return {
        OFF: ({"mode": "off"}, basic_authorization(key)),
        KEYS: ({"mode": "api_keys", "api_keys_file": str(workdir / "api-keys")},
               basic_authorization(key)),
        JWT: ({"mode": "jwt", "jwt": jwt_auth}, f"Bearer {token}"),
    }  # fmt: skip


def write_topology(path: Path, listener: int, endpoints: list[str], auth: dict[str, Any]) -> None:
    data = {
        "listener": {"auth": auth, "host": HOST, "port": listener, "health_check_interval_s": 0.5},
        "placement": {"poll_interval_s": 0.2, "timeout_s": 1.0},
        "models": [{"name": MODEL_NAME, "sla_p99_ms": 100, "capacity_qps": 1000}],
        "endpoints": [{"address": e} for e in endpoints],
        "tenants": {"bench": {"may_set_priority": True}, "other": {}},
    }
    path.write_text(yaml.safe_dump(data))


def listener_has(envoy: bm.Admin, setup: str) -> bool:
    """Envoy's listener config is the one for ``setup`` (its auth filter, or none)."""
    dump = envoy.call("/config_dump?resource=dynamic_listeners")
    types = ("basic_auth.v3.BasicAuth", "jwt_authn.v3.JwtAuthentication")  # the filters' configs
    found = tuple(f"envoy.extensions.filters.http.{name}" in dump for name in types)
    return found == {OFF: (False, False), KEYS: (True, False), JWT: (False, True)}[setup]


def denied(envoy: bm.Admin) -> int:
    stats = envoy.call("/stats?filter=(basic_auth|jwt_authn).denied")
    return sum(int(line.rpartition(":")[2]) for line in stats.splitlines() if ":" in line)


def measure_setup(
    args: argparse.Namespace, exe: Any, mesh: bm.Mesh, workdir: Path, c: int, setup: str,
    applied: Any, authorization: str, refusals: Any, refused: str,
) -> Any:  # fmt: skip
    """One level of one setup, once Envoy has its listener (``applied``) and a healthy
    endpoint; stops the benchmark if Envoy's ``refusals`` counter moved meanwhile (``refused``
    says what that means). Shared with bench_token_limits."""
    envoy = bm.Admin(mesh.envoy_admin)
    bm.wait_for(applied, 30, f"Envoy's listener for {setup}")
    bm.wait_for(lambda: "::health_flags::healthy" in envoy.call("/clusters"), 30,
                "a healthy endpoint")  # fmt: skip
    before = refusals(envoy)
    header = (f"authorization: {authorization}",)
    run = be.run_once(args, exe, mesh, be.GRPC, c, workdir, {}, header, setup)
    if refusals(envoy) != before:
        raise SystemExit(f"{setup}: {refused}")
    return run


def alternate_setups(
    args: argparse.Namespace, levels: list[int], exe: Any, stack: ExitStack, workdir: Path,
    setups: Sequence[str], write: Callable[[Path, int, list[str], str], None],
    applied: Callable[[bm.Admin, str], bool], authorization: Callable[[str], str],
    refusals: Callable[[bm.Admin], int], refused: str,
) -> list[Any]:  # fmt: skip
    """Two model servers, the control plane and Envoy; then each round, level and setup in
    turn: ``write`` the setup's topology (the control plane reloads it), wait until Envoy has
    it (``applied``) and measure it with the setup's ``authorization`` header (``measure_setup``).
    The samples. Shared with bench_token_limits."""
    _, req = bms.make_request(1)
    payload = req.SerializeToString()
    (workdir / "frame.bin").write_bytes(b"\0" + len(payload).to_bytes(4, "big") + payload)
    servers = be.start_servers(stack, args.models, workdir)
    listener = bm.free_port()
    endpoints = [f"{HOST}:{port}" for _, port, _ in servers]
    topology = workdir / "topology.yaml"
    write(topology, listener, endpoints, setups[0])
    cp_admin, envoy_pid, envoy_admin = bm.start_plane_and_envoy(stack, workdir, topology)
    mesh = bm.Mesh(servers, envoy_pid, envoy_admin, cp_admin, listener)
    envoy = bm.Admin(envoy_admin)
    samples = []
    for rnd, c, setup in itertools.product(range(args.rounds), levels, setups):
        write(topology, listener, endpoints, setup)

        def in_force(s: str = setup) -> bool:
            return applied(envoy, s)

        run = measure_setup(
            args, exe, mesh, workdir, c, setup, in_force, authorization(setup), refusals, refused
        )
        samples.append(run)
        print(f"round {rnd + 1} c{c} {setup}: {bms.fmt_row(run.level)}", flush=True)
    return samples


def print_against(levels: list[int], samples: list[Any], setups: Sequence[str], base: str,
                  short: str) -> int:  # fmt: skip
    """The table of each level and setup against ``base`` (``short`` in the headers): medians,
    the ratios of QPS, P50 and Envoy's CPU, and each round's QPS ratio. 1 if any request
    failed, else 0."""
    print(f"\n| c | setup | QPS | p50 ms | p99 ms | non-OK | Envoy CPU ms/request | Envoy cores "
          f"| servers CPU ms/request | QPS / {short} | p50 / {short} | Envoy CPU / {short} "
          f"| QPS / {short} per round |\n" + "| --- " * 13 + "|")  # fmt: skip
    for c in levels:
        runs = {
            s: [x for x in samples if x.setup == s and x.level.concurrency == c] for s in setups
        }
        first = bms.median_level([x.level for x in runs[base]])
        for setup in setups:
            m = bms.median_level([x.level for x in runs[setup]])
            cpu = (m.cpu_ms_per_request or 0) / (first.cpu_ms_per_request or 1)
            rounds = zip(runs[setup], runs[base], strict=True)
            per_round = ", ".join(f"{x.level.qps / o.level.qps:.2f}" for x, o in rounds)
            print(
                f"| {c} | {setup} | {bms.fmt_row(m)} | "
                f"{bms.median([x.server_cpu_ms for x in runs[setup]]):.2f} | "
                f"{m.qps / first.qps:.2f} | {m.p50_ms / first.p50_ms:.2f} | {cpu:.2f} | "
                f"{per_round} |"
            )
    bad = sum(sum(x.level.non_ok.values()) + x.level.failed for x in samples)
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description="listener.auth off vs API keys vs JWTs")
    be.add_run_arguments(p, rounds=3)
    args = p.parse_args()
    levels, load_avg, exe = be.prepare(args)
    setups = (OFF, KEYS, JWT)
    with tempfile.TemporaryDirectory(prefix="bench-auth-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        auth = credentials(workdir)

        def write(path: Path, listener: int, endpoints: list[str], setup: str) -> None:
            write_topology(path, listener, endpoints, auth[setup][0])

        samples = alternate_setups(
            args, levels, exe, stack, workdir, setups, write, listener_has,
            lambda setup: auth[setup][1], denied, "Envoy refused requests of the benchmark",
        )  # fmt: skip
    print(
        f"\n## listener.auth through Envoy: commit {bm.commit()}, nproc {os.cpu_count()}, "
        f"load average at start {load_avg:.2f}"
    )
    print(
        f"h2load -m 1 -t 1, gRPC with x-model-name, {args.duration:g} s per run after a "
        f"{args.warmup:g} s warm-up; {args.rounds} rounds, setups alternating; medians; Envoy "
        "--concurrency 1, 2 servers"
    )
    return print_against(levels, samples, setups, OFF, "off")


if __name__ == "__main__":
    raise SystemExit(main())
