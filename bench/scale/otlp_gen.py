"""OTLP metrics for a fleet of synthetic endpoints, shaped like real model servers' exports.

Every ``--interval`` seconds each endpoint reports the instruments of
``model_server.observability.metrics`` the control plane's TelemetryStore reads, converted as
``model_server.observability.telemetry`` does (Counter -> monotonic CUMULATIVE Sum without
``_total``, Gauge -> Gauge, Histogram -> CUMULATIVE explicit-bounds Histogram; labels as
string attributes; resource ``service.instance.id`` = the endpoint's "HOST:PORT"). Ten points
per endpoint: ``inference_request_duration_seconds`` {model, version} (the server's 70 latency
bounds), ``inference_requests`` {code=OK, model, version}, ``inference_queue_depth`` {model},
``inference_in_flight_requests``, ``accelerator_memory_used_bytes`` and ``_total_bytes``
{device, source}, ``inference_batch_size`` {model}, ``kv_cache_blocks_used`` and ``_total``
{model}, ``server_draining``. Endpoints are batched as a collector would: ``--batch``
ResourceMetrics per Export request, each batch always on the same one of ``--channels``
connections (default one per batch: the control plane's telemetry shards share out
connections, not requests). A round's requests go out spread over ``--spread`` of the
interval, as exporters on their own timers send, each without waiting for the others; a round
ends when every one is acknowledged, and one that ends after its interval is late (the next
starts at once: a receiver that cannot keep up gets less, not a backlog).

Every endpoint of a model reports the same numbers (``--qps`` requests per second at a few
milliseconds, under the SLA), so each model's scope is serialized once per round and spliced
behind each endpoint's resource: the generator's cost stays small next to the receiver's.

Commands on stdin, one answer line of JSON on stdout each:
``slow HOST:PORT`` (from now on that endpoint also reports ``--slow-qps`` requests per second
at ``--slow-ms``: its P99 moves far above 2x the SLA; one export of it is sent at once and its
wall-clock send time is the answer's ``sent_at``), ``heal HOST:PORT`` (back to normal
increments; also sent at once), ``stats``.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.proto.resource.v1 import resource_pb2

from infermesh.wire import LATENCY_BUCKETS_S
from model_server.observability.metrics import BATCH_BUCKETS

EXPORT = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
CUMULATIVE = metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE
START_NS = time.time_ns()
NORMAL_MS = ((0.004, 0.6), (0.008, 0.35), (0.02, 0.05))  # (latency s, share of requests)


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def length_delimited(number: int, data: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(data)) + data


def attrs(**labels: str) -> list[common_pb2.KeyValue]:
    return [
        common_pb2.KeyValue(key=k, value=common_pb2.AnyValue(string_value=v))
        for k, v in sorted(labels.items())
    ]


def resource_field(instance_id: str) -> bytes:
    """ResourceMetrics field 1 (resource), as the model server's exporter sets it."""
    res = resource_pb2.Resource(
        attributes=attrs(
            **{
                "service.name": "infermesh-model-server",
                "service.instance.id": instance_id,
                "service.version": "scale-bench",
                "host.name": "scale-bench",
            }
        )
    )
    return length_delimited(1, res.SerializeToString())


@dataclass
class Profile:
    """One endpoint's (or one model's shared) cumulative counters."""

    model: str
    latency: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    latency_sum: float = 0.0
    requests: float = 0.0
    batch: list[int] = field(default_factory=lambda: [0] * (len(BATCH_BUCKETS) + 1))
    slow: bool = False
    at: float = field(default_factory=time.monotonic)  # counted up to here
    owed: dict[float, float] = field(default_factory=dict)  # latency -> requests not yet counted

    def advance(self, now: float, qps: int, slow_qps: int, slow_s: float) -> None:
        """Counts the requests served up to ``now`` at steady rates. By time, not per export:
        a real server counts real requests, so an export that is late (a busy host) carries
        more of them, and its rate over the exporter's timestamps stays steady."""
        elapsed, self.at = max(0.0, now - self.at), max(self.at, now)
        rates = [(lat, qps * share) for lat, share in NORMAL_MS]
        if self.slow:
            rates.append((slow_s, float(slow_qps)))
        for latency, rate in rates:
            owed = self.owed.get(latency, 0.0) + rate * elapsed
            n = int(owed)
            self.owed[latency] = owed - n
            self.latency[bisect.bisect_left(LATENCY_BUCKETS_S, latency)] += n
            self.latency_sum += latency * n
            self.requests += n
            self.batch[0] += n  # batch size 1

    def scope_field(self, now_ns: int) -> bytes:
        """ResourceMetrics field 2 (scope_metrics) with this profile's ten points."""
        scope = metrics_pb2.ScopeMetrics()
        scope.scope.name, scope.scope.version = "model_server.observability.metrics", "scale-bench"
        m, common = self.model, {"start_time_unix_nano": START_NS, "time_unix_nano": now_ns}

        def histogram(name: str, counts: list[int], bounds: tuple[float, ...], total: float,
                      labels: dict[str, str]) -> None:  # fmt: skip
            metric = scope.metrics.add(name=name)
            metric.histogram.aggregation_temporality = CUMULATIVE
            metric.histogram.data_points.add(
                attributes=attrs(**labels), count=sum(counts), sum=total,
                bucket_counts=counts, explicit_bounds=bounds, **common,
            )  # fmt: skip

        def gauge(name: str, value: float, labels: dict[str, str]) -> None:
            metric = scope.metrics.add(name=name)
            metric.gauge.data_points.add(attributes=attrs(**labels), as_double=value, **common)

        histogram("inference_request_duration_seconds", self.latency, LATENCY_BUCKETS_S,
                  self.latency_sum, {"model": m, "version": "1"})  # fmt: skip
        requests = scope.metrics.add(name="inference_requests")
        requests.sum.aggregation_temporality, requests.sum.is_monotonic = CUMULATIVE, True
        requests.sum.data_points.add(
            attributes=attrs(code="OK", model=m, version="1"), as_double=self.requests, **common
        )
        gauge("inference_queue_depth", 0.0, {"model": m})
        gauge("inference_in_flight_requests", 1.0, {})
        gauge("accelerator_memory_used_bytes", 2.0e9, {"device": "cpu", "source": "process"})
        gauge("accelerator_memory_total_bytes", 8.0e9, {"device": "cpu", "source": "process"})
        histogram("inference_batch_size", self.batch, tuple(float(b) for b in BATCH_BUCKETS),
                  float(sum(self.batch)), {"model": m})  # fmt: skip
        gauge("kv_cache_blocks_used", 0.0, {"model": m})
        gauge("kv_cache_blocks_total", 0.0, {"model": m})
        gauge("server_draining", 0.0, {})
        return length_delimited(2, scope.SerializeToString())


class Generator:
    def __init__(self, args: argparse.Namespace, endpoints: list[tuple[str, str]]) -> None:
        self.args = args
        self.endpoints = endpoints  # (instance id, model)
        self.resources = [resource_field(key) for key, _ in endpoints]
        self.shared = {model: Profile(model) for model in sorted({m for _, m in endpoints})}
        self.own: dict[str, Profile] = {}  # endpoints that were made slow at some point
        self.index = {key: i for i, (key, _) in enumerate(endpoints)}
        # A local subchannel pool each: channels to one target would otherwise share one
        # connection.
        options = [("grpc.max_send_message_length", 64 * 1024 * 1024),
                   ("grpc.use_local_subchannel_pool", 1)]  # fmt: skip
        batches = -(-len(endpoints) // args.batch)
        self.channels = [
            grpc.aio.insecure_channel(args.otlp, options=options)
            for _ in range(args.channels or batches)
        ]
        decode = ExportMetricsServiceResponse.FromString
        self.exports = [
            c.unary_unary(EXPORT, request_serializer=None, response_deserializer=decode)
            for c in self.channels
        ]
        # A round's bodies are built at its start: an endpoint changed while they are sent
        # would then export its older counters after the change's export, which reads as a
        # counter reset (a restart) and hid the change for a round in some trials. A change
        # waits for the round in flight; its export is what the trial times.
        self.sending = asyncio.Lock()
        self.stats: dict[str, float] = {"rounds": 0, "requests": 0, "failures": 0, "rejected": 0,
                                        "late_rounds": 0, "last_round_s": 0.0}  # fmt: skip

    def _advance(self, profile: Profile) -> None:
        args = self.args
        profile.advance(time.monotonic(), args.qps, args.slow_qps, args.slow_ms / 1000)

    def channel_of(self, index: int) -> int:
        """The connection an endpoint's exports take: its batch's, always the same."""
        return (index // self.args.batch) % len(self.exports)

    async def _send(self, body: bytes, channel: int = 0) -> None:
        try:
            response = await self.exports[channel](body, timeout=10)
            self.stats["rejected"] += response.partial_success.rejected_data_points
        except grpc.aio.AioRpcError:
            self.stats["failures"] += 1
        self.stats["requests"] += 1

    async def round(self) -> None:
        async with self.sending:
            await self._round()

    async def _round(self) -> None:
        now_ns = time.time_ns()
        for profile in (*self.shared.values(), *self.own.values()):
            self._advance(profile)
        scopes = {m: p.scope_field(now_ns) for m, p in self.shared.items()}
        own = {key: p.scope_field(now_ns) for key, p in self.own.items()}
        bodies = []
        batch = self.args.batch
        for start in range(0, len(self.endpoints), batch):
            parts = []
            for i in range(start, min(start + batch, len(self.endpoints))):
                key, model = self.endpoints[i]
                scope = own.get(key) or scopes[model]
                parts.append(length_delimited(1, self.resources[i] + scope))
            bodies.append((b"".join(parts), self.channel_of(start)))
        limit = asyncio.Semaphore(self.args.concurrency or len(bodies) or 1)
        step = self.args.spread * self.args.interval / max(1, len(bodies))

        async def send(body: bytes, channel: int, delay: float) -> None:
            await asyncio.sleep(delay)
            async with limit:
                await self._send(body, channel)

        await asyncio.gather(*(send(b, c, i * step) for i, (b, c) in enumerate(bodies)))
        self.stats["rounds"] += 1

    async def change(self, key: str, slow: bool) -> dict[str, Any]:
        if key not in self.index:
            return {"error": f"unknown endpoint {key}"}
        async with self.sending:
            return await self._change(key, slow)

    async def _change(self, key: str, slow: bool) -> dict[str, Any]:
        profile = self.own.get(key)
        if profile is None:  # from now on its own counters, continuing the model's
            shared = self.shared[self.endpoints[self.index[key]][1]]
            profile = self.own[key] = Profile(
                shared.model, list(shared.latency), shared.latency_sum, shared.requests,
                list(shared.batch), at=shared.at, owed=dict(shared.owed),
            )  # fmt: skip
        profile.slow = slow
        self._advance(profile)
        body = length_delimited(
            1, self.resources[self.index[key]] + profile.scope_field(time.time_ns())
        )
        sent_at = time.time()
        await self._send(body, self.channel_of(self.index[key]))
        return {"endpoint": key, "slow": slow, "sent_at": sent_at, "acked_at": time.time()}

    async def run_rounds(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            started = loop.time()
            await self.round()
            self.stats["last_round_s"] = loop.time() - started
            next_at += self.args.interval
            if loop.time() > next_at:  # behind: do not burst
                self.stats["late_rounds"] += 1
                next_at = loop.time()
            await asyncio.sleep(next_at - loop.time())

    async def commands(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := (await reader.readline()).decode().strip():
            word, _, arg = line.partition(" ")
            if word in ("slow", "heal"):
                answer = await self.change(arg.strip(), word == "slow")
            elif word == "stats":
                answer = dict(self.stats)
            else:
                answer = {"error": f"unknown command {line!r}"}
            print(json.dumps(answer), flush=True)


async def main_async(args: argparse.Namespace) -> None:
    endpoints = [(key, model) for _, key, model in json.loads(args.endpoints.read_text())]
    gen = Generator(args, endpoints)
    rounds = asyncio.get_running_loop().create_task(gen.run_rounds())
    try:
        await gen.commands()  # until stdin closes
    finally:
        rounds.cancel()
        for channel in gen.channels:
            await channel.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--otlp", required=True, help="the control plane's OTLP receiver HOST:PORT")
    p.add_argument("--endpoints", type=Path, required=True,
                   help="JSON list of [index, HOST:PORT, model]")  # fmt: skip
    p.add_argument("--interval", type=float, default=1.0, help="seconds between rounds")
    p.add_argument("--batch", type=int, default=100, help="endpoints per Export request")
    p.add_argument("--concurrency", type=int, default=0,
                   help="Export requests in flight at most (0: no limit)")  # fmt: skip
    p.add_argument("--spread", type=float, default=0.8,
                   help="share of the interval a round goes out over (0: at once)")  # fmt: skip
    p.add_argument("--channels", type=int, default=0,
                   help="connections the batches are spread over (0: one per batch)")  # fmt: skip
    p.add_argument("--qps", type=int, default=20, help="requests per second each reports")
    p.add_argument("--slow-qps", type=int, default=100, help="extra slow requests per second")
    p.add_argument("--slow-ms", type=float, default=300.0, help="latency of the slow requests")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
