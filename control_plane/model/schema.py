"""Reading plain YAML data with every error collected: the topology's schema machinery.

``UniqueKeyLoader`` is a safe YAML loader that records duplicate keys instead of keeping the
last one; ``Checker`` reads typed values ("positive", "port", "ip", ...) out of mappings and
records each problem with its path (``models[1].sla_p99_ms: must be > 0, got -5``).
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
from collections.abc import Hashable, Iterable
from typing import Any

import yaml

from control_plane.model.mesh import HEALTH_CHECK_SCOPES, LB_POLICIES
from infermesh.addresses import is_ip


class UniqueKeyLoader(yaml.SafeLoader):
    """A safe loader that records duplicate mapping keys instead of keeping the last one."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.duplicate_keys: list[str] = []

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        first_line: dict[object, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, Hashable):
                continue
            if key in first_line:
                self.duplicate_keys.append(
                    f"line {line}: duplicate key {show(key)} (first at line {first_line[key]})"
                )
            first_line.setdefault(key, line)
        return super().construct_mapping(node, deep=deep)


_MODEL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOST_NAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*\.?")
_VERSION = re.compile(r"0|[1-9][0-9]*")


def show(value: object) -> str:
    try:
        text = json.dumps(value, default=str)
    except (TypeError, ValueError):  # keys JSON cannot show (dates), or a recursive value
        text = repr(value)
    return text if len(text) <= 60 else text[:56] + " ..."


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


_STR = "a string"
_NUM = "a number"
UINT32_MAX = (1 << 32) - 1  # Envoy's counts, weights and token buckets are uint32
MAX_DURATION_S = 315_576_000_000  # protobuf's Duration holds at most 10,000 years
# A number whose key ends so is one Envoy holds in a narrower field than a float: refused past
# it (before, such a topology was accepted, then every snapshot build failed on it). The
# first suffix that matches applies ("requests_per_s" is a rate, not seconds).
_CAPS = (
    ("_per_s", UINT32_MAX, "a rate Envoy can hold"),
    ("_ms", MAX_DURATION_S * 1000, "a duration Envoy can hold"),
    ("_s", MAX_DURATION_S, "a duration Envoy can hold"),
)
# kind -> (rule on a value of the right type, the type it needs first, what it must be)
_RULES: dict[str, tuple[Any, str, str]] = {
    "positive": (lambda v: v > 0, _NUM, "> 0"),
    "nonnegative": (lambda v: v >= 0, _NUM, ">= 0"),
    "fraction": (lambda v: 0 <= v <= 1, _NUM, "in 0..1"),
    "percent": (lambda v: 0 <= v <= 100, _NUM, "in 0..100"),
    "count": (
        lambda v: isinstance(v, int) and 0 <= v <= UINT32_MAX,
        _NUM,
        f"an integer in 0..{UINT32_MAX}",
    ),
    "port": (lambda v: isinstance(v, int) and 1 <= v <= 65535, _NUM, "a port in 1..65535"),
    "nice": (lambda v: isinstance(v, int) and 0 <= v <= 19, _NUM, "an integer in 0..19"),
    "bool": (lambda v: isinstance(v, bool), "", "true or false"),
    "ip": (is_ip, "", "an IP address"),
    "host": (lambda v: is_ip(v) or _HOST_NAME.fullmatch(v), _STR, "a host name or IP"),
    "name": (_MODEL_NAME.fullmatch, _STR, "a model name (letters, digits, '_', '.', '-')"),
    "lb_policy": (lambda v: v in LB_POLICIES, _STR, f"one of {', '.join(LB_POLICIES)}"),
    "health_checks": (
        lambda v: v in HEALTH_CHECK_SCOPES,
        _STR,
        f"one of {', '.join(HEALTH_CHECK_SCOPES)}",
    ),
    "path": (lambda v: v == "" or v.startswith("/"), _STR, 'an absolute path (or "")'),
    # A nested section, returned as it is for its own parser (e.g. listener.rest).
    "mapping": (lambda v: isinstance(v, dict), "", "a mapping"),
    "list": (lambda v: isinstance(v, list), "", "a list"),
}


_FLOAT_KINDS = ("positive", "percent", "nonnegative", "fraction")


class Checker:
    """Reads values from plain YAML data, recording every error with its path."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors

    def fail(self, path: str, message: str, value: object) -> None:
        self.errors.append(f"{path or 'topology'}: {message}, got {show(value)}")

    def mapping(self, value: object, path: str) -> dict[str, Any] | None:
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return value
        self.fail(path, "must be a mapping with string keys", value)
        return None

    def sequence(self, value: object, path: str) -> list[Any] | None:
        if isinstance(value, list):
            return value
        self.fail(path, "must be a list", value)
        return None

    def keys(
        self, m: dict[str, Any], path: str, allowed: Iterable[str], required: Iterable[str] = ()
    ) -> None:
        prefix = f"{path}." if path else ""
        allowed = tuple(allowed)
        for key in m:
            if key not in allowed:
                expected = ", ".join(allowed)
                self.errors.append(f"{prefix}{key}: unknown key (expected one of: {expected})")
        self.errors.extend(f"{prefix}{key}: required" for key in required if key not in m)

    def section(
        self, root: dict[str, Any], key: str, kinds: dict[str, str], default: Any, within: str = ""
    ) -> Any:
        """The keyword arguments of one section's dataclass, defaults filled in; ``within`` is
        the path of ``root`` for error messages ("models[0]")."""
        path = f"{within}.{key}" if within else key
        m = self.mapping(root.get(key, {}), path) or {}
        self.keys(m, path, kinds)
        return {k: self.value(m, path, k, kind, getattr(default, k)) for k, kind in kinds.items()}

    def value(self, m: dict[str, Any], path: str, key: str, kind: str, default: Any) -> Any:
        if key not in m:
            return default
        value, where = m[key], f"{path}.{key}" if path else key
        if kind == "split":
            return self.version_split(value, where)
        rule, needs, what = _RULES[kind]
        typed = _is_number(value) if needs == _NUM else needs != _STR or isinstance(value, str)
        if typed and rule(value):
            if kind not in _FLOAT_KINDS:
                return value
            cap = next(((most, why) for end, most, why in _CAPS if key.endswith(end)), None)
            if cap is None or value <= cap[0]:
                return float(value)
            self.fail(where, f"must be at most {cap[0]} ({cap[1]})", value)
            return default
        self.fail(where, f"must be {what if typed else needs}", value)
        return default

    def version_split(self, value: object, path: str) -> tuple[tuple[str, int], ...]:
        m = value if isinstance(value, dict) else None
        if not m:
            self.fail(path, "must be a non-empty mapping of version to weight", value)
            return ()
        weights: dict[str, int] = {}
        for version, weight in m.items():
            is_int = isinstance(version, int) and not isinstance(version, bool)
            v = str(version) if is_int else version
            if not isinstance(v, str) or not _VERSION.fullmatch(v):
                self.fail(path, 'versions must be numbers like "1"', version)
            elif v in weights:
                self.fail(path, "duplicate version", version)
            elif not isinstance(weight, int) or isinstance(weight, bool) or weight < 0:
                self.fail(f"{path}.{v}", "must be an integer weight >= 0", weight)
            else:
                weights[v] = weight
        total = sum(weights.values())
        if len(weights) == len(m) and total <= 0:
            self.fail(path, "weights must sum to > 0", total)
        elif total > UINT32_MAX:  # Envoy's weighted clusters sum them in a uint32
            self.fail(path, f"weights must sum to at most {UINT32_MAX}", total)
        return tuple(sorted(weights.items(), key=lambda item: int(item[0])))

    def host_port(self, value: object, path: str, ip_only: bool) -> tuple[str, int] | None:
        text = value if isinstance(value, str) else ""
        host, _, port = text.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1] if ":" in host else "-"  # brackets only around IPv6
        elif ":" in host:
            self.fail(path, "must be host:port with IPv6 in brackets ([::1]:8001)", value)
            return None
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            self.fail(path, "must be host:port with a port in 1..65535", value)
        elif is_ip(host):
            return str(ipaddress.ip_address(host)), int(port)
        elif ip_only:
            self.fail(path, "must be an IP address and port (use 'dns:' for names)", value)
        elif _HOST_NAME.fullmatch(host):
            return host.lower().rstrip("."), int(port)
        else:
            self.fail(path, "must be a DNS name and port", value)
        return None
