"""Values shared by the scoring steps: what one endpoint of a model pool looks like, and policy."""

from __future__ import annotations

from dataclasses import dataclass, field

Labels = tuple[tuple[str, str], ...]  # (name, value) pairs sorted by name
LabelRule = tuple[tuple[str, tuple[str, ...]], ...]  # (name, accepted values) sorted by name
DEVICE_CLASS = "device_class"  # the label that names an endpoint's accelerator (a10g, cpu...)
# What ewma_alpha, max_step and a latency strike are per (the routing loop's tick): a
# recompute sooner than this moves scores, weights and strikes only by its share of it, so the
# pace of a pool does not depend on how often it happens to be recomputed.
RECOMPUTE_PERIOD_S = 0.5


@dataclass(frozen=True)
class EndpointSignals:
    """One endpoint of one model pool, as telemetry and placement see it.

    A signal is None when it is missing or stale: a scorer that needs it drops out for this
    endpoint (the others are renormalised); it is never read as zero.
    """

    endpoint: str  # "HOST:PORT", the EDS address
    ready: bool = True  # the model is READY there (placement)
    stale: bool = False  # telemetry stopped arriving
    draining: bool = False  # the server reports draining
    qps: float | None = None
    p99_ms: float | None = None
    error_rate: float | None = None  # 0..1
    abandoned_rate: float | None = None  # 0..1: cancelled by their callers (hedges that lost)
    memory_used_bytes: float | None = None
    memory_total_bytes: float | None = None
    kv_blocks_used: float | None = None
    kv_blocks_total: float | None = None
    queue_depth: float | None = None
    labels: Labels = ()  # the topology's labels over those the server reports

    def label(self, name: str) -> str | None:
        return next((v for k, v in self.labels if k == name), None)


@dataclass(frozen=True)
class ScoreWeights:
    """How much each scorer counts (the source article: 0.4 QPS, 0.4 P99, 0.2 memory)."""

    qps: float = 0.4
    latency: float = 0.4
    memory: float = 0.2
    kv_cache: float = 0.0  # generative pools set these
    queue: float = 0.0
    labels: float = 0.0  # the share of the pool's preferred labels an endpoint has


@dataclass(frozen=True)
class PoolPolicy:
    """A model pool's targets and tuning (from the topology, with these defaults)."""

    capacity_qps: float  # per endpoint
    sla_p99_ms: float
    score_weights: ScoreWeights = field(default_factory=ScoreWeights)
    # Above the SLA the combined score is multiplied by (SLA / p99) ** over_sla_exponent
    # (0 turns it off: the source article's plain weighted sum).
    over_sla_exponent: float = 2.0
    # Above this share of its KV blocks in use, the combined score is multiplied by the
    # headroom left as a share of the headroom at this share: falling linearly to 0 when full
    # (1 turns it off). A nearly full cache makes new sequences wait for blocks.
    kv_full_at: float = 0.8
    # Integer EDS weights: the best endpoint gets max_weight; nobody healthy gets 0.
    max_weight: int = 100
    ewma_alpha: float = 0.5  # smoothing of scores per RECOMPUTE_PERIOD_S (1: no smoothing)
    hysteresis: float = 0.1  # no push unless some weight moves by more than this share
    max_step: float = 0.5  # a weight moves by at most this share of max_weight per period
    # A pool at rest is recomputed only when a signal moves by more than this share of its
    # value (0: any change); see scoring.at_rest.
    recompute_tolerance: float = 0.05
    # Ejection
    memory_watermark: float = 0.95
    latency_eject_factor: float = 2.0  # p99 > factor x SLA ...
    latency_eject_windows: int = 3  # ... for this many strikes in a row, one a period at most
    latency_eject_vs_pool: float = 2.0  # ... and p99 > this x the others' median (0: off)
    error_rate_eject: float = 0.5
    max_ejected_share: float = 0.5
    backoff_base_s: float = 5.0  # first ejection lasts this long; each repeat doubles it
    backoff_max_s: float = 300.0
    slow_start_s: float = 10.0  # a returning or new endpoint ramps to its full weight
    # Device classes and labels (placement rules)
    require_labels: LabelRule = ()  # a filter: an endpoint without an accepted value is out
    prefer_labels: LabelRule = ()  # scored by the "labels" scorer
    capacity_by_class: tuple[tuple[str, float], ...] = ()  # device_class -> capacity_qps
    memory_need_bytes: float | None = None  # what the model needs free on a card to run

    def capacity_for(self, device_class: str | None) -> float:
        """Capacity per endpoint of this device class (``capacity_qps`` if not listed)."""
        return dict(self.capacity_by_class).get(device_class or "", self.capacity_qps)
