"""A dense (unpaged) forward pass over whole sequences, for calibration and perplexity.

Serving runs attention over the paged KV cache; quantization needs every position of a few
fixed-length samples at once, layer by layer, so it uses torch's SDPA on plain tensors with
the same modules (and so the same weights) as the served model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pkv.core.models.llama import Attention, DecoderLayer, LlamaForCausalLM, RotaryEmbedding


def attention_context(attn: Attention, h: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
    """Causal self-attention of h [B, T, hidden] up to (not including) o_proj: [B, T, H*D]."""
    b, t, _ = h.shape
    q, k, v = attn.qkv_proj(h).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.view(b, t, attn.num_heads, attn.head_dim)
    k = k.view(b, t, attn.num_kv_heads, attn.head_dim)
    v = v.view(b, t, attn.num_kv_heads, attn.head_dim)
    positions = torch.arange(t, device=h.device)
    q, k = rope(positions, q, k)
    groups = attn.num_heads // attn.num_kv_heads
    k, v = (x.repeat_interleave(groups, dim=2) for x in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, scale=attn.scale)
    return out.transpose(1, 2).reshape(b, t, attn.q_size)


def attention_block(layer: DecoderLayer, x: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
    """attn(input_layernorm(x)), without the residual."""
    h = layer.input_layernorm(x)
    return layer.self_attn.o_proj(attention_context(layer.self_attn, h, rope))


def layer_forward(layer: DecoderLayer, x: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
    x = x + attention_block(layer, x, rope)
    return x + layer.mlp(layer.post_attention_layernorm(x))


@torch.no_grad()
def perplexity(model: LlamaForCausalLM, samples: torch.Tensor, batch_size: int = 4) -> float:
    """exp(mean next-token negative log-likelihood) over samples [S, T] of token ids."""
    inner = model.model
    total, count = 0.0, 0
    for batch in samples.split(batch_size):
        x = inner.embed_tokens(batch)
        for layer in inner.layers:
            x = layer_forward(layer, x, inner.rotary_emb)
        logits = model.compute_logits(inner.norm(x)[:, :-1]).float()
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                              reduction="sum")
        total += nll.item()
        count += batch[:, 1:].numel()
    return math.exp(total / count)


def token_samples(token_ids: list[int], num_samples: int, seq_len: int) -> torch.Tensor:
    """Cut a token stream into up to `num_samples` rows of `seq_len` tokens ([S, T])."""
    rows = min(num_samples, len(token_ids) // seq_len)
    if rows == 0:
        raise ValueError(f"the text has {len(token_ids)} tokens, fewer than one sample of "
                         f"{seq_len}: give more text (or, for --calib, a smaller "
                         "--calib-seq-len)")
    return torch.tensor(token_ids[:rows * seq_len]).view(rows, seq_len)
