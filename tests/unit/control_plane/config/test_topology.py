"""The topology file: defaults, validation that reports every error, DNS endpoints."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.config.topology import (
    DnsEndpoint,
    PlacementOptions,
    StaticEndpoint,
    Topology,
    TopologyError,
    load_topology,
    parse_topology,
    parse_topology_text,
    topology_fingerprint,
)
from control_plane.discovery.resolver import EndpointResolver, resolve_endpoints
from control_plane.model.mesh import (
    Affinity,
    CircuitBreaker,
    EdgeAuth,
    EndpointAddress,
    LargeInputs,
    ListenerOptions,
    ModelRoute,
    RateLimit,
    SlaClass,
    TenantPolicy,
)
from control_plane.scoring.types import PoolPolicy
from infermesh.api_keys import ensure_local_credentials

ROOT = Path(__file__).resolve().parents[4]
EXAMPLE = ROOT / "examples" / "topology.yaml"


def minimal() -> dict[str, Any]:
    return {"models": [{"name": "classifier", "sla_p99_ms": 50, "capacity_qps": 1000}]}


def errors_of(data: object) -> list[str]:
    with pytest.raises(TopologyError) as info:
        parse_topology(data, "t.yaml")
    assert info.value.source == "t.yaml"
    for error in info.value.errors:
        assert error in str(info.value)
    return list(info.value.errors)


def test_example_file_loads(tmp_path: Path) -> None:
    # Where `infermesh up` puts it: examples/ beside .infermesh/ with the local key.
    example = tmp_path / "examples" / "topology.yaml"
    example.parent.mkdir()
    shutil.copy(EXAMPLE, example)
    ensure_local_credentials(tmp_path)
    topology = load_topology(example)
    assert topology.source == str(example)
    auth = topology.listener.auth
    assert auth.mode == "api_keys" and [k.tenant for k in auth.api_keys] == ["local"]
    assert auth.tenants == (TenantPolicy("local", may_set_priority=True, may_pick_version=True),)
    assert dataclasses.replace(topology.listener, auth=EdgeAuth()) == ListenerOptions()
    limits = RateLimit(500.0, 500), CircuitBreaker(256, 64)
    classes = (SlaClass("interactive", 1.0, 2, 0.5), SlaClass("batch", 30.0, 0, None))
    large = LargeInputs(1048576, (("device_class", ("a100", "h100")),))
    assert topology.models == (
        ModelRoute(
            "classifier", 50.0, 5.0, (("1", 90), ("2", 10)), *limits,
            sla_classes=classes, large_inputs=large, stalled_try_share=0.5,
        ),
    )  # fmt: skip
    assert topology.capacity("classifier") == 1000.0
    assert topology.policy("classifier").require_labels == (
        ("device_class", ("a100", "cpu", "h100")),
    )
    assert topology.endpoints == (
        StaticEndpoint(
            EndpointAddress("127.0.0.1", 8001), (("reserved_for", "interactive"), ("zone", "a"))
        ),
        StaticEndpoint(EndpointAddress("127.0.0.1", 8002)),
        DnsEndpoint("model-servers.local", 8001),
    )
    # Its comments document the schema: the data alone parses to the same topology.
    data = yaml.safe_load(EXAMPLE.read_text())
    assert parse_topology(data, str(example)) == topology


def test_defaults() -> None:
    topology = parse_topology(minimal())
    assert topology == Topology(
        listener=ListenerOptions(),
        xds=EndpointAddress("127.0.0.1", 18000),
        admin=EndpointAddress("127.0.0.1", 19000),
        placement=PlacementOptions(poll_interval_s=1.0, timeout_s=1.0),
        models=(ModelRoute("classifier", 50.0, 1.0, stalled_try_share=0.5),),
        endpoints=(),
        capacity_qps=(("classifier", 1000.0),),
        source="<topology>",
        policies=(("classifier", PoolPolicy(capacity_qps=1000.0, sla_p99_ms=50.0)),),
    )
    with pytest.raises(KeyError):
        topology.capacity("nope")


@pytest.mark.parametrize(
    ("model", "share"),
    [
        ({}, 0.5),
        ({"hedging": {"stalled_try": 0.25}}, 0.25),
        ({"hedging": {"stalled_try": 0}}, 0.0),
        ({"generative": True}, 0.0),  # a long generation is not a stall
        ({"idempotent": False, "hedging": {"stalled_try": 0.25}}, 0.0),  # would run twice
    ],
)
def test_a_stalled_try_is_hedged_at_a_share_of_the_timeout(
    model: dict[str, object], share: float
) -> None:
    data = minimal()
    data["models"][0].update(model)
    assert parse_topology(data).models[0].stalled_try_share == share


def test_a_bad_hedging_section_is_named_once() -> None:
    data = minimal()
    data["models"][0].update({"hedging": 5, "idempotent": "x"})
    with pytest.raises(TopologyError) as info:
        parse_topology(data)
    errors = list(info.value.errors)
    assert sum(e.startswith("models[0].hedging:") for e in errors) == 1
    assert sum(e.startswith("models[0].idempotent:") for e in errors) == 1


def test_a_stalled_try_share_outside_0_1_is_refused() -> None:
    data = minimal()
    data["models"][0]["hedging"] = {"stalled_try": 1.5}
    with pytest.raises(TopologyError) as info:
        parse_topology(data)
    assert any("hedging.stalled_try" in e and "0..1" in e for e in info.value.errors)


@pytest.mark.parametrize(
    ("sla_p99_ms", "timeout_s", "expected"),
    [(50, None, 1.0), (100, None, 2.0), (250, None, 5.0), (0.5, None, 1.0), (50, 0.25, 0.25)],
)
def test_model_timeout_default(sla_p99_ms: float, timeout_s: float | None, expected: float) -> None:
    data = minimal()
    data["models"][0]["sla_p99_ms"] = sla_p99_ms
    if timeout_s is not None:
        data["models"][0]["timeout_s"] = timeout_s
    assert parse_topology(data).models[0].timeout_s == expected


def test_every_option_is_read() -> None:
    data = {
        **minimal(),
        "listener": {
            "host": "0.0.0.0", "port": 9090, "health_check_interval_s": 2,
            "connect_timeout_s": 0.5, "max_retries": 0, "retry_budget_percent": 100,
            "body_routing": False, "health_checks": "model",
        },
        "xds": {"host": "control-plane", "port": 18001},
        "admin": {"port": 19001},
        "placement": {"poll_interval_s": 0.2, "timeout_s": 3},
    }  # fmt: skip
    topology = parse_topology(data)
    assert topology.listener == ListenerOptions(
        "0.0.0.0", 9090, 2.0, 0.5, 0, 100.0, False, health_checks="model"
    )
    assert topology.xds == EndpointAddress("control-plane", 18001)
    assert topology.admin == EndpointAddress("127.0.0.1", 19001)
    assert topology.placement == PlacementOptions(0.2, 3.0)


def test_versions_and_addresses_are_normalised() -> None:
    data = minimal()
    data["models"][0]["version_split"] = {10: 1, "9": 0, "2": 3}
    data["endpoints"] = [
        {"address": "[::1]:8001"},
        {"address": "127.0.0.1:8001"},
        {"dns": "Model-Servers.Local.:8001"},
    ]
    topology = parse_topology(data)
    assert topology.models[0].version_split == (("2", 3), ("9", 0), ("10", 1))
    assert topology.endpoints == (
        StaticEndpoint(EndpointAddress("::1", 8001)),
        StaticEndpoint(EndpointAddress("127.0.0.1", 8001)),
        DnsEndpoint("model-servers.local", 8001),
    )


def _set(data: dict[str, Any], path: str, value: object) -> dict[str, Any]:
    """A copy of ``data`` with ``value`` at a dotted path (digits index lists)."""
    data = copy.deepcopy(data)
    *parents, last = path.split(".")
    node: Any = data
    for part in parents:
        node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
    node[int(last) if last.isdigit() else last] = value
    return data


# (path to set, value, the one error expected)
ERROR_CASES = [
    ("models.0.sla_p99_ms", -5, "models[0].sla_p99_ms: must be > 0, got -5"),
    ("models.0.sla_p99_ms", 0, "models[0].sla_p99_ms: must be > 0, got 0"),
    ("models.0.sla_p99_ms", "fast", 'models[0].sla_p99_ms: must be a number, got "fast"'),
    ("models.0.sla_p99_ms", True, "models[0].sla_p99_ms: must be a number, got true"),
    ("models.0.sla_p99_ms", float("nan"), "models[0].sla_p99_ms: must be a number, got NaN"),
    ("models.0.capacity_qps", 0, "models[0].capacity_qps: must be > 0, got 0"),
    ("models.0.timeout_s", -1, "models[0].timeout_s: must be > 0, got -1"),
    ("models.0.name", "", "models[0].name: must be a model name (letters, digits, '_', '.', '-'), got \"\""),  # noqa: E501
    ("models.0.name", "a:b", "models[0].name: must be a model name (letters, digits, '_', '.', '-'), got \"a:b\""),  # noqa: E501
    ("models.0.name", 7, "models[0].name: must be a string, got 7"),
    ("models.0.sla_p99", 5, "models[0].sla_p99: unknown key (expected one of: name, sla_p99_ms, capacity_qps, timeout_s, version_split, routing, canary, rate_limit, circuit_breaker, fallback, generative, placement, memory_bytes, sla_classes, large_inputs, hedging, idempotent, affinity)"),  # noqa: E501
    ("models.0.version_split", {}, "models[0].version_split: must be a non-empty mapping of version to weight, got {}"),  # noqa: E501
    ("models.0.version_split", [1, 2], "models[0].version_split: must be a non-empty mapping of version to weight, got [1, 2]"),  # noqa: E501
    ("models.0.version_split", {"v1": 1}, 'models[0].version_split: versions must be numbers like "1", got "v1"'),  # noqa: E501
    ("models.0.version_split", {"01": 1}, 'models[0].version_split: versions must be numbers like "1", got "01"'),  # noqa: E501
    ("models.0.version_split", {"1": 1, 1: 2}, "models[0].version_split: duplicate version, got 1"),
    ("models.0.version_split", {"1": -1}, "models[0].version_split.1: must be an integer weight >= 0, got -1"),  # noqa: E501
    ("models.0.version_split", {"1": 0.5}, "models[0].version_split.1: must be an integer weight >= 0, got 0.5"),  # noqa: E501
    ("models.0.version_split", {"1": 0, "2": 0}, "models[0].version_split: weights must sum to > 0, got 0"),  # noqa: E501
    ("models", [], "models: must list at least one model"),
    ("models", {"name": "x"}, "models: must be a list, got {\"name\": \"x\"}"),
    ("models.0.affinity", "lru", 'models[0].affinity: must be one of none, prefix, session, got "lru"'),  # noqa: E501
    ("models.0.affinity", {"mode": "sticky"}, 'models[0].affinity.mode: must be one of none, prefix, session, got "sticky"'),  # noqa: E501
    ("models.0.affinity", {"hash_balance_factor": 90}, "models[0].affinity.hash_balance_factor: must be >= 100 (a percentage of the mean load), got 90"),  # noqa: E501
    ("models.0.affinity", {"prefix_blocks": 0}, "models[0].affinity.prefix_blocks: must be >= 1, got 0"),  # noqa: E501
    ("models.0.affinity", {"prefix_blocks": 300}, "models[0].affinity.prefix_blocks: prefix_blocks x block_bytes must be <= 4096, got 4800"),  # noqa: E501
    ("models.0.affinity", {"block_bytes": 1.5}, "models[0].affinity.block_bytes: must be an integer in 0..4294967295, got 1.5"),  # noqa: E501
    ("models.0.affinity", {"hash_balance_factor": 1 << 32}, "models[0].affinity.hash_balance_factor: must be an integer in 0..4294967295, got 4294967296"),  # noqa: E501
    ("models.0.timeout_s", 1e300, "models[0].timeout_s: must be at most 315576000000 (a duration Envoy can hold), got 1e+300"),  # noqa: E501
    ("models.0.sla_p99_ms", 1e300, "models[0].sla_p99_ms: must be at most 315576000000000 (a duration Envoy can hold), got 1e+300"),  # noqa: E501
    ("models.0.rate_limit", {"requests_per_s": 1e12}, "models[0].rate_limit.requests_per_s: must be at most 4294967295 (a rate Envoy can hold), got 1000000000000.0"),  # noqa: E501
    ("models.0.version_split", {"1": 1 << 31, "2": 1 << 31}, "models[0].version_split: weights must sum to at most 4294967295, got 4294967296"),  # noqa: E501
    ("models.0.affinity", {"mode": "session", "session_header": "x-infermesh-tenant"}, 'models[0].affinity.session_header: must be a lower-case header name a client sets (not x-infermesh-*, x-model-*, authorization), got "x-infermesh-tenant"'),  # noqa: E501
    ("models.0.affinity", {"one_request_streams": "yes"}, 'models[0].affinity.one_request_streams: must be true or false, got "yes"'),  # noqa: E501
    ("models.0.affinity", {"prefix_bytes": 64}, "models[0].affinity.prefix_bytes: unknown key (expected one of: mode, prefix_blocks, block_bytes, session_header, hash_balance_factor, one_request_streams)"),  # noqa: E501
    ("models.0.affinity", 3, "models[0].affinity: must be a mapping with string keys, got 3"),
    ("models.0", "classifier", 'models[0]: must be a mapping with string keys, got "classifier"'),
    ("listener.port", 0, "listener.port: must be a port in 1..65535, got 0"),
    ("listener.port", 65536, "listener.port: must be a port in 1..65535, got 65536"),
    ("listener.port", 8080.0, "listener.port: must be a port in 1..65535, got 8080.0"),
    ("listener.port", "8080", 'listener.port: must be a number, got "8080"'),
    ("listener.host", "localhost", 'listener.host: must be an IP address, got "localhost"'),
    ("listener.max_retries", -1, "listener.max_retries: must be an integer in 0..4294967295, got -1"),  # noqa: E501
    ("listener.max_retries", 1 << 32, "listener.max_retries: must be an integer in 0..4294967295, got 4294967296"),  # noqa: E501
    ("listener.retry_budget_percent", 101, "listener.retry_budget_percent: must be in 0..100, got 101"),  # noqa: E501
    ("listener.body_routing", "yes", 'listener.body_routing: must be true or false, got "yes"'),
    ("listener.access_log", "logs/a.log", 'listener.access_log: must be an absolute path (or ""), got "logs/a.log"'),  # noqa: E501
    ("listener.lb_policy", "random", 'listener.lb_policy: must be one of least_request, round_robin, got "random"'),  # noqa: E501
    ("listener.health_check_interval_s", 0, "listener.health_check_interval_s: must be > 0, got 0"),
    ("listener.health_checks", "some", 'listener.health_checks: must be one of all, model, got "some"'),  # noqa: E501
    ("listener.connect_timeout_s", -0.1, "listener.connect_timeout_s: must be > 0, got -0.1"),
    ("listener.prot", 1, "listener.prot: unknown key (expected one of: host, port, health_check_interval_s, health_checks, connect_timeout_s, max_retries, retry_budget_percent, body_routing, lb_policy, access_log, rest, grpc_web, cors, expose, limits, auth, upstream_tls, tls)"),  # noqa: E501
    ("listener", [], "listener: must be a mapping with string keys, got []"),
    ("xds.port", 70000, "xds.port: must be a port in 1..65535, got 70000"),
    ("xds.host", "a b", 'xds.host: must be a host name or IP, got "a b"'),
    ("admin.port", -1, "admin.port: must be a port in 1..65535, got -1"),
    ("placement.poll_interval_s", 0, "placement.poll_interval_s: must be > 0, got 0"),
    ("placement.timeout_s", None, "placement.timeout_s: must be a number, got null"),
    ("telemetry.shard_nice", 20, "telemetry.shard_nice: must be an integer in 0..19, got 20"),
    ("telemetry.shard_nice", 2.5, "telemetry.shard_nice: must be an integer in 0..19, got 2.5"),
    ("telemetry.push_tolerance", 1.5, "telemetry.push_tolerance: must be in 0..1, got 1.5"),
    ("endpoint", [], "endpoint: unknown key (expected one of: listener, xds, admin, placement, telemetry, models, endpoints, tenants)"),  # noqa: E501
    ("endpoints", {"address": "127.0.0.1:1"}, 'endpoints: must be a list, got {"address": "127.0.0.1:1"}'),  # noqa: E501
    ("endpoints", [{"address": "localhost:8001"}], "endpoints[0].address: must be an IP address and port (use 'dns:' for names), got \"localhost:8001\""),  # noqa: E501
    ("endpoints", [{"address": "127.0.0.1"}], 'endpoints[0].address: must be host:port with a port in 1..65535, got "127.0.0.1"'),  # noqa: E501
    ("endpoints", [{"address": "127.0.0.1:0"}], 'endpoints[0].address: must be host:port with a port in 1..65535, got "127.0.0.1:0"'),  # noqa: E501
    ("endpoints", [{"address": 8001}], "endpoints[0].address: must be host:port with a port in 1..65535, got 8001"),  # noqa: E501
    ("endpoints", [{"address": "::1:8001"}], 'endpoints[0].address: must be host:port with IPv6 in brackets ([::1]:8001), got "::1:8001"'),  # noqa: E501
    ("endpoints", [{"dns": "bad name:1"}], 'endpoints[0].dns: must be a DNS name and port, got "bad name:1"'),  # noqa: E501
    ("endpoints", [{"dns": "a.local:99999"}], 'endpoints[0].dns: must be host:port with a port in 1..65535, got "a.local:99999"'),  # noqa: E501
    ("endpoints", [{}], "endpoints[0]: needs exactly one of 'address', 'dns' or 'kubernetes'"),
    ("endpoints", [{"address": "1.2.3.4:1", "dns": "a:1"}], "endpoints[0]: needs exactly one of 'address', 'dns' or 'kubernetes'"),  # noqa: E501
    ("endpoints", [{"adress": "1.2.3.4:1"}], "endpoints[0].adress: unknown key (expected one of: address, dns, kubernetes, labels, kind, metrics_url, rest_port, tls)"),  # noqa: E501
    ("endpoints", [{"address": "127.0.0.1:1"}, {"address": "127.0.0.1:1"}], 'endpoints[1].address: duplicate endpoint "127.0.0.1:1" (first at endpoints[0])'),  # noqa: E501
    ("endpoints", [{"dns": "a.local:1"}, {"dns": "A.local:1"}], 'endpoints[1].dns: duplicate endpoint "a.local:1" (first at endpoints[0])'),  # noqa: E501
]  # fmt: skip


@pytest.mark.parametrize(("path", "value", "expected"), ERROR_CASES)
def test_each_error(path: str, value: object, expected: str) -> None:
    assert errors_of(_set(minimal(), path, value)) == [expected]


def test_required_and_duplicate_models() -> None:
    assert errors_of({}) == ["models: required"]
    assert errors_of([]) == ["topology: must be a mapping with string keys, got []"]
    assert errors_of(None) == ["topology: must be a mapping with string keys, got null"]
    data = minimal()
    data["models"].append({"name": "other"})
    data["models"].append(dict(data["models"][0]))
    assert errors_of(data) == [
        "models[1].sla_p99_ms: required",
        "models[1].capacity_qps: required",
        'models[2].name: duplicate model "classifier" (first at models[0])',
    ]


MANY_ERRORS = """\
listener: {port: 0, prot: 8080, body_routing: maybe}
xds: {host: 127.0.0.1, port: 18000}
xds: {host: 127.0.0.1, port: 18001}
placement: {poll_interval_s: -1}
models:
  - name: classifier
    sla_p99_ms: 50
    capacity_qps: 1000
    version_split: {"1": 90, "two": 10}
  - name: classifier
    sla_p99_ms: -5
    capacity_qps: 10
endpoints:
  - address: 127.0.0.1:8001
  - address: 127.0.0.1:8001
  - address: model-server:8001
"""


def test_many_errors_are_reported_at_once(tmp_path: Path) -> None:
    path = tmp_path / "topology.yaml"
    path.write_text(MANY_ERRORS)
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    assert info.value.errors == (
        'line 3: duplicate key "xds" (first at line 2)',
        "listener.prot: unknown key (expected one of: host, port, health_check_interval_s, "
        "health_checks, connect_timeout_s, max_retries, retry_budget_percent, body_routing, "
        "lb_policy, access_log, rest, grpc_web, cors, expose, limits, auth, upstream_tls, tls)",
        "listener.port: must be a port in 1..65535, got 0",
        'listener.body_routing: must be true or false, got "maybe"',
        # A file must say who may call the listener, even that anyone may.
        "listener.auth: required: mode api_keys (with api_keys_file) or jwt (with jwt), or "
        "mode: off to serve every caller unauthenticated (the control plane then warns in "
        "/status)",
        "placement.poll_interval_s: must be > 0, got -1",
        'models[0].version_split: versions must be numbers like "1", got "two"',
        'models[1].name: duplicate model "classifier" (first at models[0])',
        "models[1].sla_p99_ms: must be > 0, got -5",
        'endpoints[1].address: duplicate endpoint "127.0.0.1:8001" (first at endpoints[0])',
        "endpoints[2].address: must be an IP address and port (use 'dns:' for names), "
        'got "model-server:8001"',
    )
    assert str(info.value).startswith(f"{path}: 11 topology error(s):\n  - line 3: duplicate")


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="cannot read the file"):
        load_topology(tmp_path / "missing.yaml")
    with pytest.raises(TopologyError, match="invalid YAML"):
        parse_topology_text("models: [", "bad.yaml")
    # Duplicate keys nested anywhere are found; a YAML merge key is not a duplicate.
    text = "base: &b {port: 1}\nmodels:\n  - {name: a, name: b, sla_p99_ms: 1, capacity_qps: 1}\n"
    with pytest.raises(TopologyError) as info:
        parse_topology_text(text)
    assert info.value.errors[0] == 'line 3: duplicate key "name" (first at line 3)'
    # Odd YAML (recursive anchors, dates) is reported, never crashes.
    with pytest.raises(TopologyError) as info:
        parse_topology_text("models: &a [*a]\nendpoints: [{2020-01-01: x}]\n")
    assert info.value.errors == (
        "models[0]: must be a mapping with string keys, got [[...]]",
        "endpoints[0]: must be a mapping with string keys, got {datetime.date(2020, 1, 1): 'x'}",
    )
    merged = "listener: &l {port: 9000}\nxds: {<<: *l, port: 18001}\n"
    topology = parse_topology_text(merged + yaml.safe_dump(minimal()))
    assert topology.xds.port == 18001


JSON_LIKE = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 70000) | st.floats() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.sampled_from(["name", "port", "models", "dns", "1", "x"]), children)
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "listener": JSON_LIKE, "xds": JSON_LIKE, "placement": JSON_LIKE,
            "models": st.lists(st.dictionaries(st.sampled_from(sorted(
                ["name", "sla_p99_ms", "capacity_qps", "timeout_s", "version_split"]
            )), JSON_LIKE)),
            "endpoints": st.lists(st.dictionaries(st.sampled_from(["address", "dns"]), JSON_LIKE)),
        },
    )
)  # fmt: skip
def test_any_input_gives_a_topology_or_a_topology_error(data: dict[str, Any]) -> None:
    try:
        topology = parse_topology(data)
    except TopologyError as exc:
        assert exc.errors
    else:
        assert topology.models


def test_fingerprint_changes_with_content(tmp_path: Path) -> None:
    path = tmp_path / "topology.yaml"
    assert topology_fingerprint(path) is None
    path.write_text("a: 1\n")
    first = topology_fingerprint(path)
    assert first is not None and first == topology_fingerprint(path)
    path.write_text("a: 2\n")  # same size; force the same mtime too: only the hash differs
    os.utime(path, ns=(first.mtime_ns, first.mtime_ns))
    second = topology_fingerprint(path)
    assert second is not None and second.size == first.size and second != first


def test_resolve_endpoints() -> None:
    topology = parse_topology(
        {
            **minimal(),
            "endpoints": [
                {"dns": "localhost:8001"},
                {"address": "127.0.0.1:8001"},
                {"address": "127.0.0.1:8002"},
                {"dns": "no-such-host.invalid:1"},
            ],
        }
    )
    addresses = asyncio.run(resolve_endpoints(topology))
    assert addresses == tuple(sorted(addresses))
    assert len(set(addresses)) == len(addresses)
    assert EndpointAddress("127.0.0.1", 8001) in addresses
    assert EndpointAddress("127.0.0.1", 8002) in addresses
    # localhost may also resolve to ::1; the unresolvable name is skipped.
    assert set(addresses) <= {
        EndpointAddress("127.0.0.1", 8001),
        EndpointAddress("127.0.0.1", 8002),
        EndpointAddress("::1", 8001),
    }


def test_resolver_logs_a_failing_name_once(caplog: pytest.LogCaptureFixture) -> None:
    resolver = EndpointResolver(timeout_s=5.0)
    sources = [DnsEndpoint("no-such-host.invalid", 1), DnsEndpoint("localhost", 9)]

    async def twice() -> list[tuple[EndpointAddress, ...]]:
        return [await resolver.resolve(sources), await resolver.resolve(sources)]

    with caplog.at_level(logging.WARNING, logger="control_plane.config.topology"):
        first, second = asyncio.run(twice())
    assert first == second and EndpointAddress("127.0.0.1", 9) in first
    warnings = [r for r in caplog.records if "no-such-host.invalid" in r.getMessage()]
    assert len(warnings) == 1


def test_a_name_that_fails_for_a_moment_keeps_its_last_addresses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A DNS server restarting (EAI_AGAIN) or answering slowly took a name's servers out of
    every cluster until it answered again (503s for its models). Now the last good answer
    stands for a while; "no such name" still drops it at once. (getaddrinfo is replaced to
    fail on cue: no DNS server here can be made to.)"""
    resolver = EndpointResolver(timeout_s=0.5)
    source = [DnsEndpoint("localhost", 9)]
    real = socket.getaddrinfo
    first = asyncio.run(resolver.resolve(source))
    assert EndpointAddress("127.0.0.1", 9) in first

    def failing(errno: int) -> Any:
        def lookup(*args: Any, **kwargs: Any) -> Any:
            raise socket.gaierror(errno, "injected")

        return lookup

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(1.0)
        return real(*args, **kwargs)

    for transient in (failing(socket.EAI_AGAIN), slow):
        monkeypatch.setattr(socket, "getaddrinfo", transient)
        assert asyncio.run(resolver.resolve(source)) == first
    monkeypatch.setattr(socket, "getaddrinfo", failing(socket.EAI_NONAME))
    assert asyncio.run(resolver.resolve(source)) == ()
    monkeypatch.setattr(socket, "getaddrinfo", failing(socket.EAI_AGAIN))
    assert asyncio.run(resolver.resolve(source)) == ()  # nothing good left to keep


def test_model_routing_policy_from_the_topology() -> None:
    from control_plane.config.topology import parse_topology_text

    text = """
models:
  - name: llm
    sla_p99_ms: 200
    capacity_qps: 50
    routing:
      score_weights: {qps: 0.2, latency: 0.4, memory: 0.1, kv_cache: 0.2, queue: 0.1}
      memory_watermark: 0.9
      latency_eject_windows: 2
      slow_start_s: 0
      kv_full_at: 0.9
  - name: classifier
    sla_p99_ms: 50
    capacity_qps: 1000
"""
    topology = parse_topology_text(text)
    llm = topology.policy("llm")
    assert llm.capacity_qps == 50 and llm.sla_p99_ms == 200
    assert llm.score_weights.kv_cache == 0.2 and llm.memory_watermark == 0.9
    assert llm.latency_eject_windows == 2 and llm.slow_start_s == 0 and llm.kv_full_at == 0.9
    default = topology.policy("classifier")
    assert default.score_weights.qps == 0.4 and default.memory_watermark == 0.95
    assert default.kv_full_at == 0.8


def test_an_affinity_pool_leaves_kv_full_at_off_unless_it_is_set() -> None:
    """Its weights are its Maglev table: a steep fall of a filling server's score moves the
    prefixes it holds. Set explicitly, the value given applies."""
    from control_plane.config.topology import parse_topology_text

    text = """
models:
  - {name: lm, sla_p99_ms: 200, capacity_qps: 50, generative: true, affinity: prefix}
  - {name: chosen, sla_p99_ms: 200, capacity_qps: 50, generative: true, affinity: prefix,
     routing: {kv_full_at: 0.9}}
  - {name: plain, sla_p99_ms: 200, capacity_qps: 50, generative: true}
"""
    topology = parse_topology_text(text)
    assert topology.policy("lm").kv_full_at == 1.0
    assert topology.policy("chosen").kv_full_at == 0.9
    assert topology.policy("plain").kv_full_at == 0.8


def test_model_routing_policy_errors_are_all_reported() -> None:
    from control_plane.config.topology import TopologyError, parse_topology_text

    text = """
models:
  - name: m
    sla_p99_ms: 10
    capacity_qps: 10
    routing:
      score_weights: {qps: 0, latency: 0, memory: 0, speed: 1}
      memory_watermark: 1.5
      latency_eject_windows: 0
      kv_full_at: -0.1
      surprise: true
"""
    with pytest.raises(TopologyError) as caught:
        parse_topology_text(text)
    message = str(caught.value)
    for fragment in (
        "models[0].routing.score_weights.speed: unknown key",
        "models[0].routing.memory_watermark: must be in 0..1",
        "models[0].routing.latency_eject_windows: must be >= 1",
        "models[0].routing.kv_full_at: must be in 0..1",
        "models[0].routing.surprise: unknown key",
        "models[0].routing.score_weights: at least one weight must be > 0",
    ):
        assert fragment in message


def test_affinity_modes_and_defaults() -> None:
    models = minimal()["models"]
    models.append({**models[0], "name": "lm", "affinity": "prefix"})
    models.append({**models[0], "name": "chat",
                   "affinity": {"mode": "session", "session_header": "x-conversation",
                                "hash_balance_factor": 125}})  # fmt: skip
    models.append({**models[0], "name": "plain", "affinity": "none"})
    routes = {m.name: m for m in parse_topology(minimal() | {"models": models}).models}
    assert routes["classifier"].affinity is None and routes["plain"].affinity is None
    assert routes["lm"].affinity == Affinity("prefix")
    assert routes["lm"].affinity.prefix_bytes == 128  # 8 blocks of 16 tokens (bytes)
    assert routes["chat"].affinity == Affinity(
        "session", session_header="x-conversation", hash_balance_factor=125
    )
