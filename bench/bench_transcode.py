"""Benchmark REST in the model server against REST transcoded by Envoy (issue 12).

One model server (demo classifier, gRPC + KServe v2 REST on --http-port) and one Envoy (static
config, one worker, no control plane) with three listeners:

- **transcode**: envoy.filters.http.grpc_json_transcoder with a FileDescriptorSet built from the
  descriptors shipped in tritonclient.grpc and ``auto_mapping``: POST
  /inference.GRPCInferenceService/ModelInfer with a proto-JSON ``ModelInferRequest`` body,
  transcoded to gRPC over an HTTP/2 upstream to the server's gRPC port;
- **plain**: /v2/... routed over HTTP/1.1 to the server's REST port (what InferMesh does) and
  /inference.GRPCInferenceService/... over HTTP/2 to its gRPC port (gRPC passthrough);
- **kserve-path** (not measured): the transcoder with a google.api.http rule
  ``post: /v2/models/{model_name}/infer, body: "*"`` added to ModelInfer, to show what a
  KServe v2 REST client (tritonclient.http) gets from a transcoder.

Load: h2load ``-m 1 -t 1`` (``--h1`` for REST and transcoded JSON, h2c for gRPC), a discarded
warm-up, then a timed run, setups alternating within each round and level; medians of rounds.

    flock /tmp/infermesh-bench.lock .venv/bin/python bench/bench_transcode.py \
        [--duration 6 --warmup 2 --rounds 2 --concurrency 1,16]
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bench_edge as be
import bench_mesh as bm
import bench_model_server as bms
import grpc
import numpy as np
from google.api import annotations_pb2
from google.protobuf import descriptor_pb2, json_format
from tritonclient.grpc import service_pb2, service_pb2_grpc

from model_server.demo_models import MODEL_NAME, build_demo_repository

HOST = bms.HOST
SERVICE = "inference.GRPCInferenceService"
T_NUM = "transcoder, proto-JSON fp32_contents"
T_RAW = "transcoder, proto-JSON raw_input_contents (base64)"
R_BIN = "REST in server, binary tensors"
R_JSON = "REST in server, JSON tensors"
R_JSON32 = "REST in server, JSON tensors, float32 text"
GRPC = "gRPC passthrough (h2)"
SETUPS = (T_NUM, T_RAW, R_BIN, R_JSON, R_JSON32, GRPC)
TOLERANCE = 1e-5


@dataclass
class Sample:
    setup: str
    level: bms.Level  # cpu_ms_per_request / server_cores: Envoy's
    server_cpu_ms: float  # the model server's CPU ms per OK (HTTP 200) request
    server_ok: float  # OK answers the server counted in the timed run


@dataclass
class Ports:
    transcode: int
    plain: int
    kserve_path: int


# ---------------------------------------------------------------- descriptor set and Envoy


def descriptor_set(kserve_rule: bool) -> bytes:
    """FileDescriptorSet of grpc_service.proto and its imports, from tritonclient's descriptors.
    With ``kserve_rule``, ModelInfer gets ``google.api.http {post: "/v2/models/{model_name}/
    infer" body: "*"}`` (and the google/api files it needs)."""
    fds = descriptor_pb2.FileDescriptorSet()
    seen: set[str] = set()

    def add(fd: Any) -> None:
        if fd.name in seen:
            return
        seen.add(fd.name)
        for dep in fd.dependencies:
            add(dep)
        fds.file.add().CopyFrom(copy_to_proto(fd))

    if kserve_rule:
        add(annotations_pb2.DESCRIPTOR)
    add(service_pb2.DESCRIPTOR)
    if kserve_rule:
        service_file = next(f for f in fds.file if f.name == service_pb2.DESCRIPTOR.name)
        service_file.dependency.append(annotations_pb2.DESCRIPTOR.name)
        method = next(m for m in service_file.service[0].method if m.name == "ModelInfer")
        rule = method.options.Extensions[annotations_pb2.http]
        rule.post, rule.body = "/v2/models/{model_name}/infer", "*"
    return fds.SerializeToString()


def copy_to_proto(fd: Any) -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    fd.CopyToProto(proto)
    return proto


def transcoder(descriptor: Path) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.grpc_json_transcoder",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.grpc_json_transcoder.v3."
            "GrpcJsonTranscoder",
            "proto_descriptor": str(descriptor),
            "services": [SERVICE],
            "auto_mapping": True,
            "print_options": {
                "add_whitespace": False,
                "always_print_primitive_fields": False,
                "preserve_proto_field_names": False,
            },
        },
    }


def listener(name: str, port: int, filters: list[dict[str, Any]],
             routes: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    router = {
        "name": "envoy.filters.http.router",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
        },
    }
    return {
        "name": name,
        "address": {"socket_address": {"address": HOST, "port_value": port}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network."
                "http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": name,
                "codec_type": "AUTO",
                "route_config": {"name": name, "virtual_hosts": [
                    {"name": name, "domains": ["*"], "routes": routes}]},
                "http_filters": [*filters, router],
            },
        }]}],
    }  # fmt: skip


def route(prefix: str, cluster: str) -> dict[str, Any]:
    return {"match": {"prefix": prefix}, "route": {"cluster": cluster, "timeout": "30s"}}


def cluster(name: str, port: int, http2: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": name, "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {
            "address": {"socket_address": {"address": HOST, "port_value": port}}}}]}]},
    }  # fmt: skip
    if http2:
        out["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                "HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return out


def envoy_config(workdir: Path, ports: Ports, grpc_port: int, rest_port: int) -> Path:
    plain_pb, kserve_pb = workdir / "grpc_service.pb", workdir / "grpc_service_kserve_rule.pb"
    plain_pb.write_bytes(descriptor_set(False))
    kserve_pb.write_bytes(descriptor_set(True))
    config = {
        "admin": {"address": {"socket_address": {"address": HOST, "port_value": 0}}},
        "static_resources": {
            "listeners": [
                listener(
                    "transcode",
                    ports.transcode,
                    [transcoder(plain_pb)],
                    [route(f"/{SERVICE}/", "grpc")],
                ),
                listener(
                    "plain", ports.plain, [], [route("/v2/", "rest"), route(f"/{SERVICE}/", "grpc")]
                ),
                listener(
                    "kserve_path", ports.kserve_path, [transcoder(kserve_pb)], [route("/", "grpc")]
                ),
            ],
            "clusters": [cluster("grpc", grpc_port, True), cluster("rest", rest_port, False)],
        },
    }
    path = workdir / "envoy.json"
    path.write_text(json.dumps(config, indent=1))
    return path


def validate(config: Path) -> str:
    out = subprocess.run([bm.envoy_exe(), "--mode", "validate", "-c", str(config),
                          "--use-dynamic-base-id"], capture_output=True, text=True)  # fmt: skip
    text = (out.stdout + out.stderr).strip()
    if out.returncode != 0:
        sys.exit(f"envoy --mode validate failed ({out.returncode}):\n{text[-3000:]}")
    return text.splitlines()[-1] if text else "OK"


# ---------------------------------------------------------------- bodies and checks


def proto_json(req: service_pb2.ModelInferRequest) -> bytes:
    return json.dumps(json_format.MessageToDict(req), separators=(",", ":")).encode()


def bodies(x: np.ndarray, req: service_pb2.ModelInferRequest
           ) -> dict[str, tuple[bytes, list[str]]]:  # fmt: skip
    """Per setup: the request body and its headers."""
    numbers = service_pb2.ModelInferRequest()
    numbers.CopyFrom(req)
    del numbers.raw_input_contents[:]
    numbers.inputs[0].contents.fp32_contents.extend(x.flatten().tolist())
    payload = req.SerializeToString()
    rest = be.bodies(x)
    # bench_edge's JSON tensors print each float32 as its float64 repr (17 digits); the proto
    # JSON printer writes the shortest float32 text. The same numbers as T_NUM, KServe-shaped:
    text = json.loads(proto_json(numbers))["inputs"][0]["contents"]["fp32Contents"]
    short = json.dumps({"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                    "data": text}]}, separators=(",", ":")).encode()  # fmt: skip
    return {
        T_NUM: (proto_json(numbers), ["content-type: application/json"]),
        T_RAW: (proto_json(req), ["content-type: application/json"]),
        R_BIN: rest[be.BINARY],
        R_JSON: rest[be.JSON_],
        R_JSON32: (short, ["content-type: application/json"]),
        GRPC: (b"\0" + len(payload).to_bytes(4, "big") + payload,
               ["content-type: application/grpc", "te: trailers"]),
    }  # fmt: skip


def path_of(setup: str) -> str:
    return be.REST_PATH if setup in (R_BIN, R_JSON, R_JSON32) else f"/{SERVICE}/ModelInfer"


def port_of(setup: str, ports: Ports) -> int:
    return ports.transcode if setup in (T_NUM, T_RAW) else ports.plain


def post(port: int, path: str, body: bytes, headers: list[str]) -> tuple[int, dict[str, str],
                                                                          bytes]:  # fmt: skip
    hdrs = dict(h.split(": ", 1) for h in headers)
    req = urllib.request.Request(f"http://{HOST}:{port}{path}", body, hdrs)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers.items()), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers.items()), exc.read()


def decode(setup: str, headers: dict[str, str], data: bytes) -> np.ndarray:
    if setup in (T_NUM, T_RAW):
        doc = json.loads(data)
        raw = doc.get("rawOutputContents") or doc.get("raw_output_contents")
        if raw:
            return np.frombuffer(base64.b64decode(raw[0]), np.float32)
        return np.array(doc["outputs"][0]["contents"]["fp32Contents"], np.float32)
    length = {k.lower(): v for k, v in headers.items()}.get("inference-header-content-length")
    if length is not None:
        return np.frombuffer(data[int(length) :], np.float32)
    return np.array(json.loads(data)["outputs"][0]["data"], np.float32)


def check(setup: str, ports: Ports, body: bytes, headers: list[str], want: np.ndarray,
          req: service_pb2.ModelInferRequest) -> str:  # fmt: skip
    """One request through Envoy; its probabilities must be within TOLERANCE of the direct
    gRPC answer."""
    if setup == GRPC:
        got = direct_probs(f"{HOST}:{ports.plain}", req)
        status = "grpc-status OK"
    else:
        code, hdrs, data = post(port_of(setup, ports), path_of(setup), body, headers)
        if code != 200:
            sys.exit(f"check {setup}: HTTP {code}: {data[:500]!r}")
        got, status = decode(setup, hdrs, data), f"HTTP {code}"
    err = float(np.max(np.abs(got - want.flatten())))
    if got.size != want.size or err > TOLERANCE:
        sys.exit(f"check {setup}: output differs from direct gRPC (max |diff| {err:.3g})")
    return f"{status}, max |diff| vs direct gRPC = {err:.2g}"


def direct_probs(target: str, req: service_pb2.ModelInferRequest) -> np.ndarray:
    with grpc.insecure_channel(target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            resp = stub.ModelInfer(req, timeout=30)
        except grpc.RpcError as exc:
            sys.exit(f"gRPC via {target}: {exc.code()} {exc.details()}")
    return np.frombuffer(resp.raw_output_contents[0], np.float32)


def kserve_client_tries(ports: Ports, x: np.ndarray) -> list[str]:
    """tritonclient.http (a KServe v2 REST client) against the transcoder listeners."""
    import tritonclient.http as httpclient

    out = []
    tries = [("auto_mapping listener", ports.transcode, False),
             ("kserve-path rule, JSON tensors", ports.kserve_path, False),
             ("kserve-path rule, binary tensors", ports.kserve_path, True)]  # fmt: skip
    for name, port, binary in tries:
        client = httpclient.InferenceServerClient(f"{HOST}:{port}")
        inp = httpclient.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=binary)
        try:
            res = client.infer(MODEL_NAME, [inp])
            out.append(f"{name}: succeeded?! probs {res.as_numpy('probs')}")
        except Exception as exc:  # quote whatever the client raises
            out.append(f"{name}: {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            client.close()
    kserve_json = be.bodies(x)[be.JSON_]  # no "parameters": the "data" list alone
    code, hdrs, data = post(ports.kserve_path, be.REST_PATH, *kserve_json)
    low = {k.lower(): v for k, v in hdrs.items()}
    out.append(
        f"kserve-path rule, bench_edge's KServe JSON body via urllib: HTTP {code}, "
        f"grpc-status {low.get('grpc-status')}, grpc-message {low.get('grpc-message')!r}, "
        f"body {data[:200]!r}"
    )
    return out


def error_mapping(ports: Ports, req: service_pb2.ModelInferRequest) -> str:
    """What the transcoder returns for a non-OK gRPC status (unknown model: NOT_FOUND)."""
    bad = service_pb2.ModelInferRequest()
    bad.CopyFrom(req)
    bad.model_name = "no-such-model"
    code, hdrs, data = post(ports.transcode, f"/{SERVICE}/ModelInfer", proto_json(bad),
                            ["content-type: application/json"])  # fmt: skip
    low = {k.lower(): v for k, v in hdrs.items()}
    return (f"HTTP {code}, grpc-status {low.get('grpc-status')}, grpc-message "
            f"{low.get('grpc-message')!r}, body {data[:200]!r}")  # fmt: skip


# ---------------------------------------------------------------- load


def h2load(exe: str, setup: str, ports: Ports, c: int, seconds: float, workdir: Path,
           log: Path) -> list[list[str]]:  # fmt: skip
    cmd = [exe, "-c", str(c), "-m", "1", "-t", "1", "-D", f"{round(seconds * 1000)}ms"]
    if setup != GRPC:
        cmd.append("--h1")
    cmd += ["-d", str(workdir / f"{SETUPS.index(setup)}.body")]
    for header in bodies_headers[setup]:
        cmd += ["-H", header]
    log.unlink(missing_ok=True)
    url = f"http://{HOST}:{port_of(setup, ports)}{path_of(setup)}"
    out = subprocess.run([*cmd, "--log-file", str(log), url], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"h2load failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return [line.split("\t") for line in log.read_text().splitlines() if line.strip()]


bodies_headers: dict[str, list[str]] = {}


def run_once(args: argparse.Namespace, exe: str, setup: str, c: int, ports: Ports,
             pids: tuple[int, int], metrics: str, workdir: Path) -> Sample:  # fmt: skip
    h2load(exe, setup, ports, c, args.warmup, workdir, workdir / "warmup.log")
    before, cpu0 = bm.codes([metrics])[0], [bms.cpu_seconds(p) or 0.0 for p in pids]
    rows = h2load(exe, setup, ports, c, args.duration, workdir, workdir / "run.log")
    cpu = [(bms.cpu_seconds(p) or 0.0) - c0 for p, c0 in zip(pids, cpu0, strict=True)]
    after = bm.codes([metrics])[0]
    lat_ms = np.array([float(r[2]) / 1e3 for r in rows if r[1] == "200"])
    ok = len(lat_ms)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    non_ok = {k: v for k, v in delta.items() if k != "OK" and v > 0}
    cancelled = non_ok.pop("CANCELLED", 0.0) if non_ok.get("CANCELLED", 0.0) <= c else 0.0
    level = bms.Level(
        concurrency=c, requests=ok, failed=len(rows) - ok, qps=ok / args.duration,
        p50_ms=float(np.percentile(lat_ms, 50)) if ok else math.nan,
        p99_ms=float(np.percentile(lat_ms, 99)) if ok else math.nan,
        non_ok=non_ok, cancelled_at_stop=cancelled,
        cpu_ms_per_request=cpu[0] * 1e3 / ok if ok else None,
        server_cores=cpu[0] / args.duration,
    )  # fmt: skip
    return Sample(setup, level, cpu[1] * 1e3 / ok if ok else math.nan, delta.get("OK", 0.0))


def report(samples: list[Sample], levels: list[int]) -> None:
    print(
        "\n| c | setup | QPS | p50 ms | p99 ms | errors | Envoy CPU ms/req | "
        "server CPU ms/req | QPS / REST binary | QPS per round |\n" + "| --- " * 10 + "|"
    )
    for c in levels:

        def pick(name: str, c: int = c) -> list[Sample]:
            return [s for s in samples if s.setup == name and s.level.concurrency == c]

        base = bms.median_level([s.level for s in pick(R_BIN)])
        for name in SETUPS:
            group = pick(name)
            m = bms.median_level([s.level for s in group])
            errors = int(m.failed + sum(m.non_ok.values()))
            print(f"| {c} | {name} | {bms.fmt(m.qps, ',.0f')} | {bms.fmt(m.p50_ms, '.2f')} | "
                  f"{bms.fmt(m.p99_ms, '.2f')} | {errors} | {bms.fmt(m.cpu_ms_per_request)} | "
                  f"{bms.median([s.server_cpu_ms for s in group]):.3f} | "
                  f"{m.qps / base.qps:.2f} | "
                  + ", ".join(f"{s.level.qps:,.0f}" for s in group) + " |")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description="REST in the model server vs Envoy's transcoder.")
    p.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "infermesh-bench")
    p.add_argument("--concurrency", default="1,16", help="comma-separated client counts")
    p.add_argument("--duration", type=float, default=6.0, help="seconds per timed run")
    p.add_argument("--warmup", type=float, default=2.0, help="discarded seconds before each run")
    p.add_argument("--rounds", type=int, default=2, help="runs per setup and level, alternating")
    p.add_argument(
        "--setups",
        default=",".join(str(i) for i in range(len(SETUPS))),
        help="indices into " + "; ".join(f"{i}={s}" for i, s in enumerate(SETUPS)),
    )
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    chosen = [SETUPS[int(i)] for i in args.setups.split(",") if i.strip()]
    load_avg = os.getloadavg()[0]
    build_demo_repository(args.models)
    exe = bms.ensure_h2load()
    x, req = bms.make_request(1)
    body = bodies(x, req)
    bodies_headers.update({k: v[1] for k, v in body.items()})
    with tempfile.TemporaryDirectory(prefix="bench-transcode-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        for setup, (data, _) in body.items():
            (workdir / f"{SETUPS.index(setup)}.body").write_bytes(data)
        spec = bms.server_specs(args.models)[0]
        grpc_port = be.free_pair()
        cmd = [*spec.cmd, "--port", str(grpc_port), "--http-port", str(grpc_port + be.REST_OFFSET)]
        server = bms.ServerSpec("model server", cmd, spec.listen, spec.ready)
        server_pid, _, metrics_port = stack.enter_context(
            bms.start_server(server, workdir / "server.log")
        )
        free = {grpc_port, grpc_port + be.REST_OFFSET}
        while len(free) < 5:  # three distinct listener ports
            free.add(bm.free_port())
        ports = Ports(*sorted(free - {grpc_port, grpc_port + be.REST_OFFSET}))
        config = envoy_config(workdir, ports, grpc_port, grpc_port + be.REST_OFFSET)
        validated = validate(config)
        envoy_pid, envoy_admin = stack.enter_context(bm.run_envoy(config, workdir))
        admin = bm.Admin(envoy_admin)
        bm.wait_for(lambda: admin.call("/ready").strip() == "LIVE", 30, "Envoy /ready")
        want = direct_probs(f"{HOST}:{grpc_port}", req)
        checks = [f"{s}: {check(s, ports, *body[s], want, req)}" for s in SETUPS]
        tries = kserve_client_tries(ports, x)
        mapping = error_mapping(ports, req)
        samples = []
        metrics = f"http://{HOST}:{metrics_port}/metrics"
        for rnd, c, setup in itertools.product(range(args.rounds), levels, chosen):
            run = run_once(args, exe, setup, c, ports, (envoy_pid, server_pid), metrics, workdir)
            samples.append(run)
            print(
                f"round {rnd + 1} c{c} {setup}: {bms.fmt_row(run.level)} | server "
                f"{run.server_cpu_ms:.3f} ms/req | server OK {run.server_ok:g}",
                flush=True,
            )
        problems = [f"{f.name}: {ln}" for f in sorted(workdir.glob("*.log"))
                    for ln in f.read_text(errors="replace").splitlines()
                    if bm.PROBLEM_RE.search(ln)]  # fmt: skip
    sizes = ", ".join(f"{name} {len(data):,} B" for name, (data, _) in body.items())
    print(f"\n## Envoy transcoder vs REST in the model server, batch 1: commit {bm.commit()}, "
          f"nproc {os.cpu_count()}, load average at start {load_avg:.2f}")  # fmt: skip
    print(f"h2load -m 1 -t 1 (HTTP/1.1 --h1 except gRPC), {args.duration:g} s per run after a "
          f"{args.warmup:g} s warm-up; {args.rounds} rounds, setups alternating; medians; "
          f"Envoy --concurrency 1 (static config), 1 server; bodies: {sizes}")  # fmt: skip
    print(f"envoy --mode validate: {validated}")
    print("\n".join(f"check {c}" for c in checks))
    print("\n".join(f"tritonclient.http via {t}" for t in tries))
    print(f"transcoder, unknown model (gRPC NOT_FOUND): {mapping}")
    if samples:
        report(samples, levels)
    for s in samples:
        if s.server_ok + s.level.cancelled_at_stop < s.level.requests:
            print(
                f"note: {s.setup} c{s.level.concurrency}: h2load 200s {s.level.requests} > "
                f"server OK {s.server_ok:g} (Envoy answered some itself)"
            )
    if problems:
        print(f"log error lines: {len(problems)}, first: {problems[0]}")
    bad = sum(sum(s.level.non_ok.values()) + s.level.failed for s in samples)
    return 1 if bad or problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
