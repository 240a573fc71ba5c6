"""The wire protocols: ``service`` (the KServe v2 / Triton GRPCInferenceService, and the one
request path every inference takes), ``rest`` and ``rest_codec`` (KServe v2 HTTP/REST, turned
into the same calls), ``statistics`` (ModelStatistics) and ``admin_http`` (the plaintext
readiness and metrics port, and the fault drills' endpoint).
"""
