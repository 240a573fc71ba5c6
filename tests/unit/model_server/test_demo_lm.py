"""Tests for the demo LM: ONNX graph vs numpy reference, KV cache, padding, naming, serving."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from model_server.demo_lm import (
    BATCH,
    PAST,
    SEQ,
    TOTAL,
    build_demo_lm,
    build_lm_model,
    input_names,
    output_names,
)
from model_server.generative import lm_reference as ref
from model_server.generative.lm_reference import KV, LmConfig, LmWeights
from tests.support import start_server

CONFIG = ref.DEFAULT_CONFIG
ATOL = 1e-4


@pytest.fixture(scope="module")
def lm_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lm-repo")
    build_demo_lm(out)
    return out


@pytest.fixture(scope="module")
def session(lm_repo: Path) -> ort.InferenceSession:
    path = lm_repo / "demo_lm" / "1" / "model.onnx"
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def weights() -> LmWeights:
    return ref.init_weights(CONFIG)


def _ids(batch: int, seq: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, ref.BYTE_VOCAB, (batch, seq), dtype=np.int64)


def _positions(batch: int, start: int, seq: int) -> np.ndarray:
    return np.tile(np.arange(start, start + seq, dtype=np.int64), (batch, 1))


def onnx_step(
    sess: ort.InferenceSession,
    config: LmConfig,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    position_ids: np.ndarray,
    past: Sequence[KV] | None = None,
) -> tuple[np.ndarray, list[KV]]:
    """One ONNX Runtime step with Optimum's names; ``past=None`` feeds past length 0."""
    batch = input_ids.shape[0]
    if past is None:
        empty = np.zeros((batch, config.heads, 0, config.head_dim), np.float32)
        past = [(empty, empty)] * config.layers
    feeds = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    for i, (key, value) in enumerate(past):
        feeds[f"past_key_values.{i}.key"] = key
        feeds[f"past_key_values.{i}.value"] = value
    logits, *flat = sess.run(output_names(config.layers), feeds)
    return logits, [(flat[2 * i], flat[2 * i + 1]) for i in range(config.layers)]


def test_onnx_matches_reference_full_prompt(
    session: ort.InferenceSession, weights: LmWeights
) -> None:
    ids = _ids(2, 24)
    mask = np.ones_like(ids)
    pos = _positions(2, 0, 24)
    logits, present = onnx_step(session, CONFIG, ids, mask, pos)
    expected, expected_present = ref.forward(weights, ids, mask, pos)
    assert logits.shape == (2, 24, ref.VOCAB_SIZE) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0)
    for (k, v), (ek, ev) in zip(present, expected_present, strict=True):
        assert k.shape == (2, CONFIG.heads, 24, CONFIG.head_dim)
        np.testing.assert_allclose(k, ek, atol=ATOL, rtol=0)
        np.testing.assert_allclose(v, ev, atol=ATOL, rtol=0)
    # Logits are not degenerate: they vary along the sequence and the softmax is not flat.
    assert logits.std() > 0.5
    assert np.abs(logits[:, 1:] - logits[:, :1]).max() > 0.5


def test_other_config_matches_reference() -> None:
    config = LmConfig(layers=3, heads=2, width=64, max_positions=64, seed=7)
    sess = ort.InferenceSession(
        build_lm_model(config).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    ids = _ids(1, 10, seed=3)
    mask, pos = np.ones_like(ids), _positions(1, 0, 10)
    logits, _ = onnx_step(sess, config, ids, mask, pos)
    expected, _ = ref.forward(ref.init_weights(config), ids, mask, pos)
    np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("engine", ["numpy", "onnx"])
def test_cached_decoding_equals_full_recomputation(
    engine: str, session: ort.InferenceSession, weights: LmWeights
) -> None:
    batch, prefill, total = 2, 9, 17
    ids = _ids(batch, total, seed=1)

    def step(
        i: np.ndarray, m: np.ndarray, p: np.ndarray, past: Sequence[KV] | None
    ) -> tuple[np.ndarray, list[KV]]:
        if engine == "onnx":
            return onnx_step(session, CONFIG, i, m, p, past)
        return ref.forward(weights, i, m, p, past)

    full, full_present = step(ids, np.ones_like(ids), _positions(batch, 0, total), None)
    logits, past = step(
        ids[:, :prefill], np.ones((batch, prefill), np.int64), _positions(batch, 0, prefill), None
    )
    np.testing.assert_allclose(logits, full[:, :prefill], atol=ATOL, rtol=0)
    for t in range(prefill, total):
        mask = np.ones((batch, t + 1), np.int64)
        logits, past = step(ids[:, t : t + 1], mask, _positions(batch, t, 1), past)
        assert past[0][0].shape == (batch, CONFIG.heads, t + 1, CONFIG.head_dim)
        np.testing.assert_allclose(logits[:, 0], full[:, t], atol=ATOL, rtol=0)
    for (k, v), (fk, fv) in zip(past, full_present, strict=True):
        np.testing.assert_allclose(k, fk, atol=ATOL, rtol=0)
        np.testing.assert_allclose(v, fv, atol=ATOL, rtol=0)


@pytest.mark.parametrize("engine", ["numpy", "onnx"])
def test_left_padding_matches_unpadded(
    engine: str, session: ort.InferenceSession, weights: LmWeights
) -> None:
    long_ids, short_ids = _ids(1, 12, seed=4)[0], _ids(1, 7, seed=5)[0]
    pad = len(long_ids) - len(short_ids)
    ids = np.stack([long_ids, np.concatenate([np.full(pad, ref.PAD_ID), short_ids])])
    mask = np.ones_like(ids)
    mask[1, :pad] = 0
    pos = ref.positions_from_mask(mask)

    def step(
        i: np.ndarray, m: np.ndarray, p: np.ndarray, past: Sequence[KV] | None = None
    ) -> tuple[np.ndarray, list[KV]]:
        if engine == "onnx":
            return onnx_step(session, CONFIG, i, m, p, past)
        return ref.forward(weights, i, m, p, past)

    logits, past = step(ids, mask, pos)
    assert np.isfinite(logits).all()  # padding queries see no key but stay finite
    alone = [
        step(s[None], np.ones((1, len(s)), np.int64), _positions(1, 0, len(s)))
        for s in (long_ids, short_ids)
    ]
    np.testing.assert_allclose(logits[0], alone[0][0][0], atol=ATOL, rtol=0)
    np.testing.assert_allclose(logits[1, pad:], alone[1][0][0], atol=ATOL, rtol=0)
    # One cached step with the padding still in the cache.
    nxt = np.array([[65], [66]], np.int64)
    mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
    logits, _ = step(nxt, mask, pos[:, -1:] + 1, past)
    for row, (_, alone_past) in enumerate(alone):
        n = alone_past[0][0].shape[2]
        one = np.ones((1, n + 1), np.int64)
        expected, _ = step(nxt[row : row + 1], one, np.array([[n]], np.int64), alone_past)
        np.testing.assert_allclose(logits[row], expected[0], atol=ATOL, rtol=0)


def test_build_is_deterministic_with_optimum_names(tmp_path: Path, lm_repo: Path) -> None:
    again = build_demo_lm(tmp_path)
    first = lm_repo / "demo_lm" / "1" / "model.onnx"
    assert again.read_bytes() == first.read_bytes()
    assert (tmp_path / "demo_lm" / "config.pbtxt").read_bytes() == (
        lm_repo / "demo_lm" / "config.pbtxt"
    ).read_bytes()
    assert first.stat().st_size < 3_000_000
    graph = onnx.load(str(first)).graph

    def dims(value: onnx.ValueInfoProto) -> list[int | str]:
        return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]

    kv_in: list[int | str] = [BATCH, CONFIG.heads, PAST, CONFIG.head_dim]
    kv_out: list[int | str] = [BATCH, CONFIG.heads, TOTAL, CONFIG.head_dim]
    assert [v.name for v in graph.input] == [
        "input_ids", "attention_mask", "position_ids",
        "past_key_values.0.key", "past_key_values.0.value",
        "past_key_values.1.key", "past_key_values.1.value",
    ]  # fmt: skip
    assert [v.name for v in graph.output] == [
        "logits",
        "present.0.key",
        "present.0.value",
        "present.1.key",
        "present.1.value",
    ]
    assert [v.name for v in graph.input] == input_names(CONFIG.layers)
    assert [v.name for v in graph.output] == output_names(CONFIG.layers)
    shapes = {v.name: dims(v) for v in [*graph.input, *graph.output]}
    assert shapes["input_ids"] == shapes["position_ids"] == [BATCH, SEQ]
    assert shapes["attention_mask"] == [BATCH, "past_sequence_length + sequence_length"]
    assert shapes["logits"] == [BATCH, SEQ, ref.VOCAB_SIZE]
    assert all(shapes[n] == kv_in for n in input_names(CONFIG.layers)[3:])
    assert all(shapes[n] == kv_out for n in output_names(CONFIG.layers)[1:])
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output]}
    assert {types[n] for n in input_names(0)} == {onnx.TensorProto.INT64}
    assert {types[n] for n in [*input_names(2)[3:], *output_names(2)]} == {onnx.TensorProto.FLOAT}


def test_encode_decode_round_trip() -> None:
    text = "Grüße, 世界! 🚀 naïve café"
    ids = ref.encode(text)
    assert all(0 <= i < ref.BYTE_VOCAB for i in ids) and len(ids) == len(text.encode())
    assert ref.decode(ids) == text
    assert ref.encode(text, bos=True) == [ref.BOS_ID, *ids]
    assert ref.decode([ref.BOS_ID, *ids, ref.EOS_ID, ref.PAD_ID]) == text
    assert ref.decode([0xF0, 0x9F, ord("a")]) == "\ufffda"  # truncated UTF-8 is replaced
    assert {ref.BOS_ID, ref.EOS_ID, ref.PAD_ID, ref.UNK_ID} == set(range(256, ref.VOCAB_SIZE))


def test_generate_greedy_matches_onnx(session: ort.InferenceSession, weights: LmWeights) -> None:
    prompt = ref.encode("Hello", bos=True)
    out = ref.generate_greedy(weights, prompt, 6, stop_at_eos=False)
    ids = np.array([prompt + out[:-1]], np.int64)
    logits, _ = onnx_step(session, CONFIG, ids, np.ones_like(ids), _positions(1, 0, ids.shape[1]))
    assert logits[0, len(prompt) - 1 :].argmax(-1).tolist() == out


@pytest.mark.integration
def test_model_server_loads_demo_lm_as_a_generative_model(lm_repo: Path, tmp_path: Path) -> None:
    """Optimum's decoder interface makes it generative: clients see text in and text out
    (tests/integration/test_generative_server.py checks the generated text against this
    reference)."""
    server = start_server(lm_repo, tmp_path / "logs", "--models", "demo_lm")
    try:
        client = server.client()
        assert client.is_model_ready("demo_lm")
        meta = client.get_model_metadata("demo_lm")
        assert [(t.name, t.datatype) for t in meta.inputs] == [("text_input", "BYTES")]
        assert [(t.name, t.datatype) for t in meta.outputs] == [("text_output", "BYTES")]
        assert client.get_model_config("demo_lm").config.model_transaction_policy.decoupled
    finally:
        server.stop()


def test_keep_rewrites_only_a_config_that_differs(tmp_path: Path) -> None:
    """``make models`` (``--keep``) over an older checkout's repository: a stale config (no
    chat template) is brought up to date, an unchanged one keeps its mtime, the model stays."""
    out = tmp_path / "repo"
    model = build_demo_lm(out)
    config = model.parent.parent / "config.pbtxt"
    current = config.read_bytes()
    model_mtime, config_mtime = model.stat().st_mtime_ns, config.stat().st_mtime_ns
    build_demo_lm(out, force=False)
    assert (model.stat().st_mtime_ns, config.stat().st_mtime_ns) == (model_mtime, config_mtime)
    config.write_bytes(current.replace(b"chat_template", b"old_field"))
    build_demo_lm(out, force=False)
    assert config.read_bytes() == current and model.stat().st_mtime_ns == model_mtime
