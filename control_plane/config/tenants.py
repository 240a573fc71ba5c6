"""The topology's ``listener.auth`` and ``tenants`` sections, and the API key file.

``listener.auth`` says how the public listener tells callers apart; it must be given, so that
serving everyone is a choice written down (``mode: off``), never a default::

    listener:
      auth:
        mode: api_keys                  # api_keys | jwt | off
        api_keys_file: ../.infermesh/api-keys   # mode api_keys: hashed keys (below)
        jwt:                            # mode jwt
          issuer: https://issuer.example.com
          audiences: [infermesh]        # at least one; a token for another audience is refused
          jwks_file: jwks.json          # the issuer's public keys (JWKS JSON)
          tenant_claim: sub             # the claim that names the tenant
    tenants:                            # optional; absent: every identity is "other"
      team-a:
        models: [classifier]            # the models it may use; default ["*"]: all
        rate_limit: {requests_per_s: 50, burst: 100}   # per model (optional)
        model_rate_limits: {classifier: {requests_per_s: 10}}   # overrides per model
        may_set_priority: false         # x-priority header / "priority" parameter
        may_pick_version: false         # x-model-version header / a version in the request
        token_limit: {tokens_per_minute: 6000, burst: 2000}   # every model it uses (optional)
        model_token_limits: {demo_lm: {tokens_per_s: 50}}     # overrides per model
      other: {...}                      # every identity not listed (absent: refused)

A token limit counts prompt plus completion tokens, given as ``tokens_per_s`` or
``tokens_per_minute`` (one of them) with ``burst`` (default: one minute's tokens, at least one
second's); Envoy reserves each request's bound before it is sent and the unused part is refunded
when it ends (docs/control-plane.md, "Token limits"). ``listener.auth.token_limiter: open``
admits requests while the limiter (the control plane) cannot be asked; the default, ``closed``,
refuses them.

Relative paths are read from the topology file's folder. The API key file has one key a line,
``TENANT.KEYID:{SHA}BASE64`` (htpasswd's SHA-1 form, the secret itself is never stored:
``infermesh keys add TENANT`` makes one); ``#`` starts a comment. Errors name the file and the
line number, never a line's content.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from pathlib import Path
from typing import Any

from control_plane.config.models import parse_rate_limit
from control_plane.model.mesh import (
    AUTH_MODES,
    OTHER_TENANT,
    ApiKey,
    EdgeAuth,
    JwtAuth,
    ListenerOptions,
    RateLimit,
    TenantPolicy,
    TokenLimit,
)
from control_plane.model.schema import Checker

TENANT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # no '.': it separates TENANT.KEYID
KEY_LINE = re.compile(
    r"(?P<tenant>[A-Za-z0-9_-]{1,64})\.(?P<key>[A-Za-z0-9_-]{1,64}):\{SHA\}(?P<hash>\S+)"
)
CLAIM_NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")
_AUTH = ("mode", "api_keys_file", "jwt", "token_limiter")
TOKEN_LIMITER_MODES = ("closed", "open")
_JWT = ("issuer", "audiences", "jwks_file", "tenant_claim")
_TENANT = (
    "models", "rate_limit", "model_rate_limits", "may_set_priority", "may_pick_version",
    "token_limit", "model_token_limits",
)  # fmt: skip
_TOKEN_LIMIT = ("tokens_per_s", "tokens_per_minute", "burst")
MAX_TOKEN_BURST = 1_000_000_000  # Envoy's largest hits_addend
MISSING_AUTH = (
    "required: mode api_keys (with api_keys_file) or jwt (with jwt), or mode: off to serve "
    "every caller unauthenticated (the control plane then warns in /status)"
)


def security_warnings(listener: ListenerOptions) -> list[str]:
    """What an operator must know about how exposed the mesh is (/status, /ui, the log)."""
    if listener.auth.mode != "off":
        return []
    return [
        f"authentication is off on the public listener {listener.host}:{listener.port} "
        "(listener.auth.mode: off): every caller that reaches it may use every model, with no "
        "tenant, rate limit or priority control; set mode api_keys or jwt (docs/security.md)"
    ]


def read_api_keys(path: Path) -> tuple[tuple[ApiKey, ...], list[str]]:
    """The keys in ``path`` and the errors found (each naming the file and line)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return (), [f"{path}: cannot read the API key file ({type(exc).__name__})"]
    keys: dict[str, ApiKey] = {}
    errors = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = KEY_LINE.fullmatch(line)
        where = f"{path}:{number}"
        if match is None:
            errors.append(f"{where}: expected TENANT.KEYID:{{SHA}}BASE64 (content not shown)")
            continue
        if match["tenant"] == OTHER_TENANT:
            errors.append(f"{where}: tenant {OTHER_TENANT!r} is reserved for identities not listed")
            continue
        try:
            digest = base64.b64decode(match["hash"], validate=True)
        except (binascii.Error, ValueError):
            digest = b""
        if len(digest) != 20:
            errors.append(f"{where}: the {{SHA}} value is not base64 of a 20-byte SHA-1")
            continue
        key_id = f"{match['tenant']}.{match['key']}"
        if key_id in keys:
            errors.append(f"{where}: key id {key_id!r} is already on an earlier line")
            continue
        keys[key_id] = ApiKey(key_id, match["tenant"], match["hash"])
    return tuple(keys.values()), errors


def _file(base: Path, value: str) -> Path:
    path = Path(value)
    return path if path.is_absolute() else base / path


def _jwt(c: Checker, value: object, path: str, base: Path) -> JwtAuth | None:
    m = c.mapping(value, path)
    if m is None:
        return None
    c.keys(m, path, _JWT, required=("issuer", "audiences", "jwks_file"))
    issuer, jwks_file = m.get("issuer"), m.get("jwks_file")
    if "issuer" in m and not (isinstance(issuer, str) and issuer):
        c.fail(f"{path}.issuer", "must be a non-empty string", issuer)
    audiences = m.get("audiences")
    strings = isinstance(audiences, list) and all(isinstance(a, str) and a for a in audiences)
    if "audiences" in m and not (strings and audiences):
        c.fail(f"{path}.audiences", "must be a non-empty list of strings", audiences)
    claim = m.get("tenant_claim", "sub")
    if not (isinstance(claim, str) and CLAIM_NAME.fullmatch(claim)):
        c.fail(f"{path}.tenant_claim", "must be a claim name", claim)
    jwks, file = "", ""
    if "jwks_file" in m:
        if isinstance(jwks_file, str) and jwks_file:
            file = str(_file(base, jwks_file))
            jwks = _read_jwks(c, Path(file), f"{path}.jwks_file")
        else:
            c.fail(f"{path}.jwks_file", "must be a file path", jwks_file)
    if c.errors:
        return None
    return JwtAuth(str(issuer), tuple(audiences or ()), jwks, str(claim), file)


def _read_jwks(c: Checker, file: Path, path: str) -> str:
    try:
        text = file.read_text(encoding="utf-8")
        keys = json.loads(text).get("keys")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:
        c.errors.append(f"{path}: cannot read a JWKS from {file} ({type(exc).__name__})")
        return ""
    if not isinstance(keys, list) or not keys:
        c.errors.append(f'{path}: {file} has no "keys" list (a JWKS is expected)')
        return ""
    return text


def parse_auth(
    c: Checker, given: dict[str, Any], path: str, base: Path, required: bool
) -> EdgeAuth:
    """``listener.auth`` (``given`` is the listener mapping); tenants come later. Absent: an
    error when ``required`` (a topology file), else off (a topology built in code)."""
    if "auth" not in given:
        if required:
            c.errors.append(f"{path}: {MISSING_AUTH}")
        return EdgeAuth()
    m = c.mapping(given["auth"], path)
    if m is None:
        return EdgeAuth()
    c.keys(m, path, _AUTH, required=("mode",))
    mode = m.get("mode")
    if "mode" in m and mode not in AUTH_MODES:
        # YAML reads a bare `off` as false: accept it as the explicit choice it is.
        if mode is False:
            mode = "off"
        else:
            c.fail(f"{path}.mode", f"must be one of {', '.join(AUTH_MODES)}", mode)
            return EdgeAuth()
    fail_open = _token_limiter(c, m, path)
    needs = {"api_keys": "api_keys_file", "jwt": "jwt"}
    for other_mode, key in needs.items():
        if key in m and mode != other_mode:
            c.fail(f"{path}.{key}", f"is only read with mode: {other_mode}", mode)
    if mode in needs and needs[str(mode)] not in m:
        c.errors.append(f"{path}.{needs[str(mode)]}: required with mode: {mode}")
        return EdgeAuth()
    if mode == "api_keys":
        value = m["api_keys_file"]
        if not (isinstance(value, str) and value):
            c.fail(f"{path}.api_keys_file", "must be a file path", value)
            return EdgeAuth()
        file = _file(base, value)
        keys, errors = read_api_keys(file)
        c.errors.extend(f"{path}.api_keys_file: {e}" for e in errors)
        if not keys and not errors:
            c.errors.append(
                f"{path}.api_keys_file: {file} holds no key (add one: infermesh keys add TENANT)"
            )
        return EdgeAuth(
            "api_keys", api_keys=keys, api_keys_file=str(file), token_limiter_fail_open=fail_open
        )
    if mode == "jwt":
        jwt = _jwt(c, m["jwt"], f"{path}.jwt", base)
        return EdgeAuth("jwt", jwt=jwt, token_limiter_fail_open=fail_open)
    return EdgeAuth()


def _token_limiter(c: Checker, m: dict[str, Any], path: str) -> bool:
    """``token_limiter``: whether Envoy admits requests it cannot ask the limiter about."""
    value = m.get("token_limiter", "closed")
    if value not in TOKEN_LIMITER_MODES:
        c.fail(f"{path}.token_limiter", f"must be one of {', '.join(TOKEN_LIMITER_MODES)}", value)
    return value == "open"


def _flag(c: Checker, m: dict[str, Any], path: str, key: str) -> bool:
    return bool(c.value(m, path, key, "bool", False))


def _models(c: Checker, m: dict[str, Any], path: str, known: set[str]) -> tuple[str, ...]:
    if "models" not in m:
        return ("*",)
    items = c.sequence(m["models"], f"{path}.models") or []
    result = []
    for index, item in enumerate(items):
        if item == "*" or item in known:
            result.append(item)
        else:
            c.fail(f"{path}.models[{index}]", 'must be a model of the topology or "*"', item)
    return tuple(dict.fromkeys(result))


def _model_limits(
    c: Checker, m: dict[str, Any], path: str, known: set[str]
) -> tuple[tuple[str, RateLimit], ...]:
    given = c.mapping(m.get("model_rate_limits", {}), f"{path}.model_rate_limits") or {}
    result = []
    for model in given:
        where = f"{path}.model_rate_limits"
        if model not in known:
            c.fail(f"{where}.{model}", "must name a model of the topology", model)
            continue
        parsed = parse_rate_limit(c, given, where, key=model)
        if parsed is not None:
            result.append((model, parsed))
    return tuple(result)


def parse_token_limit(c: Checker, value: object, where: str) -> TokenLimit | None:
    """One token limit: ``tokens_per_s`` or ``tokens_per_minute`` (exactly one), ``burst``."""
    m = c.mapping(value, where)
    if m is None:
        return None
    c.keys(m, where, _TOKEN_LIMIT)
    given = [k for k in ("tokens_per_s", "tokens_per_minute") if k in m]
    if len(given) != 1:
        c.errors.append(f"{where}: give one of tokens_per_s or tokens_per_minute, got {given}")
        return None
    rate = c.value(m, where, given[0], "positive", None)
    if rate is None:
        return None
    per_s = rate if given[0] == "tokens_per_s" else rate / 60.0
    burst = m.get("burst", max(math.ceil(per_s * 60), math.ceil(per_s), 1))
    if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
        c.fail(f"{where}.burst", "must be a whole number of tokens >= 1", burst)
        return None
    if burst > MAX_TOKEN_BURST or per_s > MAX_TOKEN_BURST:
        c.fail(where, f"must stay under {MAX_TOKEN_BURST} tokens (burst and per second)", burst)
        return None
    return TokenLimit(per_s, burst)


def _token_limits(
    c: Checker, m: dict[str, Any], path: str, known: set[str]
) -> tuple[TokenLimit | None, tuple[tuple[str, TokenLimit], ...]]:
    default = (
        parse_token_limit(c, m["token_limit"], f"{path}.token_limit")
        if "token_limit" in m
        else None
    )
    where = f"{path}.model_token_limits"
    given = c.mapping(m.get("model_token_limits", {}), where) or {}
    per_model = []
    for model, spec in given.items():
        if model not in known:
            c.fail(f"{where}.{model}", "must name a model of the topology", model)
            continue
        parsed = parse_token_limit(c, spec, f"{where}.{model}")
        if parsed is not None:
            per_model.append((model, parsed))
    return default, tuple(per_model)


def parse_tenants(c: Checker, value: object, models: set[str]) -> tuple[TenantPolicy, ...]:
    """The ``tenants`` section; absent: one ``other`` policy with every model and no limits."""
    if value is None:
        return (TenantPolicy(OTHER_TENANT),)
    tenants = c.mapping(value, "tenants") or {}
    policies = []
    for name, spec in tenants.items():
        path = f"tenants.{name}"
        if not TENANT_NAME.fullmatch(name):
            c.fail(path, "a tenant name must be letters, digits, '_' or '-' (at most 64)", name)
            continue
        m = c.mapping(spec if spec is not None else {}, path)
        if m is None:
            continue
        c.keys(m, path, _TENANT)
        token_limit, model_token_limits = _token_limits(c, m, path, models)
        policies.append(
            TenantPolicy(
                name,
                _models(c, m, path, models),
                parse_rate_limit(c, m, path),
                _model_limits(c, m, path, models),
                _flag(c, m, path, "may_set_priority"),
                _flag(c, m, path, "may_pick_version"),
                token_limit,
                model_token_limits,
            )
        )
    # `other` last: the named tenants' rules are read first.
    return tuple(sorted(policies, key=lambda p: p.name == OTHER_TENANT))
