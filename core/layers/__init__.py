"""Building blocks shared by the model families in `core/models/`: linear layers and their
quantization interface (`LinearMethod`, the int8 method of the LM head), the attention backend
interface and the attention layer over the paged KV cache, the KV cache's row formats
(`kv_format`) and layer groups (`kv_groups`), norms, rotary embeddings, gated MLPs,
mixtures of experts and the embedding.

A family file composes these and states only how it differs from Llama; nothing here knows
which family it serves. May import distributed, config and kernels (never models).
"""
