"""Numpy reference of the demo decoder-only language model (GPT-style, byte-level vocabulary).

The same network is built as an ONNX graph by ``model_server.demo_lm``; tests check that both
agree, and that cached incremental decoding equals full recomputation.

Vocabulary (``VOCAB_SIZE`` = 260): ids 0-255 are the raw UTF-8 bytes, then ``BOS_ID`` = 256,
``EOS_ID`` = 257, ``PAD_ID`` = 258 and ``UNK_ID`` = 259 (reserved, never produced by
``encode``). ``decode`` drops the special ids and decodes the bytes with errors="replace".

Network: token embedding (``wte``) + learned absolute position embedding (``wpe``, indexed by
``position_ids``); ``layers`` blocks of pre-LayerNorm multi-head causal self-attention and a
pre-LayerNorm MLP (width -> 4 * width -> width, tanh-approximated GELU), each added to the
residual stream; a final LayerNorm; the LM head is tied to ``wte`` (logits = x @ wte.T).

Shapes follow the Hugging Face Optimum decoder export (B batch, S new tokens, P cached
tokens, H heads, Dh = width / heads):

- ``input_ids`` int64 [B, S]; ``position_ids`` int64 [B, S]
- ``attention_mask`` int64 [B, P + S]: 1 = attend, 0 = padding (left padding works)
- ``past``: per layer a (key, value) pair, float32 [B, H, P, Dh] (P may be 0)
- returns ``logits`` float32 [B, S, vocab] and ``present``: per layer past concatenated
  with this step's keys/values, float32 [B, H, P + S, Dh]

Query i (absolute index P + i) attends to key j when j <= P + i and attention_mask[b, j] == 1.
Masked scores get ``MASK_VALUE`` added, so a fully masked row (a padding query) stays finite.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
KV = tuple[F32, F32]

BYTE_VOCAB = 256
BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
UNK_ID = 259
VOCAB_SIZE = 260
LN_EPSILON = 1e-5
MASK_VALUE = -1e9  # added to masked attention scores (finite: padding rows stay NaN-free)
MLP_RATIO = 4


@dataclass(frozen=True)
class LmConfig:
    """Shape and seed of the demo LM; the same config always yields the same weights."""

    vocab: int = VOCAB_SIZE
    layers: int = 2
    heads: int = 4
    width: int = 128
    max_positions: int = 512
    seed: int = 20240301

    def __post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}")
        if min(self.vocab, self.layers, self.heads, self.width, self.max_positions) < 1:
            raise ValueError(f"every size must be positive: {self}")

    @property
    def head_dim(self) -> int:
        return self.width // self.heads


@dataclass(frozen=True)
class LayerWeights:
    """One block; matrices are [in, out] so that y = x @ w + b."""

    ln1_g: F32
    ln1_b: F32
    wq: F32
    bq: F32
    wk: F32
    bk: F32
    wv: F32
    bv: F32
    wo: F32
    bo: F32
    ln2_g: F32
    ln2_b: F32
    w1: F32
    b1: F32
    w2: F32
    b2: F32


@dataclass(frozen=True)
class LmWeights:
    config: LmConfig
    wte: F32  # [vocab, width], also the LM head (tied)
    wpe: F32  # [max_positions, width]
    layers: tuple[LayerWeights, ...]
    lnf_g: F32
    lnf_b: F32

    def parameter_count(self) -> int:
        arrays = [self.wte, self.wpe, self.lnf_g, self.lnf_b]
        for layer in self.layers:
            arrays += [getattr(layer, name) for name in LayerWeights.__dataclass_fields__]
        return sum(a.size for a in arrays)


DEFAULT_CONFIG = LmConfig()


def init_weights(config: LmConfig = DEFAULT_CONFIG) -> LmWeights:
    """Seeded weights, scaled so attention is not uniform and logits have std ~1-2."""
    rng = np.random.default_rng(config.seed)
    d, hidden = config.width, MLP_RATIO * config.width

    def normal(shape: tuple[int, ...], std: float) -> F32:
        return rng.normal(0.0, std, shape).astype(np.float32)

    def gain() -> F32:
        return (1.0 + normal((d,), 0.1)).astype(np.float32)

    wte = normal((config.vocab, d), 1.0 / np.sqrt(d) * 1.5)
    wpe = normal((config.max_positions, d), 0.5 / np.sqrt(d))
    layers = []
    for _ in range(config.layers):
        layers.append(
            LayerWeights(
                ln1_g=gain(), ln1_b=normal((d,), 0.02),
                wq=normal((d, d), 1.5 / np.sqrt(d)), bq=normal((d,), 0.02),
                wk=normal((d, d), 1.5 / np.sqrt(d)), bk=normal((d,), 0.02),
                wv=normal((d, d), 1.0 / np.sqrt(d)), bv=normal((d,), 0.02),
                wo=normal((d, d), 0.5 / np.sqrt(d)), bo=normal((d,), 0.02),
                ln2_g=gain(), ln2_b=normal((d,), 0.02),
                w1=normal((d, hidden), 1.0 / np.sqrt(d)), b1=normal((hidden,), 0.02),
                w2=normal((hidden, d), 0.5 / np.sqrt(hidden)), b2=normal((d,), 0.02),
            )
        )  # fmt: skip
    return LmWeights(config, wte, wpe, tuple(layers), gain(), normal((d,), 0.02))


def layer_norm(x: F32, g: F32, b: F32) -> F32:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return ((x - mean) / np.sqrt(var + LN_EPSILON) * g + b).astype(np.float32)


def gelu(x: F32) -> F32:
    """tanh-approximated GELU (GPT-2's "gelu_new")."""
    inner = np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)
    return (0.5 * x * (1.0 + np.tanh(inner))).astype(np.float32)


def softmax(x: F32) -> F32:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


def attention_bias(attention_mask: I64, seq: int) -> F32:
    """[B, 1, S, P + S] additive bias: 0 where allowed, ``MASK_VALUE`` where masked."""
    total = attention_mask.shape[1]
    past = total - seq
    causal = np.arange(total)[None, :] <= (past + np.arange(seq))[:, None]  # [S, T]
    allowed = causal[None, None] & (attention_mask[:, None, None, :] != 0)
    return np.where(allowed, np.float32(0.0), np.float32(MASK_VALUE)).astype(np.float32)


def empty_past(weights: LmWeights, batch: int) -> list[KV]:
    cfg = weights.config
    shape = (batch, cfg.heads, 0, cfg.head_dim)
    return [(np.zeros(shape, np.float32), np.zeros(shape, np.float32)) for _ in range(cfg.layers)]


def forward(
    weights: LmWeights,
    input_ids: I64,
    attention_mask: I64,
    position_ids: I64,
    past: Sequence[KV] | None = None,
) -> tuple[F32, list[KV]]:
    """One forward step; see the module docstring for shapes. ``past=None`` means length 0."""
    cfg = weights.config
    batch, seq = input_ids.shape
    past = empty_past(weights, batch) if past is None else past
    if len(past) != cfg.layers:
        raise ValueError(f"past has {len(past)} layers, the model has {cfg.layers}")
    if attention_mask.shape != (batch, past[0][0].shape[2] + seq):
        raise ValueError(f"attention_mask shape {attention_mask.shape} does not match past + seq")
    h = (weights.wte[input_ids] + weights.wpe[position_ids]).astype(np.float32)
    bias = attention_bias(attention_mask, seq)
    scale = np.float32(1.0 / np.sqrt(cfg.head_dim))

    def heads(x: F32) -> F32:  # [B, S, D] -> [B, H, S, Dh]
        return x.reshape(batch, seq, cfg.heads, cfg.head_dim).transpose(0, 2, 1, 3)

    present: list[KV] = []
    for layer, (past_k, past_v) in zip(weights.layers, past, strict=True):
        x = layer_norm(h, layer.ln1_g, layer.ln1_b)
        q = heads(x @ layer.wq + layer.bq) * scale
        k = np.concatenate([past_k, heads(x @ layer.wk + layer.bk)], axis=2)
        v = np.concatenate([past_v, heads(x @ layer.wv + layer.bv)], axis=2)
        present.append((k, v))
        probs = softmax(q @ k.transpose(0, 1, 3, 2) + bias)  # [B, H, S, P + S]
        ctx = (probs @ v).transpose(0, 2, 1, 3).reshape(batch, seq, cfg.width)
        h = h + ctx @ layer.wo + layer.bo
        x = layer_norm(h, layer.ln2_g, layer.ln2_b)
        h = h + gelu(x @ layer.w1 + layer.b1) @ layer.w2 + layer.b2
    x = layer_norm(h, weights.lnf_g, weights.lnf_b)
    return (x @ weights.wte.T).astype(np.float32), present


def positions_from_mask(attention_mask: I64) -> I64:
    """Optimum/HF position ids for left padding: cumsum(mask) - 1, padding clamped to 1."""
    pos = np.cumsum(attention_mask, axis=-1) - 1
    return np.where(attention_mask == 0, 1, pos).astype(np.int64)


def encode(text: str, bos: bool = False) -> list[int]:
    """UTF-8 bytes of ``text`` as ids, optionally preceded by ``BOS_ID``."""
    return ([BOS_ID] if bos else []) + list(text.encode("utf-8"))


def decode(ids: Sequence[int]) -> str:
    """Bytes back to text; special ids are dropped, invalid UTF-8 becomes U+FFFD."""
    return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")


def generate_greedy(
    weights: LmWeights, prompt: Sequence[int], max_new_tokens: int, stop_at_eos: bool = True
) -> list[int]:
    """Greedy decoding of one sequence with the KV cache; returns only the new ids."""
    ids = np.asarray([prompt], dtype=np.int64)
    mask = np.ones_like(ids)
    logits, past = forward(weights, ids, mask, np.arange(ids.shape[1], dtype=np.int64)[None])
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits[0, -1].argmax())
        out.append(token)
        if stop_at_eos and token == EOS_ID:
            break
        position = mask.shape[1]
        mask = np.ones((1, position + 1), dtype=np.int64)
        step = np.asarray([[token]], dtype=np.int64)
        logits, past = forward(weights, step, mask, np.asarray([[position]]), past)
    return out
