"""InferMesh project-wide helpers (environment doctor)."""
