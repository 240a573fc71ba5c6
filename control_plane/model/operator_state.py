"""What operators (and canary runs) set over the topology: one object, written by the operator
API and the canary judge, read by every rebuild.

- per-endpoint overrides: a fixed EDS weight, a forced health;
- per-model version splits (an operator's, or the one a canary run is at).

It checks what it is given and raises ``InvalidChange`` naming the field and what was
expected; it knows nothing of HTTP (the admin maps the error to 400).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from control_plane.model.mesh import EndpointAddress, EndpointHealth
from control_plane.model.schema import UINT32_MAX

Split = tuple[tuple[str, int], ...]  # (version, weight), by version


# Envoy sums a locality's endpoint weights in a uint32: this many endpoints at the most each
# still fit (routing's own weights are at most 100).
MAX_OVERRIDE_WEIGHT = 1_000_000


class InvalidChange(ValueError):
    """A change refused for what it says (the message names the field)."""


@dataclass
class OperatorState:
    weights: dict[EndpointAddress, int] = field(default_factory=dict)
    health: dict[EndpointAddress, EndpointHealth] = field(default_factory=dict)
    splits: dict[str, Split] = field(default_factory=dict)

    def override(self, address: EndpointAddress, body: Mapping[str, Any]) -> None:
        """``weight`` (an integer in 1..MAX_OVERRIDE_WEIGHT, or null to clear) and/or ``health``
        (an EndpointHealth name, or null). All of it is checked before anything changes."""
        unknown = sorted(set(body) - {"weight", "health"})
        if unknown:
            raise InvalidChange(f"unknown fields {unknown}; expected weight and/or health")
        weight, health = body.get("weight"), body.get("health")
        valid_weight = (
            isinstance(weight, int)
            and not isinstance(weight, bool)
            and 1 <= weight <= MAX_OVERRIDE_WEIGHT
        )
        if "weight" in body and weight is not None and not valid_weight:
            raise InvalidChange(
                f"weight must be an integer in 1..{MAX_OVERRIDE_WEIGHT} or null, got {weight!r}"
            )
        if "health" in body and health is not None and health not in EndpointHealth.__members__:
            expected = sorted(EndpointHealth.__members__)
            raise InvalidChange(f"health must be one of {expected} or null, got {health!r}")
        if "weight" in body:
            if weight is None:
                self.weights.pop(address, None)
            else:
                self.weights[address] = int(weight)
        if "health" in body:
            if health is None:
                self.health.pop(address, None)
            else:
                self.health[address] = EndpointHealth(health)

    @staticmethod
    def parse_split(body: Mapping[str, Any]) -> Split:
        """A version split from ``{"VERSION": WEIGHT, ...}`` (empty: the topology's)."""
        errors = [
            f"version {v!r}: weight must be an integer >= 0, got {w!r}"
            for v, w in body.items()
            if not isinstance(w, int) or isinstance(w, bool) or w < 0
        ]
        errors += [f"version {v!r} is not a number" for v in body if not str(v).isdigit()]
        if body and not errors and sum(body.values()) == 0:
            errors.append("the weights must not all be 0")
        elif body and not errors and sum(body.values()) > UINT32_MAX:
            errors.append(f"the weights must sum to at most {UINT32_MAX} (Envoy's uint32)")
        if errors:
            raise InvalidChange("; ".join(errors))
        return tuple(
            sorted(((str(int(v)), int(w)) for v, w in body.items()), key=lambda p: int(p[0]))
        )

    def set_split(self, model: str, split: Split) -> None:
        """``split`` in place of the topology's for ``model``; empty: the topology's again."""
        if split:
            self.splits[model] = split
        else:
            self.splits.pop(model, None)
