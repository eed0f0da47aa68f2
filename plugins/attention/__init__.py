"""Attention backends over the paged KV cache: `torch` (the reference), `cpu` (the C++ kernel in
csrc/) and `triton` (CUDA and ROCm; CPU under TRITON_INTERPRET=1 for tests).
"""
