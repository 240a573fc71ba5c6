"""Triton's Prometheus metrics text, written by hand as Triton 2.51 writes it."""

from __future__ import annotations

Sample = tuple[dict[str, str], float | str]  # str: "NaN" and the like


def requests(
    success: float,
    duration_us: float,
    failure: float = 0.0,
    model: str = "m",
    version: str = "1",
) -> str:
    """The per-request counters of one model version, as Triton 2.51 writes them."""
    mv = {"model": model, "version": version}
    return (
        family("nv_inference_request_success", "counter", (mv, success))
        + family(
            "nv_inference_request_failure",
            "counter",
            ({**mv, "reason": "BACKEND"}, failure / 2),
            ({**mv, "reason": "REJECTED"}, failure / 2),
        )
        + family("nv_inference_request_duration_us", "counter", (mv, duration_us))
    )


def family(name: str, kind: str, *samples: Sample) -> str:
    lines = [f"# HELP {name} test", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        text = ",".join(f'{k}="{v}"' for k, v in labels.items())
        lines.append(f"{name}{{{text}}} {value}" if text else f"{name} {value}")
    return "\n".join(lines) + "\n"
