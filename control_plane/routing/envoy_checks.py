"""What Envoy's own health checks find, carried into the clusters Envoy does not check (pure).

With ``listener.health_checks: model`` Envoy checks a server only in its model's own gRPC
cluster and SLA lanes (and their REST twins): one connection per server and model instead of
one per cluster. Its other clusters (versions, large inputs, ``servers``) would learn that a
server died only from failed requests (outlier detection) or the control plane's placement
probes, which at fleet scale come round slowly. Envoy reports each endpoint's health in each
cluster through its stat sink (``EnvoyStats.checked_down``); ``checked_down_by_model`` turns
that into the ``checked_down`` of ``placement.build_mesh_state``, and ``changes`` into the
decisions log, so every such move can be explained.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from control_plane.model.mesh import (
    EndpointAddress,
    EndpointAssignment,
    cluster_model,
    is_checked_in_model_scope,
)
from control_plane.telemetry.envoy import stat_name

CheckedDown = Mapping[str, frozenset[EndpointAddress]]  # model -> endpoints found down


def checked_down_by_model(
    found: Mapping[str, frozenset[str]],
    clusters: Mapping[str, Iterable[EndpointAssignment]],
) -> dict[str, frozenset[EndpointAddress]]:
    """``found`` (stat cluster name -> endpoint keys Envoy calls unhealthy there) read for the
    checked gRPC clusters among ``clusters`` (the mesh's, name -> members): per model, its
    members found down in any of them. Other clusters' stats (unchecked, or REST twins,
    whose checks ask another port) and endpoints no longer members are left out."""
    out: dict[str, set[EndpointAddress]] = {}
    for name, members in clusters.items():
        model = cluster_model(name)
        keys = found.get(stat_name(name))
        if model is None or not keys or not is_checked_in_model_scope(name):
            continue
        down = {a.address for a in members if a.address.key in keys}
        if down:
            out.setdefault(model, set()).update(down)
    return {model: frozenset(down) for model, down in sorted(out.items())}


def changes(before: CheckedDown, after: CheckedDown) -> list[tuple[str, str]]:
    """(model, words) for each model whose endpoints found down changed."""
    out = []
    for model in sorted(before.keys() | after.keys()):
        old, new = before.get(model, frozenset()), after.get(model, frozenset())
        went, came = sorted(a.key for a in new - old), sorted(a.key for a in old - new)
        words = []
        if went:
            words.append(f"{', '.join(went)} down: leaves the model's unchecked clusters")
        if came:
            words.append(f"{', '.join(came)} passes again: back in them")
        if words:
            out.append((model, "Envoy's health checks: " + "; ".join(words)))
    return out
