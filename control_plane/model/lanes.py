"""Mixed fleets: endpoint labels, SLA classes and input-size lanes (pure; no Envoy types).

Labels (``device_class: a100``, ``precision: fp16``, ``zone: b``...) come from the topology
(an ``address`` endpoint's ``labels:``) and from what a server reports (its ``server_label``
gauge; our model server reports its NVML device class). The topology's win. A model's
``placement`` rule requires labels (a filter: the endpoint leaves the model's clusters) or
prefers them (a scorer).

A *lane* is a second cluster of a model's pool, with endpoints in two Envoy priorities:
priority 0 takes the traffic while enough of it is healthy, priority 1 is the spill-over.

* SLA classes (request header ``x-sla-class``): an endpoint labelled ``reserved_for: C``
  serves only class C of the models that declare C; ``model:M:sla:C`` holds C's reserved
  endpoints at priority 0 and the shared ones at priority 1 (the shared ones alone at 0 when
  none is reserved). Each class has its own timeout and retry policy. Every other cluster of
  the model (the default route, version routes) holds only shared endpoints.
* Large inputs (header ``x-input-bytes``, which a client sets, or ``content-length``):
  requests at or above ``min_bytes`` go to ``model:M:large``: the shared endpoints with the
  preferred labels at priority 0, the other shared ones at priority 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from control_plane.model.mesh import LargeInputs, SlaClass
from control_plane.model.schema import Checker, show
from control_plane.scoring.types import LabelRule, Labels
from infermesh.labels import LABEL_TEXT_RULE, is_label_text

SLA_CLASS_HEADER = "x-sla-class"
INPUT_BYTES_HEADER = "x-input-bytes"
RESERVED_FOR = "reserved_for"  # the label that reserves an endpoint for one SLA class
MAX_INT64 = 2**63 - 1


def sla_cluster(model: str, sla_class: str) -> str:
    return f"model:{model}:sla:{sla_class}"


def large_cluster(model: str) -> str:
    return f"model:{model}:large"


def matches(labels: Labels, rule: LabelRule) -> bool:
    """Every label of the rule present with one of its accepted values."""
    have = dict(labels)
    return all(have.get(name) in accepted for name, accepted in rule)


def merged_labels(topology: Labels, reported: Labels) -> Labels:
    """The server's reported labels with the topology's over them (an operator's word wins)."""
    if not topology or not reported:  # the usual case: one side only, already sorted
        return topology or reported
    return tuple(sorted({**dict(reported), **dict(topology)}.items()))


def fleet_labels(
    topology: Mapping[str, Labels], reported: Mapping[str, Labels]
) -> dict[str, Labels]:
    """Every endpoint's labels (key -> labels): the reported ones with the topology's over."""
    return {
        key: merged_labels(topology.get(key, ()), reported.get(key, ()))
        for key in topology.keys() | reported.keys()
    }


@dataclass(frozen=True)
class LaneMembers:
    """One model's endpoints split for its lanes: ``shared`` serve every route (the reserved
    ones serve only their class's lane); ``lanes``: cluster -> (endpoint, priority) pairs."""

    shared: frozenset[str]
    lanes: Mapping[str, tuple[tuple[str, int], ...]]


def lane_members(
    model: str,
    members: Iterable[str],
    labels: Mapping[str, Labels],
    sla_classes: Iterable[SlaClass],
    large: LargeInputs | None,
) -> LaneMembers:
    """Splits the endpoints (keys) where ``model`` is READY into its shared set and lanes."""
    classes = [c.name for c in sla_classes]
    reserved: dict[str, set[str]] = {c: set() for c in classes}
    shared: set[str] = set()
    for key in members:
        owner = dict(labels.get(key, ())).get(RESERVED_FOR)
        reserved.get(owner or "", shared).add(key)
    lanes: dict[str, tuple[tuple[str, int], ...]] = {}
    for name in classes:
        first = reserved[name] or shared
        lanes[sla_cluster(model, name)] = _prioritised(first, shared - first)
    if large is not None:
        preferred = {k for k in shared if matches(labels.get(k, ()), large.prefer)}
        lanes[large_cluster(model)] = _prioritised(preferred or shared, shared - preferred)
    return LaneMembers(frozenset(shared), lanes)


def _prioritised(first: set[str], then: set[str]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted([(k, 0) for k in first] + [(k, 1) for k in then - first]))


# --- the topology's schema for labels, placement rules and lanes ------------------------------


def parse_labels(c: Checker, value: object, path: str) -> Labels:
    """``{name: value}`` with label-like strings on both sides."""
    m = c.mapping(value, path) or {}
    labels = []
    for name, text in m.items():
        if not is_label_text(name):
            c.fail(f"{path}.{name}", f"label names must be {LABEL_TEXT_RULE}", name)
        elif not is_label_text(text):
            c.fail(f"{path}.{name}", f"must be a label value ({LABEL_TEXT_RULE})", text)
        else:
            labels.append((name, text))
    return tuple(sorted(labels))


def parse_label_rule(c: Checker, value: object, path: str) -> LabelRule:
    """``{name: value or [values]}``: the label must have one of the values."""
    m = c.mapping(value, path) or {}
    rule = []
    for name, accepted in m.items():
        values = accepted if isinstance(accepted, list) else [accepted]
        good = [v for v in values if is_label_text(v)]
        if not is_label_text(name):
            c.fail(f"{path}.{name}", f"label names must be {LABEL_TEXT_RULE}", name)
        elif not values or len(good) != len(values):
            c.fail(f"{path}.{name}", "must be a label value or a non-empty list of them", accepted)
        else:
            rule.append((name, tuple(sorted(set(good)))))
    return tuple(sorted(rule))


_SLA_CLASS = {"timeout_s": "positive", "max_retries": "count", "per_try_timeout_s": "positive"}


def parse_sla_classes(
    c: Checker, value: object, path: str, timeout_s: float
) -> tuple[SlaClass, ...]:
    """``{class: {timeout_s, max_retries, per_try_timeout_s}}``; defaults: the model's timeout
    and the listener's max_retries."""
    m = c.mapping(value, path) or {}
    classes = []
    for name, spec in m.items():
        where = f"{path}.{name}"
        if not is_label_text(name):
            c.fail(where, f"class names must be {LABEL_TEXT_RULE}", name)
            continue
        fields = c.mapping(spec, where) or {}
        c.keys(fields, where, _SLA_CLASS)
        timeout = c.value(fields, where, "timeout_s", "positive", timeout_s)
        per_try = c.value(fields, where, "per_try_timeout_s", "positive", None)
        if per_try is not None and per_try > timeout:
            c.errors.append(
                f"{where}.per_try_timeout_s: must be <= timeout_s ({timeout:g}), got {per_try:g}"
            )
        retries = c.value(fields, where, "max_retries", "count", None)
        classes.append(SlaClass(name, timeout, retries, per_try))
    return tuple(classes)


def parse_large_inputs(c: Checker, value: object, path: str) -> LargeInputs | None:
    m = c.mapping(value, path)
    if m is None:
        return None
    c.keys(m, path, ("min_bytes", "prefer"), required=("min_bytes", "prefer"))
    size: Any = m.get("min_bytes")
    if "min_bytes" in m and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        c.fail(f"{path}.min_bytes", "must be an integer >= 1", size)
    prefer = parse_label_rule(c, m.get("prefer", {}), f"{path}.prefer")
    if "prefer" in m and not prefer and not any(e.startswith(f"{path}.prefer") for e in c.errors):
        c.errors.append(f"{path}.prefer: at least one label, got {show(m['prefer'])}")
    good = isinstance(size, int) and not isinstance(size, bool) and size >= 1
    return LargeInputs(size, prefer) if good and prefer else None
