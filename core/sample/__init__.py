"""Sampling: per-request `SamplingParams`, the batched `Sampler`, and the rejection sampler
that verifies speculative tokens. May import structured_output and below.
"""
