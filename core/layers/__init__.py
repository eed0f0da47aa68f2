"""Building blocks shared by the model families in `core/models/`: norms, rotary embeddings,
attention over the paged KV cache, gated MLPs, mixtures of experts and the embedding.

A family file composes these and states only how it differs from Llama; nothing here knows
which family it serves.
"""
