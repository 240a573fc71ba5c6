"""Demo decoder-only language model as an ONNX graph, named like a Hugging Face Optimum export.

``build_demo_lm(out)`` writes a Triton-layout model directory::

    <out>/demo_lm/config.pbtxt
    <out>/demo_lm/1/model.onnx

The network and its seeded weights are those of ``model_server.generative.lm_reference`` (the numpy
reference: byte-level vocabulary of 260, learned absolute positions, pre-LayerNorm blocks,
tied LM head); the graph computes the same function, so tests compare the two.

Inputs and outputs follow Optimum's decoder export with past (the ``model.onnx`` of
``optimum-cli export onnx --task text-generation-with-past``), so a decoder a user exported
that way is driven the same way. (Older ``decoder_model_merged.onnx`` exports add a bool
``use_cache_branch`` input; some architectures' exports have no ``position_ids``.)
For layer i in 0..layers-1:

==============================  =====  ===========================================================
name                            type   shape
==============================  =====  ===========================================================
input_ids                       int64  [batch_size, sequence_length]
attention_mask                  int64  [batch_size, past_sequence_length + sequence_length]
position_ids                    int64  [batch_size, sequence_length]
past_key_values.{i}.key/.value  fp32   [batch_size, heads, past_sequence_length, head_dim]
logits                          fp32   [batch_size, sequence_length, vocab]
present.{i}.key/.value          fp32   [batch_size, heads, past_sequence_length + sequence_length,
                                       head_dim]
==============================  =====  ===========================================================

The quoted names are ONNX ``dim_param`` values; heads, head_dim and vocab are fixed. The first
step (prefill) passes past tensors with past_sequence_length 0, later steps feed ``present``
back as ``past_key_values``. attention_mask is 1 to attend and 0 for padding (left padding
works); the graph combines it with causality: query i attends to key j when
j <= past_sequence_length + i. Since the batch dimension is inside the graph, the Triton config
has ``max_batch_size: 0`` and declares it as a -1 dim.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from model_server.demo_models import IR_VERSION, OPSET, _write_atomic, write_model
from model_server.generative.chat import GENERATION_PROMPT_PARAMETER, TEMPLATE_PARAMETER
from model_server.generative.lm_reference import (
    DEFAULT_CONFIG,
    LN_EPSILON,
    MASK_VALUE,
    LmConfig,
    LmWeights,
    init_weights,
)

MODEL_NAME = "demo_lm"
DEMO_CHAT_TEMPLATE = "<|{role}|>\n{content}\n"
DEMO_GENERATION_PROMPT = "<|assistant|>\n"
VERSION = 1
BATCH, SEQ, PAST = "batch_size", "sequence_length", "past_sequence_length"
TOTAL = "past_sequence_length + sequence_length"


def input_names(layers: int) -> list[str]:
    """Optimum's decoder input names, in graph order."""
    names = ["input_ids", "attention_mask", "position_ids"]
    for i in range(layers):
        names += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
    return names


def output_names(layers: int) -> list[str]:
    """Optimum's decoder output names, in graph order."""
    names = ["logits"]
    for i in range(layers):
        names += [f"present.{i}.key", f"present.{i}.value"]
    return names


class _Graph:
    """Accumulates nodes and initializers with deterministic, readable names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def op(self, op_type: str, inputs: list[str], output: str, **attrs: Any) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [output], name=output, **attrs))
        return output

    def linear(self, x: str, w: np.ndarray, b: np.ndarray, name: str) -> str:
        mm = self.op("MatMul", [x, self.const(f"{name}.weight", w)], f"{name}/matmul")
        return self.op("Add", [mm, self.const(f"{name}.bias", b)], f"{name}/out")

    def layer_norm(self, x: str, g: np.ndarray, b: np.ndarray, name: str) -> str:
        inputs = [x, self.const(f"{name}.weight", g), self.const(f"{name}.bias", b)]
        return self.op("LayerNormalization", inputs, f"{name}/out", axis=-1, epsilon=LN_EPSILON)

    def gelu(self, x: str, name: str) -> str:
        """0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), as the reference."""
        c = self.const(f"{name}.c", np.array(0.044715, np.float32))
        k = self.const(f"{name}.k", np.array(np.sqrt(2.0 / np.pi), np.float32))
        one = self.const(f"{name}.one", np.array(1.0, np.float32))
        half = self.const(f"{name}.half", np.array(0.5, np.float32))
        cube = self.op("Mul", [x, self.op("Mul", [x, x], f"{name}/x2")], f"{name}/x3")
        inner = self.op("Add", [x, self.op("Mul", [cube, c], f"{name}/cx3")], f"{name}/sum")
        tanh = self.op("Tanh", [self.op("Mul", [inner, k], f"{name}/k")], f"{name}/tanh")
        one_plus = self.op("Add", [tanh, one], f"{name}/1p")
        return self.op("Mul", [self.op("Mul", [x, half], f"{name}/hx"), one_plus], f"{name}/out")


def _mask_bias(g: _Graph) -> str:
    """[B, 1, S, P + S] additive bias from attention_mask and causality (0 or MASK_VALUE)."""
    g.const("i64.0", np.array(0, np.int64))
    g.const("i64.1", np.array(1, np.int64))
    g.const("axes.0", np.array([0], np.int64))
    g.const("axes.1", np.array([1], np.int64))
    g.const("axes.1_2", np.array([1, 2], np.int64))
    seq = g.op("Gather", [g.op("Shape", ["input_ids"], "mask/ids_shape"), "i64.1"], "mask/seq")
    total_shape = g.op("Shape", ["attention_mask"], "mask/am_shape")
    total = g.op("Gather", [total_shape, "i64.1"], "mask/total")
    past = g.op("Sub", [total, seq], "mask/past")
    keys = g.op("Range", ["i64.0", total, "i64.1"], "mask/keys")  # [T]
    queries = g.op("Range", [past, total, "i64.1"], "mask/queries")  # [S]: P .. P+S-1
    queries = g.op("Unsqueeze", [queries, "axes.1"], "mask/queries_col")  # [S, 1]
    causal = g.op("LessOrEqual", [keys, queries], "mask/causal")  # [S, T]
    causal = g.op("Unsqueeze", [causal, "axes.0"], "mask/causal4")  # [1, S, T]
    padding = g.op("Cast", ["attention_mask"], "mask/attend", to=TensorProto.BOOL)
    padding = g.op("Unsqueeze", [padding, "axes.1_2"], "mask/attend4")  # [B, 1, 1, T]
    allowed = g.op("And", [causal, padding], "mask/allowed")  # [B, 1, S, T]
    g.const("mask.zero", np.array(0.0, np.float32))
    g.const("mask.value", np.array(MASK_VALUE, np.float32))
    return g.op("Where", [allowed, "mask.zero", "mask.value"], "mask/bias")


def build_lm_model(config: LmConfig = DEFAULT_CONFIG) -> onnx.ModelProto:
    """The demo LM graph with the seeded weights of ``lm_reference.init_weights(config)``."""
    weights: LmWeights = init_weights(config)
    g = _Graph()
    heads, dh, d = config.heads, config.head_dim, config.width
    tok = g.op("Gather", [g.const("wte", weights.wte), "input_ids"], "embed/tokens")
    pos = g.op("Gather", [g.const("wpe", weights.wpe), "position_ids"], "embed/positions")
    h = g.op("Add", [tok, pos], "embed/out")
    bias = _mask_bias(g)
    g.const("shape.split_heads", np.array([0, 0, heads, dh], np.int64))
    g.const("shape.merge_heads", np.array([0, 0, d], np.int64))
    g.const("attn.scale", np.array(1.0 / np.sqrt(dh), np.float32))

    def split_heads(x: str, name: str) -> str:  # [B, S, D] -> [B, H, S, Dh]
        x = g.op("Reshape", [x, "shape.split_heads"], f"{name}/bshd")
        return g.op("Transpose", [x], f"{name}/bhsd", perm=[0, 2, 1, 3])

    for i, lw in enumerate(weights.layers):
        p = f"layers.{i}"
        x = g.layer_norm(h, lw.ln1_g, lw.ln1_b, f"{p}.ln_1")
        q = split_heads(g.linear(x, lw.wq, lw.bq, f"{p}.attn.q"), f"{p}.attn.q")
        q = g.op("Mul", [q, "attn.scale"], f"{p}.attn.q/scaled")
        k = split_heads(g.linear(x, lw.wk, lw.bk, f"{p}.attn.k"), f"{p}.attn.k")
        v = split_heads(g.linear(x, lw.wv, lw.bv, f"{p}.attn.v"), f"{p}.attn.v")
        k = g.op("Concat", [f"past_key_values.{i}.key", k], f"present.{i}.key", axis=2)
        v = g.op("Concat", [f"past_key_values.{i}.value", v], f"present.{i}.value", axis=2)
        kt = g.op("Transpose", [k], f"{p}.attn/kt", perm=[0, 1, 3, 2])
        scores = g.op("Add", [g.op("MatMul", [q, kt], f"{p}.attn/qk"), bias], f"{p}.attn/scores")
        probs = g.op("Softmax", [scores], f"{p}.attn/probs", axis=-1)
        ctx = g.op("MatMul", [probs, v], f"{p}.attn/pv")
        ctx = g.op("Transpose", [ctx], f"{p}.attn/bshd", perm=[0, 2, 1, 3])
        ctx = g.op("Reshape", [ctx, "shape.merge_heads"], f"{p}.attn/ctx")
        h = g.op("Add", [h, g.linear(ctx, lw.wo, lw.bo, f"{p}.attn.out")], f"{p}/resid1")
        x = g.layer_norm(h, lw.ln2_g, lw.ln2_b, f"{p}.ln_2")
        m = g.gelu(g.linear(x, lw.w1, lw.b1, f"{p}.mlp.fc"), f"{p}.mlp.gelu")
        h = g.op("Add", [h, g.linear(m, lw.w2, lw.b2, f"{p}.mlp.proj")], f"{p}/resid2")
    x = g.layer_norm(h, weights.lnf_g, weights.lnf_b, "ln_f")
    head = g.op("Transpose", ["wte"], "lm_head/weight", perm=[1, 0])  # tied; folded at load
    g.op("MatMul", [x, head], "logits")

    past_shape: list[int | str] = [BATCH, heads, PAST, dh]
    present_shape: list[int | str] = [BATCH, heads, TOTAL, dh]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, [BATCH, SEQ]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [BATCH, TOTAL]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, [BATCH, SEQ]),
    ]
    outputs = [
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, [BATCH, SEQ, config.vocab])
    ]
    for name in input_names(config.layers)[3:]:
        inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, past_shape))
    for name in output_names(config.layers)[1:]:
        outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, present_shape))
    graph = helper.make_graph(g.nodes, MODEL_NAME, inputs, outputs, g.inits)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="model_server.demo_lm",
    )
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def config_pbtxt(config: LmConfig = DEFAULT_CONFIG) -> str:
    """Triton config: max_batch_size 0 (batch is a graph dim), every dim -1 but fixed sizes."""
    kv = f"[ -1, {config.heads}, -1, {config.head_dim} ]"
    ins = [f'{{ name: "{n}" data_type: TYPE_INT64 dims: [ -1, -1 ] }}' for n in input_names(0)]
    ins += [
        f'{{ name: "{n}" data_type: TYPE_FP32 dims: {kv} }}' for n in input_names(config.layers)[3:]
    ]
    logits = f'{{ name: "logits" data_type: TYPE_FP32 dims: [ -1, -1, {config.vocab} ] }}'
    outs = [logits]
    outs += [
        f'{{ name: "{n}" data_type: TYPE_FP32 dims: {kv} }}'
        for n in output_names(config.layers)[1:]
    ]
    return (
        "# Generated by model_server.demo_lm; rebuild with: python -m model_server.demo_lm\n"
        f'name: "{MODEL_NAME}"\n'
        'platform: "onnxruntime_onnx"\n'
        "max_batch_size: 0\n"
        "input [\n  " + ",\n  ".join(ins) + "\n]\n"
        "output [\n  " + ",\n  ".join(outs) + "\n]\n"
        "instance_group [ { count: 1 kind: KIND_AUTO } ]\n"
        # How a conversation becomes a prompt (model_server.generative.chat; the OpenAI API's
        # /v1/chat/completions)
        + _parameter(TEMPLATE_PARAMETER, DEMO_CHAT_TEMPLATE)
        + _parameter(GENERATION_PROMPT_PARAMETER, DEMO_GENERATION_PROMPT)
    )


def _parameter(key: str, value: str) -> str:
    return f'parameters {{ key: "{key}" value {{ string_value: "{_pbtxt(value)}" }} }}\n'


def _pbtxt(text: str) -> str:
    """``text`` as a protobuf text-format string's contents."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def build_demo_lm(out_dir: Path, config: LmConfig = DEFAULT_CONFIG, *, force: bool = True) -> Path:
    """Write ``<out_dir>/demo_lm/{config.pbtxt,1/model.onnx}``; return the model path.

    Writes are atomic and byte-identical for the same config; with ``force=False`` a model
    file that exists is left untouched (as ``demo_models.build_demo_repository`` does), and
    the config is rewritten only when it differs from this version's (an older checkout's
    config lacks, e.g., the chat template the OpenAI API needs).
    """
    model_dir = Path(out_dir) / MODEL_NAME
    config_path = model_dir / "config.pbtxt"
    text = config_pbtxt(config).encode()
    if force or not config_path.exists() or config_path.read_bytes() != text:
        _write_atomic(text, config_path)
    path = model_dir / str(VERSION) / "model.onnx"
    if force or not path.exists():
        write_model(build_lm_model(config), path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="infermesh-demo-lm", description="Build the deterministic demo language model."
    )
    parser.add_argument("--out", default="models", help="repository root (default: models)")
    parser.add_argument("--layers", type=int, default=DEFAULT_CONFIG.layers)
    parser.add_argument("--heads", type=int, default=DEFAULT_CONFIG.heads)
    parser.add_argument("--width", type=int, default=DEFAULT_CONFIG.width)
    parser.add_argument("--seed", type=int, default=DEFAULT_CONFIG.seed)
    parser.add_argument(
        "--keep", action="store_true", help="leave existing files untouched (no new mtime)"
    )
    args = parser.parse_args(argv)
    config = LmConfig(layers=args.layers, heads=args.heads, width=args.width, seed=args.seed)
    path = build_demo_lm(Path(args.out), config, force=not args.keep)
    print(f"wrote: {path.parent.parent / 'config.pbtxt'}")
    params = init_weights(config).parameter_count()
    print(f"wrote: {path} ({path.stat().st_size} bytes, {params} parameters)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
