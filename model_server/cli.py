"""Command line: ``python -m model_server`` / ``infermesh-model-server``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path

from infermesh import event_loop, pki
from infermesh.labels import LABEL_TEXT_RULE, is_label_text
from infermesh.logs import add_log_level, configure_logging
from model_server.core import allocator, collector
from model_server.core.memory import DeviceUnavailable, parse_bytes
from model_server.frontends.engine import FrontendEngine, FrontendSettings
from model_server.frontends.pool import DEFAULT_POOL_BYTES
from model_server.observability.telemetry import MIN_INTERVAL_S
from model_server.protocol.service import MODEL_CONTROL_MODES
from model_server.security.access import (
    GROUPS,
    RestrictionError,
    RestrictionSpec,
    parse_restriction_spec,
    restriction_table,
)
from model_server.security.peers import TlsFiles
from model_server.server import ModelServer, ServerSettings

log = logging.getLogger("model_server")


def _models(text: str) -> tuple[str, ...] | None:
    if text == "*":
        return None
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _endpoint(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return text


def _endpoints(text: str) -> tuple[str, ...]:
    """HOST:PORT[,HOST:PORT...]: every control-plane replica gets the same telemetry."""
    return tuple(_endpoint(part.strip()) for part in text.split(",") if part.strip())


def _seconds(text: str, at_least: float, strictly: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (value > at_least if strictly else value >= at_least):  # also refuses NaN
        rule = "more than" if strictly else "at least"
        raise argparse.ArgumentTypeError(f"{text!r}: must be {rule} {at_least} seconds")
    return value


def _interval(text: str) -> float:
    return _seconds(text, MIN_INTERVAL_S)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infermesh-model-server",
        description="KServe v2 / Triton inference server (gRPC and HTTP/REST) on ONNX Runtime.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    p.add_argument("--port", type=int, default=8001, help="gRPC port (0 picks a free one)")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="Prometheus /metrics port; default gRPC port + 1000; -1 disables",
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="KServe v2 HTTP/REST port (Triton's HTTP protocol); default gRPC port + 2000 "
        "(a free one when --port is 0); -1 disables",
    )
    p.add_argument("--model-repository", type=Path, default=Path("models"))
    p.add_argument(
        "--models",
        type=_models,
        default=None,
        help="comma-separated models to load at start and require for readiness; "
        "'*' (default) loads every model in the repository, '' loads none",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--memory-budget",
        type=parse_bytes,
        default=None,
        help="CPU host memory budget (e.g. 4GiB); default: cgroup limit, else 80%% of RAM",
    )
    p.add_argument(
        "--malloc-keep-mib",
        type=_non_negative_int,
        default=allocator.DEFAULT_KEEP_MIB,
        help="freed heap memory (MiB) glibc keeps for the next model run instead of faulting "
        "in fresh pages (model_server.core.allocator); 0: glibc's defaults (default: %(default)s)",
    )
    p.add_argument(
        "--gc-threshold",
        type=_non_negative_int,
        default=collector.DEFAULT_GEN0_THRESHOLD,
        help="allocations between young garbage collections; with it, what is alive once the "
        "models load is frozen out of later collections (model_server.core.collector); 0: "
        "CPython's defaults (default: %(default)s)",
    )
    p.add_argument(
        "--drain-delay",
        type=float,
        default=2.0,
        help="seconds to keep accepting after NOT_SERVING, so load balancers see it first",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds from SIGTERM to exit, in-flight work included",
    )
    p.add_argument(
        "--advertise-address",
        default=None,
        help="host:port peers reach this server at (default host:port)",
    )
    p.add_argument("--max-request-bytes", type=parse_bytes, default=parse_bytes("64MiB"))
    p.add_argument(
        "--max-concurrent-rpcs",
        type=_non_negative_int,
        default=0,
        help="RPCs in the server at once; more get RESOURCE_EXHAUSTED at once (0: no limit)",
    )
    p.add_argument(
        "--model-control-mode",
        choices=MODEL_CONTROL_MODES,
        default="none",
        help="Triton's modes: 'none' loads the models at start and refuses load/unload calls; "
        "'explicit' accepts them; 'poll' reloads what changes in the repository",
    )
    p.add_argument(
        "--repository-poll-interval",
        type=_poll_interval,
        default=None,
        help="seconds between repository scans in --model-control-mode poll (default 15)",
    )
    p.add_argument(
        "--restricted-api",
        dest="restrictions",
        type=_restriction,
        action="append",
        default=[],
        metavar="GROUP[,GROUP...]:HEADER=@FILE",
        help="calls to these API groups (gRPC and REST) need HEADER with the credential read "
        f"from FILE; repeatable. Groups: {', '.join(GROUPS)}",
    )
    p.add_argument(
        "--otlp-endpoint",
        type=_endpoints,
        default=(),
        help="HOST:PORT of an OTLP/gRPC metrics receiver, or several separated by commas (one "
        "per control-plane replica); default: no export",
    )
    p.add_argument(
        "--trace-endpoint",
        type=lambda text: _endpoint(text) if text else None,
        default=None,
        help="HOST:PORT of an OTLP/gRPC trace receiver; default: no spans",
    )
    p.add_argument(
        "--telemetry-interval",
        type=_interval,
        default=1.0,
        help=f"seconds between OTLP exports (at least {MIN_INTERVAL_S})",
    )
    p.add_argument(
        "--enable-fault-injection",
        action="store_true",
        help="serve POST /faults on the metrics port (latency, errors, memory ballast)",
    )
    p.add_argument(
        "--label",
        dest="labels",
        type=_label,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a routing label the server reports (repeatable), e.g. zone=b or "
        "reserved_for=interactive; device_class defaults to the NVML device (or cpu)",
    )
    tls = p.add_argument_group(
        "mutual TLS", "all three or none: the server then speaks only TLS on gRPC and REST, "
        "requires a client certificate from the mesh CA and checks the caller's identity "
        "(`infermesh certs`; docs/security.md)",
    )  # fmt: skip
    tls.add_argument("--tls-cert", type=Path, help="this server's certificate (PEM)")
    tls.add_argument("--tls-key", type=Path, help="its private key (PEM)")
    tls.add_argument("--tls-ca", type=Path, help="the mesh CA certificate (PEM)")
    tls.add_argument(
        "--tls-pod",
        type=_pod_name,
        metavar="NAMESPACE/POD",
        help="Kubernetes: the certificate names this pod (cert-manager's csi-driver: "
        "spiffe://TD/model-server/pod/NAMESPACE/POD), not --advertise-address",
    )
    p.add_argument(
        "--frontends",
        type=_positive_int,
        default=1,
        help="gRPC front-end processes sharing --port (SO_REUSEPORT) in front of one engine "
        "process that holds the models; 1: one process, as before (docs/model-server.md)",
    )
    p.add_argument(
        "--frontend-pool",
        type=parse_bytes,
        default=DEFAULT_POOL_BYTES,
        help="shared memory each front end's tensors cross to the engine in (with --frontends)",
    )
    event_loop.add_event_loop_argument(p)
    add_log_level(p)
    return p


def _pod_name(text: str) -> str:
    try:
        pki.server_workload("", text)  # the identity --tls-pod makes the server expect
    except pki.CertificateError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAMESPACE/POD ({exc})") from None
    return text


def tls_files(args: argparse.Namespace) -> TlsFiles | None:
    given = [args.tls_cert, args.tls_key, args.tls_ca]
    if not any(given):
        return None
    if not all(given):
        raise argparse.ArgumentTypeError("--tls-cert, --tls-key and --tls-ca go together")
    return TlsFiles(args.tls_cert, args.tls_key, args.tls_ca)


def _label(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not is_label_text(name) or not is_label_text(value):
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE ({LABEL_TEXT_RULE}), got {text!r}")
    return name, value


async def serve(settings: ServerSettings, frontends: FrontendSettings | None = None) -> int:
    """Runs a server until SIGTERM/SIGINT, then drains; returns the exit code. With
    ``frontends``, this process is the engine and its front ends serve the public port."""
    try:
        engine = None if frontends is None else FrontendEngine(settings, frontends)
    except OSError as exc:  # the port is taken, or no private directory can be made
        log.error("cannot start: %s (%s:%d)", exc, settings.host, settings.port)
        return 2
    try:
        return await _serve(engine.server if engine else ModelServer(settings), engine)
    finally:
        if engine is not None:
            engine.close()


async def _serve(server: ModelServer, engine: FrontendEngine | None) -> int:
    await (engine.start() if engine else server.start())
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    signals_seen = 0

    def on_signal(signum: int) -> None:
        nonlocal signals_seen
        name = signal.Signals(signum).name
        signals_seen += 1
        if signals_seen == 1:
            log.info("received %s: draining", name)
            stop_requested.set()
        elif signum == signal.SIGINT:  # a second Ctrl-C: the operator wants out now
            log.warning("received %s again: exiting now", name)
            os._exit(1)
        else:  # supervisors often repeat SIGTERM; the drain already under way goes on
            log.info("received %s again: drain already in progress", name)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    await stop_requested.wait()
    code = await server.drain()
    log.info("model server exited with code %d", code)
    return code


def _poll_interval(text: str) -> float:
    return _seconds(text, 0, strictly=True)


def _restriction(text: str) -> RestrictionSpec:
    try:
        return parse_restriction_spec(text)
    except RestrictionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def _non_negative_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repository_poll_interval is not None and args.model_control_mode != "poll":
        parser.error("--repository-poll-interval needs --model-control-mode poll")
    try:
        restrictions = tuple(spec.load() for spec in args.restrictions)
        restriction_table(restrictions)  # a group named twice is an error before start
    except RestrictionError as exc:
        parser.error(str(exc))
    try:
        tls = tls_files(args)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.frontends > 1 and tls is not None:
        parser.error("--frontends above 1 does not serve TLS yet: run one process with --tls-*")
    try:
        event_loop.loop_factory(args.event_loop)
    except event_loop.EventLoopUnavailable as exc:
        parser.error(str(exc))
    configure_logging(args.log_level)
    allocator.keep_freed_memory(args.malloc_keep_mib)
    collector.tune(args.gc_threshold)
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        http_port=args.http_port,
        model_repository=args.model_repository,
        models=args.models,
        device=args.device,
        memory_budget=args.memory_budget,
        drain_delay=args.drain_delay,
        drain_timeout=args.drain_timeout,
        advertise_address=args.advertise_address,
        max_request_bytes=args.max_request_bytes,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        model_control_mode=args.model_control_mode,
        repository_poll_interval=args.repository_poll_interval or 15.0,
        restrictions=restrictions,
        otlp_endpoints=args.otlp_endpoint,
        trace_endpoint=args.trace_endpoint,
        telemetry_interval=args.telemetry_interval,
        enable_fault_injection=args.enable_fault_injection,
        labels=tuple(args.labels),
        tls=tls,
        tls_pod=args.tls_pod or "",
        gc_threshold=args.gc_threshold,
    )
    frontends = None
    if args.frontends > 1:
        frontends = FrontendSettings(
            args.frontends,
            args.frontend_pool,
            tuple(f"{','.join(sorted(r.groups))}:{r.header}=@{r.path}" for r in args.restrictions),
            args.log_level,
            args.event_loop,
        )
    try:
        return event_loop.run(serve(settings, frontends), args.event_loop)
    except pki.CertificateError as exc:  # names the file and the problem; never key material
        log.error("cannot start: %s", exc)
        return 2
    except DeviceUnavailable as exc:  # a GPU asked for and not there: never served from CPU
        log.error("cannot start: %s", exc)
        return 2
    except KeyboardInterrupt:
        return 1
