"""InferMesh xDS control plane (see issue 3)."""
