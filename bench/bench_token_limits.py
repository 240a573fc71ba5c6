"""What a tenant's token limit costs at the edge: the same mesh with API keys and no token limit,
then with a token limit on the model that never binds (so every request reserves with the
control plane's token limiter), switched by rewriting the topology, alternating within each
round; medians of the rounds, ratios to "no token limit".

gRPC ModelInfer of the classifier with ``x-model-name``, h2load with one worker, two model
servers, the control plane (its own process), Envoy with one worker. The classifier reports no
token usage, so this measures the reservation on the request's path (the admission Lua buffering
the body, Envoy's ratelimit filter calling the control plane); a text generation adds the
settlement after its answer. Each run checks that nothing was refused.

    flock /tmp/infermesh-bench.lock .venv/bin/python bench/bench_token_limits.py \
        [--duration 8 --rounds 3 --concurrency 1,16]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import bench_auth as ba
import bench_edge as be
import bench_mesh as bm
import bench_model_server as bms
import yaml

from model_server.demo_models import MODEL_NAME

HOST = bms.HOST
PLAIN, LIMITED = "API key, no token limit", "API key + token limit"
# Never binds: a classifier request reserves its body's bytes (about 12 KB) plus 32.
LIMIT = {"tokens_per_s": 100_000_000, "burst": 100_000_000}


def write_topology(path: Path, listener: int, endpoints: list[str], auth: dict[str, Any],
                   limited: bool) -> None:  # fmt: skip
    ba.write_topology(path, listener, endpoints, auth)
    data = yaml.safe_load(path.read_text())
    if limited:
        data["tenants"]["bench"]["model_token_limits"] = {MODEL_NAME: LIMIT}
    path.write_text(yaml.safe_dump(data))


def listener_has(envoy: bm.Admin, setup: str) -> bool:
    """Envoy's listener has the ratelimit filter exactly when ``setup`` has a token limit."""
    dump = envoy.call("/config_dump?resource=dynamic_listeners")
    return ("envoy.extensions.filters.http.ratelimit.v3.RateLimit" in dump) == (setup == LIMITED)


def refused(envoy: bm.Admin) -> int:
    stats = envoy.call("/stats?filter=ratelimit.token_limit.(over_limit|error)")
    return sum(int(line.rpartition(":")[2]) for line in stats.splitlines() if ":" in line)


def main() -> int:
    p = argparse.ArgumentParser(description="API keys without and with a token limit")
    be.add_run_arguments(p, rounds=3)
    args = p.parse_args()
    levels, load_avg, exe = be.prepare(args)
    setups = (PLAIN, LIMITED)
    with tempfile.TemporaryDirectory(prefix="bench-tokens-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        auth, authorization = ba.credentials(workdir)[ba.KEYS]

        def write(path: Path, listener: int, endpoints: list[str], setup: str) -> None:
            write_topology(path, listener, endpoints, auth, setup == LIMITED)

        samples = ba.alternate_setups(
            args, levels, exe, stack, workdir, setups, write, listener_has,
            lambda _: authorization, refused, "the token limiter refused or failed requests",
        )  # fmt: skip
    print(
        f"\n## token limits through Envoy: commit {bm.commit()}, nproc {os.cpu_count()}, "
        f"load average at start {load_avg:.2f}"
    )
    print(
        f"h2load -m 1 -t 1, gRPC with x-model-name, {args.duration:g} s per run after a "
        f"{args.warmup:g} s warm-up; {args.rounds} rounds, setups alternating; medians; Envoy "
        "--concurrency 1, 2 servers, the control plane in its own process"
    )
    return ba.print_against(levels, samples, setups, PLAIN, "plain")


if __name__ == "__main__":
    raise SystemExit(main())
