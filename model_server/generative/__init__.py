"""Generative models: ``engine`` (continuous batching of sequences, prefill and decode steps,
preemption), ``kv_cache`` (the KV cache in fixed-size blocks), ``text`` (a decoder's text in
and tokens out over KServe v2, its parameters and settings) and ``lm_reference`` (a NumPy
reference of the demo language model, the tests' oracle).
"""
