"""Mixtral: Mistral (a sliding window on every layer, where set) whose every MLP is a sparse
mixture of experts: a softmax router picks `num_experts_per_tok` of `num_local_experts`
experts per token and always renormalizes their weights; `intermediate_size` is each
expert's width.

Hub checkpoints name the block `block_sparse_moe` with experts `w1` (gate), `w3` (up) and
`w2` (down); SparseMoE reads those names, so only the block is renamed to our `mlp`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pkv.core.layers.ggml_linear import GGMLLinearMethod
from pkv.core.layers.linear import UnquantizedLinearMethod
from pkv.core.layers.moe import SparseMoE
from pkv.core.models.base import BuildContext
from pkv.core.models.config import ModelConfig
from pkv.core.models.llama import MistralForCausalLM


def sparse_moe(cfg: ModelConfig, ctx: BuildContext, renormalize: bool, arch: str,
               float32_weights: bool = False) -> SparseMoE:
    """The MoE block of `cfg`: experts in float, or a GGUF's in their ggml blocks where its
    other linears keep theirs (core/layers/moe.py); AWQ and FP8 experts are refused."""
    if ctx.method is not None and not isinstance(ctx.method, (UnquantizedLinearMethod,
                                                              GGMLLinearMethod)):
        raise ValueError(f"{arch} experts do not run with {ctx.method.name} weights: "
                         f"pkv runs mixture-of-experts models in float only")
    moe = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                    ctx.plan.moe_intermediate, cfg.hidden_act, renormalize, ctx.plan,
                    float32_weights)
    # Where the linears stay in blocks (a GGUF's, a 16-bit folder's), the experts do too
    moe.keeps_16_bit = isinstance(ctx.method, GGMLLinearMethod)
    return moe


class MixtralForCausalLM(MistralForCausalLM):
    """Mistral with a sparse MoE block as every layer's MLP."""

    required_fields = ("intermediate_size", "num_local_experts", "num_experts_per_tok")
    default_rope_theta = 1e6  # transformers' MixtralConfig defaults, where config.json is silent

    @classmethod
    def layer_windows(cls, hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
        # (MixtralConfig's sliding_window defaults to none, and its layers ignore layer_types)
        return (hf.get("sliding_window"),) * num_layers

    @classmethod
    def configure(cls, config: ModelConfig, hf: dict[str, Any]) -> None:
        super().configure(config, hf)
        if "rms_norm_eps" not in hf:
            config.rms_norm_eps = 1e-5
        if hf["num_local_experts"] < 1:
            raise ValueError(f"config field num_local_experts={hf['num_local_experts']} "
                             "must be >= 1")
        config.num_experts = hf["num_local_experts"]
        config.num_experts_per_tok = hf["num_experts_per_tok"]
        config.moe_intermediate_size = config.intermediate_size

    def make_mlp(self, cfg: ModelConfig, i: int, ctx: BuildContext) -> SparseMoE:
        # (transformers' Mixtral scales each expert's output by its float32 weight)
        return sparse_moe(cfg, ctx, renormalize=True, arch="MixtralForCausalLM",
                          float32_weights=True)

    def checkpoint_tensors(self, name: str, tensor: Any) -> Iterable[tuple[str, Any]]:
        yield name.replace(".block_sparse_moe.", ".mlp."), tensor
