"""Choosing the next token from a step's logits: greedy, temperature, top_k and top_p.

The engine calls ``sample`` once per running sequence per step, with that sequence's own
generator (seeded by the request's ``seed``, or fresh entropy without one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from model_server.generative.engine import GenerationRequest


def ignored_at_greedy(temperature: float, top_p: float, top_k: int) -> str | None:
    """The parameter (``top_p`` or ``top_k``) a request narrows although greedy decoding
    (temperature 0) would ignore it; None when there is none. Such a request is refused, not
    silently served greedy (the engine's check, and the OpenAI API's with its ``param``)."""
    if temperature != 0:
        return None
    if top_p < 1:
        return "top_p"
    return "top_k" if top_k > 0 else None


def sample(logits: np.ndarray, request: GenerationRequest, rng: np.random.Generator) -> int:
    """Greedy at temperature 0; else softmax(logits / temperature) over the top_k tokens, then
    over the smallest set of the most likely ones whose probability reaches top_p."""
    if request.temperature == 0:
        return int(np.argmax(logits))
    wide = logits.astype(np.float64)
    # Shifted first, so the largest logit scales to 0 and the others to at most 0: a tiny
    # temperature (1e-320) sends them to -inf (probability 0), never to inf - inf = NaN.
    with np.errstate(over="ignore"):
        scaled = (wide - wide.max()) / request.temperature
    if 0 < request.top_k < scaled.size:
        # Exactly k: of the logits equal to the k-th, the lowest token ids (ties are common in
        # fp16 or quantized logits; ">= cutoff" kept them all, so top_k=1 was not greedy).
        cutoff = np.partition(scaled, -request.top_k)[-request.top_k]
        above = np.flatnonzero(scaled > cutoff)
        tied = np.flatnonzero(scaled == cutoff)[: request.top_k - above.size]
        kept = np.full_like(scaled, -np.inf)
        kept[above], kept[tied] = scaled[above], scaled[tied]
        scaled = kept
    probabilities = np.exp(scaled - scaled.max())
    probabilities /= probabilities.sum()
    if request.top_p < 1:
        order = np.argsort(-probabilities, kind="stable")
        mass = np.cumsum(probabilities[order])
        keep = order[: int(np.searchsorted(mass, request.top_p)) + 1]
        nucleus = np.zeros_like(probabilities)
        nucleus[keep] = probabilities[keep]
        probabilities = nucleus / nucleus.sum()
    return int(rng.choice(scaled.size, p=probabilities))
