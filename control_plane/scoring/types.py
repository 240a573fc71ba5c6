"""Values shared by the scoring steps: what one endpoint of a model pool looks like, and policy."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    memory_used_bytes: float | None = None
    memory_total_bytes: float | None = None
    kv_blocks_used: float | None = None
    kv_blocks_total: float | None = None
    queue_depth: float | None = None


@dataclass(frozen=True)
class ScoreWeights:
    """How much each scorer counts (the source article: 0.4 QPS, 0.4 P99, 0.2 memory)."""

    qps: float = 0.4
    latency: float = 0.4
    memory: float = 0.2
    kv_cache: float = 0.0  # generative pools set these
    queue: float = 0.0


@dataclass(frozen=True)
class PoolPolicy:
    """A model pool's targets and tuning (from the topology, with these defaults)."""

    capacity_qps: float  # per endpoint
    sla_p99_ms: float
    score_weights: ScoreWeights = field(default_factory=ScoreWeights)
    # Above the SLA the combined score is multiplied by (SLA / p99) ** over_sla_exponent
    # (0 turns it off: the source article's plain weighted sum).
    over_sla_exponent: float = 2.0
    # Integer EDS weights: the best endpoint gets max_weight; nobody healthy gets 0.
    max_weight: int = 100
    ewma_alpha: float = 0.5  # smoothing of scores between recomputes (1: no smoothing)
    hysteresis: float = 0.1  # no push unless some weight moves by more than this share
    max_step: float = 0.5  # one recompute moves a weight by at most this share of max_weight
    # Ejection
    memory_watermark: float = 0.95
    latency_eject_factor: float = 2.0  # p99 > factor x SLA ...
    latency_eject_windows: int = 3  # ... for this many consecutive recomputes
    latency_eject_vs_pool: float = 2.0  # ... and p99 > this x the others' median (0: off)
    error_rate_eject: float = 0.5
    max_ejected_share: float = 0.5
    backoff_base_s: float = 5.0  # first ejection lasts this long; each repeat doubles it
    backoff_max_s: float = 300.0
    slow_start_s: float = 10.0  # a returning or new endpoint ramps to its full weight
