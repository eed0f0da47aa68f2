"""AWQ (activation-aware weight quantization) of a Llama-family model, in float32 torch.

Per decoder layer, on calibration activations:
1. For each group of linears that read the same input (q/k/v after input_layernorm,
   gate/up after post_attention_layernorm, o after v, down after up), grid-search per-input-
   channel scales s = mean|x|^alpha that minimize the block's output error once the weights
   are fake-quantized; fold 1/s into the preceding norm or linear and s into the weights.
2. Optionally search, per output channel and group, how far to clip the weights.
3. Feed the (float, rescaled) layer's output to the next layer.
Finally every linear is quantized to 4-bit codes and packed in AutoAWQ's GEMM layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pkv.core.layers.linear import Linear
from pkv.core.models.llama import DecoderLayer, LlamaForCausalLM, RotaryEmbedding
from pkv.plugins.weights.awq import pack_int4
from pkv.quantize.checkpoint import quantizable_weights, unquantized_tensors
from pkv.quantize.dense import attention_block, attention_context, layer_forward

MAX_CODE = 15
N_GRID = 20
CLIP_MAX_SHRINK = 0.5
CLIP_TOKENS = 512


@dataclass(frozen=True)
class AWQSettings:
    group_size: int
    zero_point: bool = True
    clip: bool = True


def quantize_groups(w: torch.Tensor, group: int,
                    zero_point: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit codes of w [N, K] per group of `group` inputs.

    Returns (codes [N, K] in 0..15, scales [N, K/G] rounded to float16, zeros [N, K/G]).
    """
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    if zero_point:
        hi, lo = wg.amax(-1), wg.amin(-1)
        scales = ((hi - lo).clamp(min=1e-5) / MAX_CODE).half().float()
        zeros = (-lo / scales).round().clamp(0, MAX_CODE)
    else:  # symmetric: codes -8..7 stored with a fixed zero point of 8
        scales = (wg.abs().amax(-1).clamp(min=1e-5) / 7).half().float()
        zeros = torch.full_like(scales, 8.0)
    codes = ((wg / scales[..., None]).round() + zeros[..., None]).clamp(0, MAX_CODE)
    return codes.reshape(n, k), scales, zeros


def fake_quantize(w: torch.Tensor, group: int, zero_point: bool) -> torch.Tensor:
    """w after a 4-bit round trip (what the quantized model will compute with)."""
    codes, scales, zeros = quantize_groups(w, group, zero_point)
    n, k = w.shape
    deq = (codes.reshape(n, k // group, group) - zeros[..., None]) * scales[..., None]
    return deq.reshape(n, k).to(w.dtype)


def pack_awq(w: torch.Tensor, group: int, zero_point: bool) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM tensors of w [N, K]: qweight [K, N/8], qzeros [K/G, N/8], scales."""
    codes, scales, zeros = quantize_groups(w, group, zero_point)
    return {"qweight": pack_int4(codes.t().to(torch.int32)),
            "qzeros": pack_int4(zeros.t().to(torch.int32)),
            "scales": scales.t().contiguous().half()}


def _mse(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).float().pow(2).mean().item()


@torch.no_grad()
def search_scales(weights: list[torch.Tensor], x: torch.Tensor, block: Callable[[], torch.Tensor],
                  s: AWQSettings) -> tuple[torch.Tensor, float, float]:
    """Best per-input-channel scales for the linears `weights` ([N_i, K] views, changed in
    place during the search and restored), judged by `block`'s output error.

    Returns (scales [K], error at the best scales, error of plain round-to-nearest).
    """
    x_mean = x.abs().reshape(-1, x.shape[-1]).float().mean(0)
    reference = block()
    originals = [w.clone() for w in weights]
    best, best_scales, rtn_error = float("inf"), torch.ones_like(x_mean), float("nan")
    for i in range(N_GRID):
        scales = x_mean.pow(i / N_GRID).clamp(min=1e-4)
        scales = scales / (scales.max() * scales.min()).sqrt()
        for w, orig in zip(weights, originals):
            w.copy_(fake_quantize(orig * scales, s.group_size, s.zero_point) / scales)
        error = _mse(block(), reference)
        if i == 0:
            rtn_error = error  # alpha = 0: every scale is 1
        if error < best:
            best, best_scales = error, scales.clone()
    for w, orig in zip(weights, originals):
        w.copy_(orig)
    return best_scales, best, rtn_error


@torch.no_grad()
def search_clip(w: torch.Tensor, x: torch.Tensor, s: AWQSettings) -> torch.Tensor:
    """Clip w [N, K] per output channel and group to the range that best preserves x @ w^T."""
    n, k = w.shape
    g = s.group_size
    tokens = x.reshape(-1, k)
    tokens = tokens[torch.linspace(0, len(tokens) - 1, min(CLIP_TOKENS, len(tokens))).long()]
    xg = tokens.reshape(len(tokens), k // g, g)
    wg = w.reshape(n, k // g, g)
    reference = torch.einsum("tgj,ngj->ntg", xg, wg)
    max0 = wg.abs().amax(-1, keepdim=True)
    best_max, best_err = max0.clone(), torch.full((n, k // g), float("inf"))
    for i in range(int(CLIP_MAX_SHRINK * N_GRID)):
        bound = max0 * (1 - i / N_GRID)
        clipped = torch.maximum(torch.minimum(wg, bound), -bound).reshape(n, k)
        q = fake_quantize(clipped, g, s.zero_point).reshape(n, k // g, g)
        err = (torch.einsum("tgj,ngj->ntg", xg, q) - reference).pow(2).mean(1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better[..., None], bound, best_max)
    return torch.maximum(torch.minimum(wg, best_max), -best_max).reshape(n, k)


@torch.no_grad()
def _apply_scales(scales: torch.Tensor, linears: list[Linear], prev: nn.Module,
                  prev_rows: slice | None) -> None:
    """Fold 1/scales into the output of `prev` (a norm, or rows of a linear) and scales into
    the inputs of `linears`: the float function is unchanged."""
    if prev_rows is None:
        prev.weight.div_(scales)
    else:
        prev.weight[prev_rows] /= scales[:, None]
        if prev.bias is not None:
            prev.bias[prev_rows] /= scales
    for linear in linears:
        linear.weight.mul_(scales)


@dataclass
class LayerReport:
    """Block output error with AWQ scales vs plain round-to-nearest, per group."""

    awq_error: dict[str, float]
    rtn_error: dict[str, float]


@torch.no_grad()
def quantize_layer(layer: DecoderLayer, x: torch.Tensor, rope: RotaryEmbedding,
                   s: AWQSettings) -> LayerReport:
    """Search and fold AWQ scales (and clipping) into one layer, given its input x [B, T, H]."""
    attn, mlp = layer.self_attn, layer.mlp
    report = LayerReport({}, {})

    def search(name: str, weights: list[torch.Tensor], inp: torch.Tensor,
               block: Callable[[], torch.Tensor], linears: list[Linear], prev: nn.Module,
               prev_rows: slice | None) -> None:
        scales, report.awq_error[name], report.rtn_error[name] = search_scales(
            weights, inp, block, s)
        _apply_scales(scales, linears, prev, prev_rows)

    h = layer.input_layernorm(x)
    search("qkv", [attn.qkv_proj.weight], h, lambda: attention_block(layer, x, rope),
           [attn.qkv_proj], layer.input_layernorm, None)
    if attn.q_size == attn.kv_size:  # v feeds o channel for channel only without GQA
        ctx = attention_context(attn, layer.input_layernorm(x), rope)
        search("o", [attn.o_proj.weight], ctx, lambda: attn.o_proj(ctx), [attn.o_proj],
               attn.qkv_proj, attn.qkv_proj.shard_rows(2))
    mid = x + attention_block(layer, x, rope)
    h2 = layer.post_attention_layernorm(mid)
    search("gate_up", [mlp.gate_up_proj.weight], h2, lambda: mlp(h2), [mlp.gate_up_proj],
           layer.post_attention_layernorm, None)
    gate, up = mlp.gate_up_proj(h2).chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) * up
    search("down", [mlp.down_proj.weight], act, lambda: mlp.down_proj(act), [mlp.down_proj],
           mlp.gate_up_proj, mlp.gate_up_proj.shard_rows(1))
    if s.clip:
        _clip_layer(layer, x, rope, s)
    return report


def _clip_layer(layer: DecoderLayer, x: torch.Tensor, rope: RotaryEmbedding,
                s: AWQSettings) -> None:
    # q and k are left unclipped: their errors pass through softmax, which the per-linear
    # output error does not see.
    attn, mlp = layer.self_attn, layer.mlp
    h = layer.input_layernorm(x)
    v_rows = attn.qkv_proj.shard_rows(2)
    attn.qkv_proj.weight[v_rows] = search_clip(attn.qkv_proj.weight[v_rows], h, s)
    ctx = attention_context(attn, h, rope)
    attn.o_proj.weight.copy_(search_clip(attn.o_proj.weight, ctx, s))
    h2 = layer.post_attention_layernorm(x + attention_block(layer, x, rope))
    mlp.gate_up_proj.weight.copy_(search_clip(mlp.gate_up_proj.weight, h2, s))
    gate, up = mlp.gate_up_proj(h2).chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) * up
    mlp.down_proj.weight.copy_(search_clip(mlp.down_proj.weight, act, s))


@torch.no_grad()
def awq_quantize(model: LlamaForCausalLM, samples: torch.Tensor, s: AWQSettings,
                 on_layer: Callable[[int, LayerReport], None] | None = None) -> None:
    """Rescale (and clip) every decoder layer of a float32 model in place, layer by layer."""
    inner = model.model
    x = inner.embed_tokens(samples).float()
    for i, layer in enumerate(inner.layers):
        report = quantize_layer(layer, x, inner.rotary_emb, s)
        x = layer_forward(layer, x, inner.rotary_emb)
        if on_layer:
            on_layer(i, report)


def checkpoint_tensors(model: LlamaForCausalLM, s: AWQSettings) -> dict[str, torch.Tensor]:
    """Every tensor of the AWQ checkpoint, under Hugging Face names."""
    tensors = unquantized_tensors(model)
    for name, weight in quantizable_weights(model):
        for leaf, t in pack_awq(weight, s.group_size, s.zero_point).items():
            tensors[f"{name}.{leaf}"] = t
    return tensors
