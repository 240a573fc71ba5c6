"""Front ends and an engine (``--frontends N``, N > 1): N processes share the public gRPC port
and do the per-request gRPC work (HTTP/2, decoding, encoding); one engine process holds the
models, the batcher and the generation engine, and serves them over a private channel.

``wire`` (the private channel's frames), ``pool`` (the shared-memory pool tensors cross in),
``private`` (the 0700 directory, the reserved port), ``frontend`` and ``proxy`` (the front-end
process), ``channel`` and ``supervisor`` (the engine's side). The front-end modules import
neither ONNX Runtime nor the model repository: a front end holds no model.
"""
