"""What a model is and how one tensor request is checked and run, with no serving policy.

``errors`` (InferenceError and its gRPC codes), ``datatypes`` (KServe types to NumPy and ONNX),
``model_config`` (config.pbtxt: inputs, outputs, instances, dynamic batching), ``validation``
(a request's tensors against the model, and its priority and timeout), ``memory`` (the guard
that refuses a load that would not fit), ``runtime`` (ONNX Runtime sessions and the device),
``faults`` (the injected latency and errors of fault drills). Every other package builds on
these; they import none of them.
"""
