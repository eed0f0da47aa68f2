"""Qwen3-MoE: Qwen3's attention; the MLP of layer i is a sparse mixture of experts when
`i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0`,
else a dense gated MLP of `intermediate_size`. The softmax router's top-k weights are
renormalized iff `norm_topk_prob`; each expert is `moe_intermediate_size` wide.

transformers 5.x writes the expert count as `num_local_experts`, Hub configs as
`num_experts`; both are read. Unlike Qwen3, a window (`use_sliding_window`) applies to
every layer, as transformers' Qwen3-MoE does.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pkv.core.models.base import BuildContext
from pkv.core.models.config import ModelConfig
from pkv.core.models.mixtral import sparse_moe
from pkv.core.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3 with sparse MoE MLPs on the layers `is_sparse` names."""

    required_fields = ("intermediate_size", "num_experts_per_tok", "moe_intermediate_size")

    @classmethod
    def configure(cls, config: ModelConfig, hf: dict[str, Any]) -> None:
        super().configure(config, hf)
        experts = hf.get("num_experts")
        experts = hf.get("num_local_experts") if experts is None else experts
        if experts is None:
            raise ValueError("config of Qwen3MoeForCausalLM lacks the field 'num_experts'")
        if experts < 0:
            raise ValueError(f"config field num_experts={experts} must be >= 0")
        if _sparse_step(hf) < 1:
            raise ValueError(f"config field decoder_sparse_step={_sparse_step(hf)} must be >= 1")
        config.num_experts = experts
        config.num_experts_per_tok = hf["num_experts_per_tok"]
        config.moe_intermediate_size = hf["moe_intermediate_size"]

    @classmethod
    def layer_windows(cls, hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
        return ((hf.get("sliding_window") if hf.get("use_sliding_window") else None),) * num_layers

    @staticmethod
    def is_sparse(cfg: ModelConfig, i: int) -> bool:
        """Whether layer i's MLP is a mixture of experts (transformers' rule)."""
        return (i not in (cfg.hf.get("mlp_only_layers") or []) and cfg.num_experts > 0
                and (i + 1) % _sparse_step(cfg.hf) == 0)

    def make_mlp(self, cfg: ModelConfig, i: int, ctx: BuildContext) -> nn.Module:
        if not self.is_sparse(cfg, i):
            return super().make_mlp(cfg, i, ctx)
        return sparse_moe(cfg, ctx, bool(cfg.hf.get("norm_topk_prob", False)),
                          arch="Qwen3MoeForCausalLM")


def _sparse_step(hf: dict[str, Any]) -> int:
    step = hf.get("decoder_sparse_step")
    return 1 if step is None else step
