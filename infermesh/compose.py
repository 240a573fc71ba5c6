"""Reads compose.yaml into the services the native launcher runs.

Only what the launcher needs from the Compose specification: entrypoint + command,
environment, depends_on (with conditions), healthcheck (CMD / CMD-SHELL, interval, timeout,
retries, start_period), restart (no, always, on-failure, unless-stopped), stop_signal and
stop_grace_period, with ``${VAR}`` /
``${VAR:-default}`` interpolation and YAML merge keys. Services with ``profiles`` are optional
and container-only: the launcher skips them. Containers get the same file from a real
Compose implementation.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(h|ms|us|m|s)")
_DURATION_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 0.000001}


class ComposeError(ValueError):
    pass


@dataclass(frozen=True)
class Healthcheck:
    test: tuple[str, ...]  # argv (CMD) or ("sh", "-c", ...) (CMD-SHELL)
    interval_s: float = 30.0
    timeout_s: float = 30.0
    retries: int = 3
    start_period_s: float = 0.0

    @property
    def deadline_s(self) -> float:
        return self.start_period_s + self.retries * (self.interval_s + self.timeout_s)


@dataclass(frozen=True)
class Service:
    name: str
    command: tuple[str, ...]
    environment: Mapping[str, str] = field(default_factory=dict)
    depends_on: Mapping[str, str] = field(default_factory=dict)  # name -> condition
    healthcheck: Healthcheck | None = None
    stop_signal: int = signal.SIGTERM
    stop_grace_s: float = 10.0
    restart: str = "no"  # no, always, on-failure, unless-stopped

    def restarts_after(self, exit_code: int) -> bool:
        """Whether the launcher starts the service again after it exited with ``exit_code``."""
        if self.restart in ("always", "unless-stopped"):
            return True
        return self.restart == "on-failure" and exit_code != 0


RESTART_POLICIES = ("no", "always", "on-failure", "unless-stopped")


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    if isinstance(value, str):
        return _VARIABLE.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def parse_duration(text: str | int | float, where: str) -> float:
    """Compose (Go) durations: 1s, 500ms, 1m30s, 1h; a bare number is seconds."""
    if isinstance(text, int | float):
        return float(text)
    compact = text.strip()
    parts = _DURATION_PART.findall(compact)
    if not compact or "".join(n + u for n, u in parts) != compact:
        raise ComposeError(f"{where}: {text!r} is not a duration like 1s, 500ms or 1m30s")
    return sum(float(n) * _DURATION_UNITS[u] for n, u in parts)


def _healthcheck(raw: Mapping[str, Any], where: str) -> Healthcheck:
    test = raw.get("test")
    if isinstance(test, list) and test and test[0] == "CMD":
        argv = tuple(str(t) for t in test[1:])
    elif isinstance(test, list) and test and test[0] == "CMD-SHELL":
        argv = ("sh", "-c", " ".join(str(t) for t in test[1:]))
    elif isinstance(test, str):
        argv = ("sh", "-c", test)
    else:
        raise ComposeError(f"{where}.healthcheck.test: expected [CMD, ...] or [CMD-SHELL, ...]")
    return Healthcheck(
        test=argv,
        interval_s=parse_duration(raw.get("interval", "30s"), f"{where}.healthcheck.interval"),
        timeout_s=parse_duration(raw.get("timeout", "30s"), f"{where}.healthcheck.timeout"),
        retries=int(raw.get("retries", 3)),
        start_period_s=parse_duration(raw.get("start_period", 0), f"{where}.start_period"),
    )


def load_services(path: Path, env: Mapping[str, str] | None = None) -> list[Service]:
    """Services of a compose file in dependency order (dependencies first)."""
    data = yaml.safe_load(path.read_text()) or {}
    data = interpolate(data, dict(os.environ) if env is None else env)
    services: dict[str, Service] = {}
    for name, raw in (data.get("services") or {}).items():
        where = f"services.{name}"
        if raw.get("profiles"):
            continue  # optional services (containers only, e.g. Grafana): not run natively
        entrypoint = raw.get("entrypoint") or []
        command = [*entrypoint, *(raw.get("command") or [])]
        if not isinstance(entrypoint, list) or not command:
            raise ComposeError(f"{where}.command: the launcher needs a command list")
        environment = raw.get("environment") or {}
        if isinstance(environment, list):
            environment = dict(item.split("=", 1) for item in environment)
        depends = raw.get("depends_on") or {}
        if isinstance(depends, list):
            depends = {d: {"condition": "service_started"} for d in depends}
        services[name] = Service(
            name=name,
            command=tuple(str(c) for c in command),
            environment={str(k): str(v) for k, v in environment.items()},
            depends_on={
                d: (c or {}).get("condition", "service_started") for d, c in depends.items()
            },
            healthcheck=_healthcheck(raw["healthcheck"], where) if "healthcheck" in raw else None,
            stop_signal=int(getattr(signal, str(raw.get("stop_signal", "SIGTERM")))),
            stop_grace_s=parse_duration(raw.get("stop_grace_period", "10s"), f"{where}.stop"),
            restart=_restart(raw.get("restart", "no"), where),
        )
    return _ordered(services)


def _restart(value: object, where: str) -> str:
    text = str(value)
    if text not in RESTART_POLICIES:
        raise ComposeError(f"{where}.restart: expected one of {RESTART_POLICIES}, got {text!r}")
    return text


def _ordered(services: Mapping[str, Service]) -> list[Service]:
    ordered: list[Service] = []
    state: dict[str, str] = {}

    def visit(name: str, chain: tuple[str, ...]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise ComposeError(f"dependency cycle: {' -> '.join((*chain, name))}")
        if name not in services:
            raise ComposeError(f"{chain[-1]} depends on unknown service {name!r}")
        state[name] = "visiting"
        for dependency in services[name].depends_on:
            visit(dependency, (*chain, name))
        state[name] = "done"
        ordered.append(services[name])

    for name in services:
        visit(name, ())
    return ordered
