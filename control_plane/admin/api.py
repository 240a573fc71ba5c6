"""What the admin HTTP does for an operator: status, overrides, splits and canaries.

``OperatorApi`` reads and changes the control plane's state on its event loop (the admin HTTP
thread hands every request over), through the narrow ``OperatedPlane`` interface, and every
change goes through its ``rebuild``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from http import HTTPStatus
from typing import Any

from control_plane.admin.affinity_view import affinity_status
from control_plane.admin.http import AdminError
from control_plane.admin.live_view import build_frame
from control_plane.admin.plane import OperatedPlane
from control_plane.config.tenants import security_warnings
from control_plane.model.mesh import EndpointAddress
from control_plane.model.operator_state import InvalidChange, OperatorState
from control_plane.routing.canary_runs import CanaryRejected, Refusal
from control_plane.telemetry import identity as otlp_identity
from control_plane.xds import edge_tls, upstream_tls

REFUSAL_STATUS = {
    Refusal.INVALID: HTTPStatus.BAD_REQUEST,
    Refusal.UNKNOWN: HTTPStatus.NOT_FOUND,
    Refusal.CONFLICT: HTTPStatus.CONFLICT,
}


class OperatorApi:
    def __init__(self, plane: OperatedPlane) -> None:
        self.plane = plane

    async def override(self, key: str, body: dict[str, Any]) -> dict[str, Any]:
        host, _, port = key.rpartition(":")
        # ASCII digits, no leading zero: "08001" or "\u00b2" would name no endpoint's key
        if not host or not re.fullmatch(r"[1-9][0-9]{0,4}", port) or int(port) > 65535:
            raise AdminError(
                HTTPStatus.BAD_REQUEST, f"endpoint {key!r}: expected HOST:PORT, a port 1-65535"
            )
        address = EndpointAddress(host, int(port))
        if address not in self.plane.endpoints:
            raise AdminError(HTTPStatus.NOT_FOUND, f"endpoint {key} is not in the topology")
        try:
            self.plane.operator.override(address, body)
        except InvalidChange as exc:
            raise AdminError(HTTPStatus.BAD_REQUEST, str(exc)) from None
        changed = self.plane.rebuild(f"operator override of {address.key}")
        found = (await self.status())["endpoints"][address.key]
        return {"endpoint": address.key, "changed": changed, **found}

    async def healthy(self) -> bool:
        """What /healthz asks: is there a snapshot to serve? Open to anyone, so it reads one
        reference and never builds the status."""
        return self.plane.cache.snapshot_for("*") is not None

    async def telemetry_json(self, ages: bool = True) -> dict[str, Any]:
        # The store locks while it computes windows: keep that off the event loop.
        now = time.monotonic()
        body = await asyncio.to_thread(self.plane.telemetry.as_json, now, ages)
        scrapes = {k: dataclasses.asdict(v) for k, v in self.plane.scraper.stats().items()}
        return {**body, "envoy": self.plane.envoy_stats.as_json(now), "scrapes": scrapes}

    async def set_split(self, model: str, body: dict[str, Any]) -> dict[str, Any]:
        if model not in {m.name for m in self.plane.topology.models}:
            raise AdminError(HTTPStatus.NOT_FOUND, f"model {model!r} is not in the topology")
        try:
            split = OperatorState.parse_split(body)
        except InvalidChange as exc:
            raise AdminError(HTTPStatus.BAD_REQUEST, str(exc)) from None
        wall = time.time()
        self.plane.canaries.abort(model, "an operator set the version split", wall)
        self.plane.operator.set_split(model, split)
        described = " ".join(f"v{v}={w}" for v, w in split) or "the topology's"
        self.plane.router.log(model, f"version split {described}", time.time())
        changed = self.plane.rebuild(f"version split of {model} set by an operator")
        return {"model": model, "version_split": dict(split), "changed": changed}

    async def canary_request(self, model: str, body: dict[str, Any]) -> dict[str, Any]:
        now, wall = time.monotonic(), time.time()
        ready = {
            v for r in self.plane.poller.reports.values() if r.reachable for m, v in r.ready_models
            if m == model
        }  # fmt: skip
        route = next((m for m in self.plane.effective_topology().models if m.name == model), None)
        split = route.version_split if route else ()
        try:
            run = self.plane.canaries.request(
                self.plane.topology, model, body, split, ready, now, wall
            )
        except CanaryRejected as exc:
            raise AdminError(REFUSAL_STATUS[exc.refusal], str(exc)) from None
        self.plane.operator.set_split(model, run.split())
        self.plane.rebuild(f"canary of {model}: {run.reason}")
        return run.as_json(now)

    async def canaries_json(self) -> dict[str, Any]:
        return {"canaries": self.plane.canaries.as_json(time.monotonic())}

    async def decisions(self) -> dict[str, Any]:
        return {"decisions": list(self.plane.router.decisions)}

    async def live_frame(self) -> dict[str, Any]:
        """One frame of the live view: status, telemetry and decisions together. The view
        shows no ages: its telemetry is read as routing reads it (``ages=False``), which at
        10,000 endpoints saves 0.4 s a frame."""
        status = {**(await self.status()), **(await self.decisions())}
        return build_frame(status, await self.telemetry_json(ages=False), time.time())

    async def status(self) -> dict[str, Any]:
        readings = await asyncio.to_thread(self.plane.telemetry.snapshot, time.monotonic(), False)
        snapshot = self.plane.cache.snapshot_for("*")
        state = self.plane.mesh_state
        clusters = {
            name: [{"endpoint": a.address.key, "weight": a.weight, "health": a.health.value}
                   for a in assignments]
            for name, assignments in (state.clusters.items() if state else [])
        }  # fmt: skip
        endpoints = {}
        labels = self.plane.endpoint_labels()
        held = self.plane.held_endpoints
        for address in self.plane.endpoints:
            report = self.plane.poller.reports.get(address)
            endpoints[address.key] = {
                "reachable": bool(report and report.reachable),
                # unreachable from here, Envoy's checks pass: on its last placement
                "held_on_envoys_word": address in held,
                "server_ready": bool(report and report.server_ready),
                "ready_models": sorted(
                    f"{m}:{v}" for m, v in (report.ready_models if report else ())
                ),
                "error": report.error if report else "not polled yet",
                "weight_override": self.plane.operator.weights.get(address),
                "health_override": self.plane.operator.health[address].value
                if address in self.plane.operator.health
                else None,
                "labels": dict(labels.get(address.key, ())),
            }
        return {
            "topology": {
                "path": str(self.plane.settings.topology),
                "error": self.plane.topology_error,
            },
            "snapshot": snapshot.versions() if snapshot else None,
            "last_rebuild": self.plane.last_rebuild,
            "endpoints": endpoints,
            "clusters": clusters,
            "routing": self.plane.router.explain(),
            "canaries": self.plane.canaries.as_json(time.monotonic()),
            "circuits": self.plane.fallbacks.as_json(time.monotonic()),
            # listener.health_checks: model: endpoints Envoy's checks find down, per model
            "envoy_checked_down": {
                model: sorted(a.key for a in down)
                for model, down in self.plane.checked_down.items()
            },
            # each model's affinity and its pool's prefix-cache hit rates
            "affinity": affinity_status(state, readings),
            "version_splits": {
                m.name: dict(m.version_split) for m in self.plane.effective_topology().models
            },
            "nodes": self.plane.nodes.as_json(),
            "upstream_tls": upstream_tls.status(self.plane.upstream_tls()),
            "edge_tls": edge_tls.status(self.plane.topology.listener.tls),
            "warnings": security_warnings(self.plane.topology.listener)
            + otlp_identity.plaintext_warnings(self.plane.topology.telemetry)
            + upstream_tls.warnings(self.plane.upstream_tls())
            + edge_tls.warnings(self.plane.topology.listener.tls)
            + [
                f"endpoint {a.key}: unreachable from this control plane (placement probes and "
                "telemetry); Envoy's health checks pass, so it serves on its last placement"
                for a in sorted(held, key=lambda a: a.key)
            ],
        }
