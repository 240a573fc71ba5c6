"""How clients talk to a generative model: text in, tokens out, the way Triton's LLM backends do.

A model whose ONNX graph has Hugging Face Optimum's decoder interface (``input_ids``,
``attention_mask``, ``position_ids``, ``past_key_values.{i}.key/.value`` -> ``logits``,
``present.{i}.key/.value``) is served as a generative model. Clients see:

- input ``text_input``: BYTES, shape [1] (the prompt, UTF-8);
- output ``text_output``: BYTES, shape [1]: the whole completion from ModelInfer; one token's
  text per response from ModelStreamInfer (a decoupled model: ``model_transaction_policy
  { decoupled: true }``), the last response carrying the parameter
  ``triton_final_response: true`` and ``finish_reason`` (eos, length, stop);
- request parameters ``max_tokens`` (default 32), ``temperature`` (0: greedy, the default),
  ``top_k`` and ``top_p`` (nucleus sampling, default 1; either one narrowed at temperature 0 is
  refused, since greedy ignores it), ``seed`` (absent: fresh entropy each call), ``stop`` (a
  string; generation ends once the text ends with it) and ``stop_sequences`` (a JSON array of
  up to ``MAX_STOPS`` such strings, for several; the OpenAI API's list).

The vocabulary is byte level (ids 0-255 are bytes; the ids above are specials), as in
``model_server.generative.lm_reference``; a config.pbtxt parameter ``eos_token_id`` /
``bos_token_id`` overrides the demo's 257 / 256.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from tritonclient.grpc import model_config_pb2, service_pb2

from model_server.core.datatypes import DATATYPES
from model_server.core.errors import InvalidInput
from model_server.core.model_config import GraphTensor, ModelSpec, TensorSpec
from model_server.generative.engine import GenerationEngine, GenerationRequest, Offload
from model_server.generative.kv_cache import KvCache, KvShape
from model_server.observability.metrics import ServerMetrics

TEXT_INPUT, TEXT_OUTPUT = "text_input", "text_output"
FINAL_PARAMETER = "triton_final_response"
DEFAULT_BOS, DEFAULT_EOS = 256, 257
BYTE_VOCAB = 256  # ids below are bytes of text; the others are special
DEFAULT_MAX_TOKENS = 32
MAX_STOPS = 4  # stop sequences per request (the OpenAI API's limit)
MAX_STOP_BYTES = 256  # each, in UTF-8 bytes (tokens: the vocabulary is byte level)
# config.pbtxt parameters of a generative model, with their defaults
ENGINE_PARAMETERS = {
    "kv_cache_blocks": 512,  # the KV budget, in blocks
    "kv_block_tokens": 16,
    "max_running_sequences": 32,
    "max_positions": 512,  # the model's context length
    # new sequences prefilled in one run: 1 (one at a time) had the lower TTFT on a CPU
    # (bench_prefix_cache.py); more pays where one run of several rows costs about one row's
    "max_prefill_sequences": 1,
}
WHEN_FULL = ("wait", "reject")  # parameter kv_when_full: new sequences wait, or are refused
SWITCH = {"true": True, "on": True, "1": True, "false": False, "off": False, "0": False}
_PAST = re.compile(r"past_key_values\.(\d+)\.(key|value)")


def is_decoder(inputs: Sequence[GraphTensor], outputs: Sequence[GraphTensor]) -> bool:
    names = {t.name for t in inputs}
    out = {t.name for t in outputs}
    return (
        {"input_ids", "attention_mask", "position_ids"} <= names
        and "logits" in out
        and any(_PAST.fullmatch(n) for n in names)
    )


def kv_shape(inputs: Sequence[GraphTensor], total_blocks: int, block_tokens: int) -> KvShape:
    """Layers, heads and head size from the past inputs ([batch, heads, past, head_dim])."""
    pasts = [t for t in inputs if _PAST.fullmatch(t.name)]
    layers = len({_PAST.fullmatch(t.name).group(1) for t in pasts})  # type: ignore[union-attr]
    heads, head_dim = pasts[0].shape[1], pasts[0].shape[3]
    if not isinstance(heads, int) or not isinstance(head_dim, int):
        raise ValueError(
            f"{pasts[0].name}: heads and head size must be fixed in the graph, got {pasts[0].shape}"
        )
    return KvShape(layers, heads, head_dim, block_tokens, total_blocks)


def text_spec(declared: model_config_pb2.ModelConfig) -> ModelSpec:
    """What clients see of a generative model: text in, text out, decoupled."""
    config = model_config_pb2.ModelConfig()
    config.CopyFrom(declared)
    del config.input[:]
    del config.output[:]
    config.max_batch_size = 0
    config.platform = "onnxruntime_onnx"
    config.input.add(name=TEXT_INPUT, data_type=model_config_pb2.TYPE_STRING, dims=[1])
    config.output.add(name=TEXT_OUTPUT, data_type=model_config_pb2.TYPE_STRING, dims=[1])
    config.model_transaction_policy.decoupled = True
    text = (TensorSpec(TEXT_INPUT, DATATYPES["BYTES"], (1,)),)
    out = (TensorSpec(TEXT_OUTPUT, DATATYPES["BYTES"], (1,)),)
    return ModelSpec(config.name, 0, text, out, config)


def special_ids(config: model_config_pb2.ModelConfig) -> tuple[int, int]:
    """(bos, eos) token ids from the config's parameters, else the demo vocabulary's."""

    def read(key: str, default: int) -> int:
        value = config.parameters[key].string_value if key in config.parameters else ""
        return int(value) if value.strip().isdigit() else default

    return read("bos_token_id", DEFAULT_BOS), read("eos_token_id", DEFAULT_EOS)


def parse_generation(
    request: service_pb2.ModelInferRequest, bos: int, max_positions: int
) -> tuple[GenerationRequest, bytes]:
    """The generation a request asks for, and its stop text; INVALID_ARGUMENT naming the
    field for anything else."""
    model = f"model {request.model_name!r}"
    names = [t.name for t in request.inputs]
    if names != [TEXT_INPUT]:
        raise InvalidInput(f"{model}: expected one input {TEXT_INPUT!r} (BYTES [1]), got {names}")
    tensor = request.inputs[0]
    if tensor.datatype != "BYTES" or list(tensor.shape) not in ([1], [1, 1]):
        raise InvalidInput(
            f"{model}: input {TEXT_INPUT!r} must be BYTES with shape [1], got "
            f"{tensor.datatype} {list(tensor.shape)}"
        )
    if request.raw_input_contents:
        raw = request.raw_input_contents[0]
        size = int.from_bytes(raw[:4], "little") if len(raw) >= 4 else -1
        if size != len(raw) - 4:
            raise InvalidInput(
                f"{model}: input {TEXT_INPUT!r}: raw contents must be one 4-byte length "
                "prefixed string"
            )
        prompt = bytes(raw[4:])
    elif len(tensor.contents.bytes_contents) == 1:
        prompt = bytes(tensor.contents.bytes_contents[0])
    else:
        raise InvalidInput(f"{model}: input {TEXT_INPUT!r} needs one string")
    stops = _stops(request)
    generation = GenerationRequest(
        prompt=(bos, *prompt),
        max_tokens=_integer(request, "max_tokens", DEFAULT_MAX_TOKENS),
        temperature=_number(request, "temperature", 0.0),
        top_k=_integer(request, "top_k", 0),
        seed=_integer(request, "seed", 0) if "seed" in request.parameters else None,
        stop=tuple(tuple(stop) for stop in stops),
        top_p=_number(request, "top_p", 1.0),
    )
    generation.check(max_positions)
    return generation, stops[0] if stops else b""


def _stops(request: service_pb2.ModelInferRequest) -> list[bytes]:
    """The stop texts: ``stop`` (one string) and ``stop_sequences`` (a JSON array of them)."""
    stops = [_string(request, "stop").encode()]
    listed = _string(request, "stop_sequences")
    if listed:
        try:
            items = json.loads(listed)
        except (ValueError, RecursionError):
            items = None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise InvalidInput("parameters['stop_sequences']: expected a JSON array of strings")
        try:
            stops += [i.encode() for i in items]
        except UnicodeEncodeError:  # json.loads takes a lone "\ud800" escape
            raise InvalidInput(
                "parameters['stop_sequences']: a string holds a lone UTF-16 surrogate (an "
                "unpaired \\uD800-\\uDFFF escape); expected valid Unicode"
            ) from None
    stops = [s for s in dict.fromkeys(stops) if s]
    if len(stops) > MAX_STOPS:
        raise InvalidInput(f"stop: at most {MAX_STOPS} stop sequences, got {len(stops)}")
    longest = max((len(s) for s in stops), default=0)
    if longest > MAX_STOP_BYTES:
        raise InvalidInput(
            f"stop: a stop sequence is at most {MAX_STOP_BYTES} bytes, got {longest}"
        )
    return stops


def _integer(request: service_pb2.ModelInferRequest, name: str, default: int) -> int:
    if name not in request.parameters:
        return default
    p = request.parameters[name]
    kind = p.WhichOneof("parameter_choice")
    if kind in ("int64_param", "uint64_param"):
        return int(getattr(p, kind))
    raise InvalidInput(f"parameters[{name!r}]: expected an integer, got {kind}")


def _number(request: service_pb2.ModelInferRequest, name: str, default: float) -> float:
    if name not in request.parameters:
        return default
    p = request.parameters[name]
    kind = p.WhichOneof("parameter_choice")
    if kind in ("double_param", "int64_param", "uint64_param"):
        value = float(getattr(p, kind))
        if math.isfinite(value):
            return value
    raise InvalidInput(f"parameters[{name!r}]: expected a finite number, got {kind}")


def _string(request: service_pb2.ModelInferRequest, name: str) -> str:
    if name not in request.parameters:
        return ""
    p = request.parameters[name]
    if p.WhichOneof("parameter_choice") != "string_param":
        raise InvalidInput(f"parameters[{name!r}]: expected a string")
    return str(p.string_param)


def text_response(
    request: service_pb2.ModelInferRequest,
    model: str,
    version: int,
    text: bytes,
    final: bool,
    finish_reason: str = "",
) -> service_pb2.ModelInferResponse:
    """One response of ``model`` (which may stand in for the one asked for): ``text`` as the
    BYTES output (4-byte length prefix, as raw contents)."""
    response = service_pb2.ModelInferResponse(
        model_name=model, model_version=str(version), id=request.id
    )
    output = response.outputs.add(name=TEXT_OUTPUT, datatype="BYTES")
    output.shape.append(1)
    response.raw_output_contents.append(len(text).to_bytes(4, "little") + text)
    response.parameters[FINAL_PARAMETER].bool_param = final
    if finish_reason:
        response.parameters["finish_reason"].string_param = finish_reason
    return response


def join_text(
    responses: Sequence[service_pb2.ModelInferResponse],
) -> service_pb2.ModelInferResponse:
    """The streamed token responses as one answer: their texts joined, the last one's flags."""
    last = responses[-1]
    text = b"".join(bytes(r.raw_output_contents[0][4:]) for r in responses)
    joined = service_pb2.ModelInferResponse()
    joined.CopyFrom(last)
    del joined.raw_output_contents[:]
    joined.raw_output_contents.append(len(text).to_bytes(4, "little") + text)
    return joined


def engine_settings(config: model_config_pb2.ModelConfig) -> tuple[dict[str, int], str]:
    """The engine's numeric settings and ``kv_when_full`` from the config's parameters;
    ValueError naming the parameter for a bad value."""
    settings = dict(ENGINE_PARAMETERS)
    for key in settings:
        if key in config.parameters:
            text = config.parameters[key].string_value.strip()
            if not text.isdigit() or int(text) < 1:
                raise ValueError(f"parameters[{key!r}]: expected an integer >= 1, got {text!r}")
            settings[key] = int(text)
    when_full = "wait"
    if "kv_when_full" in config.parameters:
        when_full = config.parameters["kv_when_full"].string_value.strip()
        if when_full not in WHEN_FULL:
            raise ValueError(f"parameters['kv_when_full']: expected one of {WHEN_FULL}")
    prefix_caching(config)  # a bad value fails the load, named
    cache_tokens = settings["kv_cache_blocks"] * settings["kv_block_tokens"]
    if cache_tokens < settings["max_positions"]:  # a full context could never run
        raise ValueError(
            f"parameters['kv_cache_blocks']: {settings['kv_cache_blocks']} blocks of "
            f"{settings['kv_block_tokens']} tokens hold {cache_tokens} tokens, fewer than one "
            f"sequence of the context (max_positions {settings['max_positions']}); raise "
            "kv_cache_blocks or lower max_positions"
        )
    return settings, when_full


def prefix_caching(config: model_config_pb2.ModelConfig) -> bool:
    """The ``prefix_caching`` parameter: true (the default) or false; ValueError otherwise."""
    if "prefix_caching" not in config.parameters:
        return True
    text = config.parameters["prefix_caching"].string_value.strip().lower()
    if text not in SWITCH:
        raise ValueError(f"parameters['prefix_caching']: expected true or false, got {text!r}")
    return SWITCH[text]


def build_engine(
    inputs: Sequence[GraphTensor],
    output_names: Sequence[str],
    run: Callable[[Sequence[str], Mapping[str, np.ndarray]], list[np.ndarray]],
    config: model_config_pb2.ModelConfig,
    offload: Offload,
    observe: Callable[[str, float], None] = lambda what, value: None,
) -> GenerationEngine:
    """A started-later engine over a decoder session (``run(outputs, feeds)``)."""
    settings, when_full = engine_settings(config)
    shape = kv_shape(inputs, settings["kv_cache_blocks"], settings["kv_block_tokens"])
    names = list(output_names)

    def decode(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, run(names, feeds), strict=True))

    _, eos = special_ids(config)
    cache = KvCache(shape, prefix_caching(config), observe)
    return GenerationEngine(
        decode, cache, offload, eos, settings["max_positions"],
        max_running=settings["max_running_sequences"], when_full=when_full, observe=observe,
        max_prefill_rows=settings["max_prefill_sequences"],
    )  # fmt: skip


def generation_observer(metrics: ServerMetrics, model: str) -> Callable[[str, float], None]:
    """The engine's and its cache's ``observe`` hook: tokens, time to first token, time per
    output token, prefix-cache lookups, hits and evictions, decode steps carried or gathered."""
    tokens = metrics.generated_tokens.labels(model)
    ttft = metrics.time_to_first_token.labels(model)
    tpot = metrics.time_per_output_token.labels(model)
    counters = {
        "token": tokens,
        "prefix_lookup": metrics.prefix_lookup_tokens.labels(model),
        "prefix_hit": metrics.prefix_hit_tokens.labels(model),
        "prefix_eviction": metrics.prefix_evictions.labels(model),
        "decode_step_carried": metrics.decode_steps.labels(model, "carried"),
        "decode_step_gathered": metrics.decode_steps.labels(model, "gathered"),
    }

    def observe(what: str, value: float) -> None:
        if what == "ttft":
            ttft.observe(value)
        elif what == "tpot":
            tpot.observe(value)
        elif what in counters:
            counters[what].inc(value)

    return observe


def publish_engine(metrics: ServerMetrics, model: str, engine: GenerationEngine | None) -> None:
    """Points the model's KV and sequence gauges at ``engine`` (None: back to 0)."""
    if engine is None:
        gauges = [metrics.kv_blocks_used.labels(model), metrics.kv_blocks_total.labels(model)]
        gauges += [metrics.sequences.labels(model, s) for s in ("running", "waiting")]
        gauges += [metrics.prefix_cached_blocks.labels(model)]
        gauges += [metrics.prefix_prefill_saved.labels(model)]
        for gauge in gauges:
            gauge.set_function(lambda: 0)
        return
    cache, total = engine.cache, engine.cache.shape.total_blocks
    metrics.kv_blocks_used.labels(model).set_function(lambda: cache.used_blocks)
    metrics.kv_blocks_total.labels(model).set_function(lambda: total)
    metrics.sequences.labels(model, "running").set_function(lambda: len(engine.running))
    metrics.sequences.labels(model, "waiting").set_function(lambda: len(engine.waiting))
    metrics.prefix_cached_blocks.labels(model).set_function(lambda: cache.cached_blocks)
    metrics.prefix_prefill_saved.labels(model).set_function(lambda: cache.stats.saved)


def prompt_tokens(request: service_pb2.ModelInferRequest) -> int | None:
    """The tokens a text generation's prompt takes (BOS plus one per byte), None when the
    request is not a text generation. What the tenant's token limit is charged with."""
    if [t.name for t in request.inputs] != [TEXT_INPUT]:
        return None
    if request.raw_input_contents:
        return 1 + max(0, len(request.raw_input_contents[0]) - 4)
    contents = request.inputs[0].contents.bytes_contents
    return 1 + (len(contents[0]) if contents else 0)


def completion_tokens(responses: Sequence[service_pb2.ModelInferResponse]) -> int:
    """The tokens generated in ``responses`` (one per byte of text, and the EOS that ended it)."""
    count = 0
    for response in responses:
        if response.raw_output_contents:
            count += max(0, len(response.raw_output_contents[0]) - 4)
        reason = response.parameters.get("finish_reason")
        if reason is not None and reason.string_param == "eos":
            count += 1
    return count
