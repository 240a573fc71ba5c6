"""The KV cache of a generative model, kept in fixed-size blocks under a budget.

A ``KvCache`` owns one preallocated pool per layer for keys and one for values, each shaped
``[total_blocks, heads, block_tokens, head_dim]``. A sequence holds a list of blocks that grows
as it does (``reserve``) and is returned whole when it finishes, is cancelled or its client goes
away (``release``); nothing else ever frees a block, so a running sequence's cache is never
touched by another. When the pool cannot cover a reservation the caller is told
(``KvCacheFull``) and decides: wait, or refuse the new sequence.

ONNX Runtime's decoder (Optimum's naming) takes past keys/values as dense tensors, so each step
``gather``s the running sequences' blocks into one left-padded batch
``[batch, heads, max_len, head_dim]`` per layer (left padding keeps every sequence's newest token
in the last column, where the step's new token goes) and ``append``s what the step produced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


class KvCacheFull(Exception):
    """Not enough free blocks for a reservation (nothing was allocated)."""


@dataclass(frozen=True)
class KvShape:
    layers: int
    heads: int
    head_dim: int
    block_tokens: int = 16
    total_blocks: int = 256

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.layers * self.heads * self.block_tokens * self.head_dim * 4


class KvCache:
    def __init__(self, shape: KvShape) -> None:
        self.shape = shape
        pool = (shape.total_blocks, shape.heads, shape.block_tokens, shape.head_dim)
        self.keys = [np.zeros(pool, np.float32) for _ in range(shape.layers)]
        self.values = [np.zeros(pool, np.float32) for _ in range(shape.layers)]
        self._free: list[int] = list(range(shape.total_blocks - 1, -1, -1))  # a stack
        self._blocks: dict[str, list[int]] = {}
        self._lengths: dict[str, int] = {}  # tokens written per sequence

    # -- accounting -----------------------------------------------------------------------
    @property
    def used_blocks(self) -> int:
        return self.shape.total_blocks - len(self._free)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.shape.block_tokens)

    def length(self, sequence: str) -> int:
        return self._lengths.get(sequence, 0)

    def sequences(self) -> list[str]:
        return list(self._blocks)

    def reserve(self, sequence: str, tokens: int) -> None:
        """Makes room for ``tokens`` tokens in all (a new sequence, or one that grows)."""
        held = self._blocks.setdefault(sequence, [])
        self._lengths.setdefault(sequence, 0)
        missing = self.blocks_for(tokens) - len(held)
        if missing > len(self._free):
            if not held:
                del self._blocks[sequence], self._lengths[sequence]
            raise KvCacheFull(
                f"{sequence}: needs {missing} more KV blocks, {len(self._free)} free of "
                f"{self.shape.total_blocks}"
            )
        for _ in range(max(0, missing)):
            held.append(self._free.pop())

    def release(self, sequence: str) -> int:
        """Returns every block of ``sequence`` to the pool; how many (0 if unknown)."""
        held = self._blocks.pop(sequence, [])
        self._lengths.pop(sequence, None)
        self._free.extend(reversed(held))
        return len(held)

    # -- data -----------------------------------------------------------------------------
    def append(self, sequence: str, keys: list[np.ndarray], values: list[np.ndarray]) -> None:
        """Writes new tokens' keys/values (per layer ``[heads, n, head_dim]``) after the
        sequence's last token; the blocks must have been reserved."""
        start = self._lengths[sequence]
        count = keys[0].shape[1]
        held, size = self._blocks[sequence], self.shape.block_tokens
        if self.blocks_for(start + count) > len(held):
            raise KvCacheFull(f"{sequence}: append of {count} tokens past its reservation")
        position = start
        while position < start + count:  # one block-sized span at a time
            block, offset = held[position // size], position % size
            n = min(size - offset, start + count - position)
            source = slice(position - start, position - start + n)
            for layer in range(self.shape.layers):
                self.keys[layer][block, :, offset : offset + n] = keys[layer][:, source]
                self.values[layer][block, :, offset : offset + n] = values[layer][:, source]
            position += n
        self._lengths[sequence] = start + count

    def gather(self, sequences: list[str]) -> tuple[list[np.ndarray], list[np.ndarray], int]:
        """Per layer, the sequences' cached keys and values as one left-padded batch
        ``[batch, heads, max_len, head_dim]``, and ``max_len``."""
        longest = max((self._lengths[s] for s in sequences), default=0)
        shape = (len(sequences), self.shape.heads, longest, self.shape.head_dim)
        keys = [np.zeros(shape, np.float32) for _ in range(self.shape.layers)]
        values = [np.zeros(shape, np.float32) for _ in range(self.shape.layers)]
        size = self.shape.block_tokens
        for row, sequence in enumerate(sequences):
            length, held = self._lengths[sequence], self._blocks[sequence]
            pad = longest - length
            for index, block in enumerate(held[: self.blocks_for(length)]):
                first = index * size
                n = min(size, length - first)
                for layer in range(self.shape.layers):
                    keys[layer][row, :, pad + first : pad + first + n] = self.keys[layer][
                        block, :, :n
                    ]
                    values[layer][row, :, pad + first : pad + first + n] = self.values[layer][
                        block, :, :n
                    ]
        return keys, values, longest
