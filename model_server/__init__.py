"""InferMesh model server: KServe v2 / Triton gRPC inference on ONNX Runtime."""

__version__ = "0.1.0"
