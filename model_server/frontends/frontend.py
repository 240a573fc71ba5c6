"""One front-end process: ``python -m model_server.frontends`` (started by the engine, never by
hand). It listens on the server's public gRPC port with SO_REUSEPORT beside its siblings,
decodes and encodes the calls, checks the restricted API groups, and hands everything else
to the engine over the private directory's sockets.

It holds no model and imports neither ONNX Runtime nor the repository. It exits when the
engine goes: the kernel sends it STOP_SIGNAL (SIGUSR2) when its parent dies
(``infermesh.pdeathsig``), and a lost private channel ends it too (the engine, if alive, starts
a new one). The engine stops it with STOP_SIGNAL at the end of a drain; SIGTERM, which a
process-group kill sends to every process at once, is the engine's to act on.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc

from infermesh import event_loop
from infermesh.logs import add_log_level, configure_logging
from infermesh.pdeathsig import set_parent_death_signal
from model_server.core import collector
from model_server.frontends import wire
from model_server.frontends.link import EngineLink
from model_server.frontends.pool import FrontendPool
from model_server.frontends.proxy import FrontendService
from model_server.frontends.supervisor import STOP_SIGNAL
from model_server.security.access import (
    RestrictedApiInterceptor,
    RestrictionError,
    parse_restriction,
    restriction_table,
)

log = logging.getLogger("model_server.frontend")
GRPC_HEADROOM_BYTES = 16 * 1024 * 1024  # as the server's: tensors are checked in code
STOP_GRACE_S = 1.0


@dataclass(frozen=True)
class FrontendOptions:
    index: int
    directory: Path
    host: str
    port: int
    parent: int
    pool_bytes: int
    max_request_bytes: int
    max_concurrent_rpcs: int
    restrictions: tuple[str, ...]  # --restricted-api values, their files read here
    gc_threshold: int = 0  # the engine's --gc-threshold (core.collector); 0: CPython's


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m model_server.frontends")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--directory", type=Path, required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--pool-bytes", type=int, required=True)
    p.add_argument("--max-request-bytes", type=int, required=True)
    p.add_argument("--max-concurrent-rpcs", type=int, default=0)
    p.add_argument("--restricted-api", action="append", default=[])
    p.add_argument("--gc-threshold", type=int, default=0)
    event_loop.add_event_loop_argument(p)
    add_log_level(p)
    return p


async def serve(options: FrontendOptions) -> int:
    table = restriction_table([parse_restriction(text) for text in options.restrictions])
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    exit_code = 0

    def engine_lost() -> None:
        nonlocal exit_code
        if not stop.is_set():
            log.warning("front end %d: the private channel to the engine closed", options.index)
            exit_code = 1
            stop.set()

    def terminated() -> None:
        # A SIGTERM sent to the whole process group (systemd's control-group kill, `kill --
        # -PGID`) reaches the engine too, which drains and then stops its front ends with
        # STOP_SIGNAL; quitting now would cut the drain's requests. Only an orphan obeys it.
        if os.getppid() != options.parent:
            stop.set()
        else:
            log.info("front end %d: SIGTERM left to the engine, which drains", options.index)

    loop.add_signal_handler(STOP_SIGNAL, stop.set)
    loop.add_signal_handler(signal.SIGTERM, terminated)
    pool = FrontendPool(
        options.directory, f"pool-{options.index}-{os.getpid()}", options.pool_bytes
    )
    hello = wire.Hello(options.index, os.getpid(), pool.size, pool.path.name)
    link = await EngineLink.connect(options.directory / "infer.sock", pool, engine_lost, hello)
    limit = options.max_request_bytes + GRPC_HEADROOM_BYTES
    sizes = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
    engine = grpc.aio.insecure_channel(f"unix:{options.directory / 'grpc.sock'}", options=sizes)
    server = grpc.aio.server(
        interceptors=[RestrictedApiInterceptor(table)] if table else None,
        options=[*sizes, ("grpc.so_reuseport", 1)],
        maximum_concurrent_rpcs=options.max_concurrent_rpcs or None,
    )
    server.add_generic_rpc_handlers((FrontendService(link, engine, options.max_request_bytes),))
    if server.add_insecure_port(f"{options.host}:{options.port}") != options.port:
        log.error("front end %d: cannot bind %s:%d", options.index, options.host, options.port)
        return 2
    await server.start()
    if collector.tune(options.gc_threshold):
        collector.settle()
    link.send(wire.frame(wire.Kind.READY, os.getpid()))
    log.info("front end %d (pid %d) listening on %s:%d, event loop %s", options.index,
             os.getpid(), options.host, options.port, event_loop.running_loop_name())  # fmt: skip
    await stop.wait()
    await server.stop(STOP_GRACE_S)
    link.close()
    await engine.close()
    pool.close()
    log.info("front end %d (pid %d) stopped", options.index, os.getpid())
    return exit_code


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    set_parent_death_signal(STOP_SIGNAL)
    if os.getppid() != args.parent:  # the engine died before the prctl: never outlive it
        return 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the engine drains
    configure_logging(args.log_level)
    options = FrontendOptions(
        index=args.index,
        directory=args.directory,
        host=args.host,
        port=args.port,
        parent=args.parent,
        pool_bytes=args.pool_bytes,
        max_request_bytes=args.max_request_bytes,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        restrictions=tuple(args.restricted_api),
        gc_threshold=args.gc_threshold,
    )
    try:
        return event_loop.run(serve(options), args.event_loop)
    except (RestrictionError, OSError, event_loop.EventLoopUnavailable) as exc:
        log.error("front end %d cannot start: %s", args.index, exc)
        return 2
