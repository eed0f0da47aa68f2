"""`cpu` attention backend: a C++ kernel (csrc/paged_attention_cpu.cpp) that writes the
step's K/V into their slots and reads K/V straight through the block tables, built once (with
the other CPU kernels, for this CPU's ISA flavour) and cached."""

from __future__ import annotations

from typing import Any

import torch

from pkv.core.layers.attention_backend import AttentionMetadata
from pkv.csrc import cpp_build
from pkv.plugins.attention.torch_backend import TorchAttentionBackend

def unusable_reasons(device: str) -> list[str]:
    """Why the kernel cannot be built here (empty: it can)."""
    return cpp_build.unusable_reasons()


def load_kernel() -> Any:
    return cpp_build.kernels()


class CPUAttentionBackend(TorchAttentionBackend):
    """float32 paged attention in C++ over float32, bfloat16, float16, int8 or fp8 caches
    (queries of other dtypes use the torch reference path)."""

    name = "cpu"

    def __init__(self) -> None:
        self.kernel = load_kernel()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        if q.dtype != torch.float32 or q.device.type != "cpu":
            return super().forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window,
                                   logits_soft_cap)
        # q, k and v may be views of one fused qkv output: the kernel reads strided rows and
        # writes k/v into their slots itself.
        out = torch.empty(q.shape, dtype=q.dtype)
        self.kernel.paged_attention(out, q, k, v, k_cache, v_cache, meta.slot_mapping,
                                    meta.block_tables, meta.seq_ids, meta.kv_lens, scale,
                                    sliding_window or 0, logits_soft_cap or 0.0)
        return out
