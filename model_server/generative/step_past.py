"""The past a decode step feeds the model: carried over from the step before, or gathered.

When a step runs the same sequences as the step before (none joined, finished, left or was
preempted) and each grew by that step's token alone, ONNX Runtime's ``present`` outputs of
that step are exactly what ``KvCache.gather`` would copy out of the pool: their past columns
are a copy of the step's input, and the new column is what the step appended. So the step
reuses them and copies nothing. Under bench_affinity's load the gather cost 0.7-0.9 ms a step
(4-6 sequences of about 410 tokens), most of it memory traffic rather than indexing
(bench/README.md, "Reusing the last step's outputs").

What it costs: the last step's ``present`` tensors stay referenced until the next step, as
large as one gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from model_server.generative.kv_cache import KvCache


@dataclass(frozen=True)
class StepPast:
    """One decode step's past keys and values per layer, left-padded, and its attention mask
    (one column more than the past: the step's new token)."""

    keys: list[np.ndarray]
    values: list[np.ndarray]
    mask: np.ndarray
    carried: bool = False  # the step before's outputs, not a gather


@dataclass(frozen=True)
class _Carry:
    names: tuple[str, ...]
    lengths: np.ndarray  # each sequence's cached tokens after the step
    past: StepPast  # the step's outputs as the next step's past, but for the mask's new column


class PastKeeper:
    """Hands each decode step its past: the last step's outputs when they fit, else a gather."""

    def __init__(self, cache: KvCache) -> None:
        self.cache = cache
        self._carry: _Carry | None = None

    def forget(self) -> None:
        """The next step gathers (a prefill or preemption changed what is running)."""
        self._carry = None

    def past(self, names: tuple[str, ...], lengths: np.ndarray) -> StepPast:
        """``names``' past with ``lengths`` tokens cached each. Forgets the carry: a step that
        fails or leaves a sequence behind must not hand its outputs on."""
        carry, self._carry = self._carry, None
        if carry is not None and carry.names == names and np.array_equal(carry.lengths, lengths):
            ones = np.ones((len(names), 1), np.int64)
            kept = carry.past
            mask = np.concatenate([kept.mask, ones], axis=1)
            return StepPast(kept.keys, kept.values, mask, carried=True)
        keys, values, longest = self.cache.gather(list(names))
        mask = np.zeros((len(names), longest + 1), np.int64)
        for row, length in enumerate(lengths):
            mask[row, longest - length :] = 1  # left padding is hidden
        return StepPast(keys, values, mask)

    def keep(
        self,
        names: tuple[str, ...],
        lengths: np.ndarray,
        step: StepPast,
        present: tuple[list[np.ndarray], list[np.ndarray]],
    ) -> None:
        """After a step over ``names`` (``lengths`` before it) whose every sequence appended its
        token: its ``present`` outputs are the next step's past if nothing else changes."""
        self._carry = _Carry(names, lengths + 1, StepPast(*present, step.mask))
