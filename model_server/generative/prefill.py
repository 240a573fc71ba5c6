"""Prefill of several new sequences in one run of the decoder.

Optimum's decoder graph has a batch dimension, an attention mask over past + new columns and
explicit position ids, so sequences with different prompt lengths and different cached
prefixes prefill together. Each row's layout, with ``P`` the longest cached prefix and ``S``
the longest uncached remainder in the group::

    columns  0 .. P-1                     P .. P+S-1
             [pad .. cached prefix]       [pad .. new tokens]

Past keys/values are left-padded to ``P`` (``KvCache.gather``), new tokens left-padded to
``S``; the mask is 1 on the real columns only, so a new token attends to its row's prefix and
to its row's earlier new tokens (the graph adds causality: query ``i`` sees columns
``<= P + i``), and the position ids continue each row's prefix. Every row's last column is
a real token, whose logits give the row's first generated token; its new keys/values are the
row's last columns of ``present``.

Padding costs compute, so ``prefill_groups`` batches rows of similar length: sorted by how many
tokens each computes, a group closes when padding would exceed a quarter of its work or its
padded size would pass ``max_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PAD_ID = 0  # any valid id: padded columns are masked and their outputs dropped
WASTE = 0.25  # padding allowed in a group, as a share of the tokens it computes
SLACK_TOKENS = 16  # padding always allowed (short remainders batch together)


def prefill_groups(
    lengths: Sequence[int], max_rows: int, max_tokens: int = 4096
) -> list[list[int]]:
    """Indices of ``lengths`` (tokens each row computes) in groups to prefill together."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        trial = [*current, i]
        padded = lengths[i] * len(trial)  # sorted: this row is the longest
        real = sum(lengths[j] for j in trial)
        too_wide = padded - real > WASTE * real + SLACK_TOKENS or padded > max_tokens
        if current and (len(trial) > max_rows or too_wide):
            groups.append(current)
            trial = [i]
        current = trial
    if current:
        groups.append(current)
    return groups


def prefill_inputs(
    rows: Sequence[Sequence[int]], cached: Sequence[int], past_length: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``input_ids``, ``attention_mask`` and ``position_ids`` for ``rows`` (the tokens each
    computes) after ``cached`` tokens each, past left-padded to ``past_length``."""
    longest = max(len(r) for r in rows)
    ids = np.full((len(rows), longest), PAD_ID, np.int64)
    mask = np.zeros((len(rows), past_length + longest), np.int64)
    positions = np.zeros((len(rows), longest), np.int64)
    for row, (tokens, done) in enumerate(zip(rows, cached, strict=True)):
        n = len(tokens)
        ids[row, longest - n :] = tokens
        mask[row, past_length - done : past_length] = 1
        mask[row, past_length + longest - n :] = 1
        positions[row, longest - n :] = np.arange(done, done + n)
    return ids, mask, positions
