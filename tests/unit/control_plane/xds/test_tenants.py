"""Client identity in the topology, the Envoy resources built from it, the model server's side
of it and the key tools. Pure: tests/integration/test_edge_tenants.py runs it all through the
real Envoy."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.extensions.filters.http.basic_auth.v3 import basic_auth_pb2
from envoy.extensions.filters.http.local_ratelimit.v3 import local_rate_limit_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from google.protobuf import json_format

from control_plane.config.tenants import read_api_keys, security_warnings
from control_plane.config.topology import Topology, TopologyError, load_topology, parse_topology
from control_plane.model.mesh import OTHER_TENANT, ListenerOptions, TenantPolicy, TokenLimit
from control_plane.xds import identity
from control_plane.xds.exposure import RBAC_FILTER
from control_plane.xds.lua_routing import LUA_FILTER
from control_plane.xds.openai_edge import BEARER_LUA_FILTER, OPENAI_LUA_FILTER
from control_plane.xds.resources import LISTENER_TYPE, ROUTE_TYPE, build_resources
from infermesh.api_keys import add_key, basic_authorization, hash_line, new_key, revoke_key
from infermesh.secrets import SecretError
from model_server.core.errors import InferenceError
from model_server.security import tenancy
from tests.support import ROOT
from tests.unit.control_plane.xds.meshes import mesh_state

MODELS = [{"name": "classifier", "sla_p99_ms": 50, "capacity_qps": 100},
          {"name": "detector", "sla_p99_ms": 50, "capacity_qps": 100}]  # fmt: skip


def write(path: Path, **sections: Any) -> Path:
    path.write_text(json.dumps({"models": MODELS, **sections}))  # JSON is YAML
    return path


def errors_of(path: Path) -> tuple[str, ...]:
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    return info.value.errors


def keyed(tmp_path: Path, *tenants: str) -> tuple[Path, dict[str, str]]:
    keys = {tenant: new_key(tenant) for tenant in tenants}
    for key in keys.values():
        add_key(tmp_path / "api-keys", key)
    return tmp_path / "api-keys", keys


# --- the topology -----------------------------------------------------------------------------


def test_a_topology_file_must_say_who_may_call_even_nobody_in_particular(tmp_path: Path) -> None:
    (error,) = errors_of(write(tmp_path / "t.yaml"))
    assert error.startswith("listener.auth: required: mode api_keys")
    (tmp_path / "off.yaml").write_text(
        "listener: {auth: {mode: off}}\nmodels: " + json.dumps(MODELS)
    )
    assert load_topology(tmp_path / "off.yaml").listener.auth.mode == "off"  # YAML's `off`
    # Built in code (not a file), it is off without a word.
    assert parse_topology({"models": MODELS}).listener.auth.mode == "off"


def test_api_keys_are_read_relative_to_the_topology(tmp_path: Path) -> None:
    path, keys = keyed(tmp_path, "team-a", "team-b")
    topology = load_topology(write(tmp_path / "t.yaml", listener={"auth": {
        "mode": "api_keys", "api_keys_file": "api-keys"}}))  # fmt: skip
    auth = topology.listener.auth
    assert auth.api_keys_file == str(path) and auth.files == (str(path),)
    assert sorted(k.tenant for k in auth.api_keys) == ["team-a", "team-b"]
    for key in auth.api_keys:  # only the hash: the secret is nowhere in the topology
        secret = keys[key.tenant].partition(":")[2]
        assert secret not in repr(topology)
        digest = base64.b64encode(hashlib.sha1(secret.encode()).digest()).decode()
        assert key.sha1_b64 == digest
    # No tenants section: everyone is `other`, with every model and no limit.
    assert auth.tenants == (TenantPolicy(OTHER_TENANT),)


def test_a_bad_key_file_is_refused_by_line_never_showing_it(tmp_path: Path) -> None:
    secret_looking = "team-a.k1:plain-secret-value"
    good = hash_line("team-a.k2", "s" * 40)
    (tmp_path / "keys").write_text(
        f"# comment\n\n{secret_looking}\n{good}\n{good}\nother.k:{{SHA}}AAAA\n"
        "team-b.k:{SHA}bm90LXR3ZW50eS1ieXRlcw==\n"
    )
    keys, errors = read_api_keys(tmp_path / "keys")
    assert [k.key_id for k in keys] == ["team-a.k2"]
    assert errors == [
        f"{tmp_path / 'keys'}:3: expected TENANT.KEYID:{{SHA}}BASE64 (content not shown)",
        f"{tmp_path / 'keys'}:5: key id 'team-a.k2' is already on an earlier line",
        f"{tmp_path / 'keys'}:6: tenant 'other' is reserved for identities not listed",
        f"{tmp_path / 'keys'}:7: the {{SHA}} value is not base64 of a 20-byte SHA-1",
    ]
    assert "plain-secret-value" not in "".join(errors)
    (tmp_path / "empty").write_text("# nothing yet\n")
    listener = {"auth": {"mode": "api_keys", "api_keys_file": str(tmp_path / "empty")}}
    (error,) = errors_of(write(tmp_path / "t.yaml", listener=listener))
    assert "holds no key (add one: infermesh keys add TENANT)" in error
    listener = {"auth": {"mode": "api_keys", "api_keys_file": str(tmp_path / "absent")}}
    (error,) = errors_of(write(tmp_path / "t.yaml", listener=listener))
    assert "cannot read the API key file (FileNotFoundError)" in error


@pytest.mark.parametrize(
    ("auth", "expected"),
    [
        ({"mode": "magic"}, 'listener.auth.mode: must be one of api_keys, jwt, off, got "magic"'),
        ({"mode": "api_keys"}, "listener.auth.api_keys_file: required with mode: api_keys"),
        ({"mode": "jwt"}, "listener.auth.jwt: required with mode: jwt"),
        (
            {"mode": "off", "api_keys_file": "k"},
            'listener.auth.api_keys_file: is only read with mode: api_keys, got "off"',
        ),
        (
            {"mode": "jwt", "jwt": {"issuer": "i", "audiences": [], "jwks_file": "j.json"}},
            "listener.auth.jwt.audiences: must be a non-empty list of strings, got []",
        ),
        (
            {"mode": "jwt", "jwt": {"issuer": "i", "audiences": ["a"], "jwks_file": "j.json"}},
            "listener.auth.jwt.jwks_file: cannot read a JWKS from",
        ),
        (
            {"mode": "jwt", "jwt": {"issuer": "i", "audiences": ["a"], "jwks_file": "bad.json"}},
            'has no "keys" list (a JWKS is expected)',
        ),
        ({}, "listener.auth.mode: required"),
    ],
    ids=["mode", "no-file", "no-jwt", "stray-file", "audiences", "no-jwks", "not-jwks", "empty"],
)
def test_auth_errors_name_the_field(tmp_path: Path, auth: dict[str, Any], expected: str) -> None:
    (tmp_path / "bad.json").write_text('{"not": "a jwks"}')
    errors = errors_of(write(tmp_path / "t.yaml", listener={"auth": auth}))
    assert any(expected in e for e in errors), errors


def test_tenants_name_real_models_and_limits(tmp_path: Path) -> None:
    off = {"auth": {"mode": "off"}}
    tenants = {
        "team-a": {"models": ["classifier", "nope"], "model_rate_limits": {"ghost": {}}},
        "bad.name": {},
        "team-b": {"rate_limit": {"burst": 0}, "may_set_priority": "yes"},
    }
    errors = errors_of(write(tmp_path / "t.yaml", listener=off, tenants=tenants))
    assert errors == (
        'tenants.team-a.models[1]: must be a model of the topology or "*", got "nope"',
        'tenants.team-a.model_rate_limits.ghost: must name a model of the topology, got "ghost"',
        "tenants.bad.name: a tenant name must be letters, digits, '_' or '-' (at most 64), "
        'got "bad.name"',
        "tenants.team-b.rate_limit.requests_per_s: required",
        "tenants.team-b.rate_limit.burst: must be >= 1, got 0",
        'tenants.team-b.may_set_priority: must be true or false, got "yes"',
    )
    team_a = {"rate_limit": {"requests_per_s": 5},
              "model_rate_limits": {"detector": {"requests_per_s": 1}}}  # fmt: skip
    good = {"other": {"models": ["detector"]}, "team-a": team_a}
    auth = load_topology(write(tmp_path / "t.yaml", listener=off, tenants=good)).listener.auth
    assert [t.name for t in auth.tenants] == ["team-a", "other"]  # `other` last
    first = auth.tenants[0]
    assert first.limit_for("classifier").requests_per_s == 5  # type: ignore[union-attr]
    assert first.limit_for("detector").requests_per_s == 1  # type: ignore[union-attr]
    assert not auth.tenants[1].may_use("classifier") and auth.tenants[1].may_use("detector")


def test_the_shipped_topologies_turn_authentication_on() -> None:
    for path in (ROOT / "deploy" / "topology.yaml", ROOT / "examples" / "topology.yaml"):
        text = path.read_text()
        assert "mode: api_keys" in text and "../.infermesh/api-keys" in text, path


def test_status_warns_only_when_authentication_is_off() -> None:
    (warning,) = security_warnings(ListenerOptions())
    assert warning.startswith("authentication is off on the public listener 127.0.0.1:8080")
    on = parse_topology({"models": MODELS, "listener": {"auth": {"mode": "off"}}})
    assert security_warnings(on.listener)


# --- the Envoy resources ---------------------------------------------------------------------


def _topology(tmp_path: Path, tenants: dict[str, Any]) -> Topology:
    keyed(tmp_path, "team-a", "team-b")
    auth = {"mode": "api_keys", "api_keys_file": str(tmp_path / "api-keys")}
    return load_topology(write(tmp_path / "t.yaml", listener={"auth": auth}, tenants=tenants))


def _manager(resources: Any) -> hcm_pb2.HttpConnectionManager:
    (listener,) = resources[LISTENER_TYPE].values()
    manager = hcm_pb2.HttpConnectionManager()
    listener.filter_chains[0].filters[-1].typed_config.Unpack(manager)
    return manager


def test_the_listener_authenticates_before_lua_and_rules_after(tmp_path: Path) -> None:
    limit = {"requests_per_s": 2, "burst": 4}
    topology = _topology(tmp_path, {"team-a": {"models": ["classifier"], "rate_limit": limit}})
    resources = build_resources(dataclasses.replace(mesh_state(), listener=topology.listener))
    manager = _manager(resources)
    assert [f.name for f in manager.http_filters] == [
        RBAC_FILTER, "envoy.filters.http.grpc_web", BEARER_LUA_FILTER, identity.BASIC_AUTH_FILTER,
        identity.HEADER_TO_METADATA_FILTER, OPENAI_LUA_FILTER, LUA_FILTER,
        identity.TENANTS_RBAC_FILTER,
        identity.PRIORITY_RBAC_FILTER, identity.VERSION_RBAC_FILTER,
        identity.TENANT_RATE_LIMIT_FILTER, "envoy.filters.http.router",
    ]  # fmt: skip
    basic = basic_auth_pb2.BasicAuth()
    manager.http_filters[3].typed_config.Unpack(basic)
    users = basic.users.inline_string
    assert all(line.split(":")[1].startswith("{SHA}") for line in users.splitlines())
    assert basic.forward_username_header == identity.KEY_ID_HEADER
    limit_config = local_rate_limit_pb2.LocalRateLimit()
    manager.http_filters[10].typed_config.Unpack(limit_config)
    described = {tuple((e.key, e.value) for e in d.entries) for d in limit_config.descriptors}
    assert described == {(("tenant", "team-a"), ("model", "classifier"))}  # detector: not allowed
    assert limit_config.rate_limited_as_resource_exhausted
    (routes,) = resources[ROUTE_TYPE].values()
    host = routes.virtual_hosts[0]  # type: ignore[attr-defined]
    assert list(host.request_headers_to_remove) == ["authorization"]  # no server sees a key
    assert {h.header.key for h in host.request_headers_to_add} == {
        identity.TENANT_HEADER, identity.TENANT_LABEL_HEADER, identity.PRIORITY_PERMISSION_HEADER,
        identity.VERSION_PERMISSION_HEADER,
    }  # fmt: skip
    # Every route of a model names it, REST twins too (the bucket is the tenant's, per model).
    marked = {
        r.name: r.metadata.filter_metadata["infermesh"]["model"]
        for r in host.routes
        if "infermesh" in r.metadata.filter_metadata
    }
    assert {"model:classifier", "model:classifier:v1:stream", "rest:model:classifier"} <= set(
        marked
    )
    assert marked["model:detector"] == "detector"
    assert not any(name.startswith("server:") for name in marked)


def test_the_rules_refuse_what_each_tenant_may_not_do(tmp_path: Path) -> None:
    topology = _topology(tmp_path, {"team-a": {"models": ["classifier"]},
                                    "team-b": {"may_set_priority": True}})  # fmt: skip
    rules = identity.deny_rules(topology.listener.auth)
    assert sorted(rules) == [
        "credential names no tenant",  # a JWT without the tenant claim
        "identity is not a tenant of this mesh",  # no `other`
        "tenant team-a may not choose a model version",
        "tenant team-a may not set x-priority",
        "tenant team-a may not use this model (it may use: classifier)",
        "tenant team-b may not choose a model version",
    ]
    text = json.dumps(json_format.MessageToDict(rules["identity is not a tenant of this mesh"]))
    assert "team-a" in text and "team-b" in text and "notId" in text  # neither named tenant


def test_authentication_off_adds_nothing() -> None:
    manager = _manager(build_resources(mesh_state()))  # built in code: auth off
    names = [f.name for f in manager.http_filters]
    assert not {
        identity.BASIC_AUTH_FILTER,
        identity.JWT_FILTER,
        identity.TENANTS_RBAC_FILTER,
    } & set(names)


# --- the model server's side ---------------------------------------------------------------


def test_the_server_reads_the_edge_identity_and_bounds_its_labels() -> None:
    labels = tenancy.TenantLabels(limit=2)
    assert tenancy.edge_identity((), labels) == tenancy.ANONYMOUS_IDENTITY
    edge = (("x-infermesh-tenant", "alice"), ("x-infermesh-priority", "denied"))
    assert tenancy.edge_identity(edge, labels) == tenancy.EdgeIdentity(
        "alice", "other", may_set_priority=False, may_pick_version=False
    )
    for name in ("a", "b", "c", "bad label!"):
        seen = tenancy.edge_identity(
            (("x-infermesh-tenant", name), ("x-infermesh-tenant-label", name),
             ("x-infermesh-priority", "allowed")), labels)  # fmt: skip
        assert seen.may_set_priority and not seen.may_pick_version
        assert seen.label == {"a": "a", "b": "b"}.get(name, "other")  # two named, then other
    # Through an edge without a tenant header, what Envoy said still holds (never anonymous).
    nameless = tenancy.edge_identity((("x-infermesh-priority", "denied"),), labels)
    assert not nameless.may_set_priority and nameless.label == "other"


def test_the_server_refuses_what_the_edge_could_not_see() -> None:
    tenancy.check_model_header((), "classifier")
    tenancy.check_model_header((("x-model-name", "classifier"),), "classifier")
    with pytest.raises(InferenceError) as info:
        tenancy.check_model_header((("x-model-name", "classifier"),), "detector")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "'classifier'" in info.value.message and "'detector'" in info.value.message
    restricted = tenancy.EdgeIdentity("a", "a", False, False)
    tenancy.check_version(restricted, "", "2")
    tenancy.check_version(restricted, "2", "2")  # the version the split chose
    tenancy.check_version(tenancy.ANONYMOUS_IDENTITY, "1", "")
    with pytest.raises(InferenceError) as info:
        tenancy.check_version(restricted, "1", "2")
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "may_pick_version" in info.value.message
    tenancy.check_priority(tenancy.EdgeIdentity("a", "a", False), 0)
    tenancy.check_priority(tenancy.ANONYMOUS_IDENTITY, 3)
    with pytest.raises(InferenceError) as info:
        tenancy.check_priority(tenancy.EdgeIdentity("a", "a", False), 3)
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED


# --- keys ------------------------------------------------------------------------------------


def test_keys_are_added_listed_and_revoked_with_their_secret_shown_once(tmp_path: Path) -> None:
    keys = tmp_path / "api-keys"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "infermesh.cli", "keys", *args, "--file", str(keys)]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)

    added = cli("add", "team-a")
    assert added.returncode == 0, added.stderr
    key = added.stdout.strip()
    key_id, _, secret = key.partition(":")
    assert key_id.startswith("team-a.") and len(secret) >= 40
    assert secret not in keys.read_text() and (keys.stat().st_mode & 0o777) == 0o600
    assert cli("list").stdout.split() == [key_id]
    assert read_api_keys(keys)[0][0].key_id == key_id
    assert cli("add", "other").returncode == 2  # reserved
    assert cli("add").returncode == 2
    assert cli("revoke", "team-a.nope").returncode == 1
    with pytest.raises(SecretError, match="already there"):
        add_key(keys, key)  # the same key id twice would make every reload fail
    assert cli("revoke", key_id).returncode == 0 and cli("list").stdout == ""
    assert (keys.stat().st_mode & 0o777) == 0o600 and not list(tmp_path.glob(".api-keys.*"))
    assert not revoke_key(keys, key_id)
    assert basic_authorization("a.b:c") == "Basic " + base64.b64encode(b"a.b:c").decode()


def test_keys_init_makes_a_local_mesh_credentials_once(tmp_path: Path) -> None:
    """What compose's mesh-certs runs first: a mesh in containers starts from nothing."""

    def init() -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "infermesh.cli", "keys", "init"]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=tmp_path)

    first = init()
    assert first.returncode == 0, first.stderr
    made = {Path(line.split("made ", 1)[1]).name for line in first.stdout.splitlines()}
    assert made == {"operator.key", "admin.token", "api.key", "api-keys"}
    for name in made:
        assert (tmp_path / ".infermesh" / name).stat().st_mode & 0o777 == 0o600
    key = (tmp_path / ".infermesh" / "api.key").read_text()
    second = init()
    assert second.returncode == 0 and second.stdout == ""  # nothing made twice
    assert (tmp_path / ".infermesh" / "api.key").read_text() == key


def test_token_limits_are_checked_field_by_field(tmp_path: Path) -> None:
    auth = {"mode": "off", "token_limiter": "maybe"}
    tenants = {
        "team-a": {"token_limit": {"tokens_per_s": 1, "tokens_per_minute": 60}},
        "team-b": {"model_token_limits": {"ghost": {"tokens_per_s": 1},
                                          "detector": {"tokens_per_s": -1}}},
        "team-c": {"token_limit": {"tokens_per_minute": 600, "burst": 0, "bursts": 1}},
    }  # fmt: skip
    errors = errors_of(write(tmp_path / "t.yaml", listener={"auth": auth}, tenants=tenants))
    assert errors == (
        'listener.auth.token_limiter: must be one of closed, open, got "maybe"',
        "tenants.team-a.token_limit: give one of tokens_per_s or tokens_per_minute, got "
        "['tokens_per_s', 'tokens_per_minute']",
        'tenants.team-b.model_token_limits.ghost: must name a model of the topology, got "ghost"',
        "tenants.team-b.model_token_limits.detector.tokens_per_s: must be > 0, got -1",
        "tenants.team-c.token_limit.bursts: unknown key (expected one of: tokens_per_s, "
        "tokens_per_minute, burst)",
        "tenants.team-c.token_limit.burst: must be a whole number of tokens >= 1, got 0",
    )


def test_token_limits_per_model_override_the_tenants_default(tmp_path: Path) -> None:
    tenants = {
        "team-a": {"token_limit": {"tokens_per_minute": 6000},
                   "model_token_limits": {"detector": {"tokens_per_s": 5, "burst": 40}}},
        "other": {"models": ["detector"], "token_limit": {"tokens_per_s": 1}},
    }  # fmt: skip
    auth = _topology(tmp_path, tenants).listener.auth
    assert auth.token_limited and not auth.token_limiter_fail_open
    assert auth.token_limit("team-a", "classifier") == TokenLimit(100.0, 6000)  # a minute's
    assert auth.token_limit("team-a", "detector") == TokenLimit(5.0, 40)
    assert auth.token_limit("other", "detector") == TokenLimit(1.0, 60)
    assert auth.token_limit("other", "classifier") is None  # a model it may not use
    assert auth.token_limit("team-b", "detector") is None  # not a tenant: the label is other
    assert TokenLimit(100.0, 6000).describe() == "6000 tokens/min, burst 6000"
