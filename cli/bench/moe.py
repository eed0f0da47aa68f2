"""`pkv bench moe`: one sparse MoE layer against a dense gated MLP with the same *active*
parameters (intermediate = top_k x the experts' width), per forward, at a few batch sizes.

Both run on random weights in one process, their forwards interleaved (a busy machine
slows both alike); a time is the median of `repeats` forwards after a warm-up. The dense
MLP's float32 linears and the experts' products run on the CPU kernels' f32_linear as the
engine runs them (csrc/gemv_cpu.cpp), so the ratio is the one serving sees.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from pkv.cli.bench.cpu_info import print_cpu_line
from pkv.cli.bench.timing import interleaved_ms
from pkv.core.distributed.parallel import ShardPlan, TPGroup
from pkv.core.layers.linear import Linear
from pkv.core.layers.mlp import GatedMLP
from pkv.core.layers.moe import SparseMoE
from pkv.csrc import cpp_build


class MoeRow(NamedTuple):
    """One batch size: milliseconds per forward of each layer, and MoE / dense."""

    batch: int
    moe_ms: float
    dense_ms: float
    ratio: float


def moe_vs_dense(batch_sizes: Sequence[int] = (1, 64), hidden: int = 1024, num_experts: int = 8,
                 top_k: int = 2, expert_intermediate: int = 512, repeats: int = 50,
                 dtype: torch.dtype = torch.float32, seed: int = 0) -> list[MoeRow]:
    """Time a SparseMoE layer and a dense GatedMLP of `top_k * expert_intermediate` channels
    (the same active parameters) at each batch size; rows in `batch_sizes` order."""
    if min(hidden, num_experts, top_k, expert_intermediate, repeats, *batch_sizes) < 1:
        raise ValueError("every size must be >= 1")
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts}")
    torch.manual_seed(seed)
    width = top_k * expert_intermediate
    plan = ShardPlan(tp=TPGroup(), kv_heads=(0, 1), q_heads=(0, 1), intermediate=(0, width),
                     vocab=(0, 1), vocab_sizes=[1], moe_intermediate=(0, expert_intermediate))
    moe = SparseMoE(hidden, num_experts, top_k, (0, expert_intermediate), "silu", True, plan)
    dense = GatedMLP(hidden, (0, width), "silu", None, plan)
    rows = []
    with torch.inference_mode():
        for module in (moe, dense):
            module.to(dtype)
            for p in module.parameters():
                p.copy_(0.02 * torch.randn(p.shape))
        ops = cpp_build.kernels_or_none() if dtype == torch.float32 else None
        moe.kernel = ops
        for linear in dense.modules():
            if isinstance(linear, Linear):
                linear.kernel = ops
        for batch in batch_sizes:
            x = torch.randn(batch, hidden, dtype=dtype)
            moe_ms, dense_ms = interleaved_ms([lambda: moe(x), lambda: dense(x)], repeats)
            rows.append(MoeRow(batch, moe_ms, dense_ms, moe_ms / dense_ms))
    return rows


def print_moe_vs_dense(console: Any, **options: Any) -> list[MoeRow]:
    """Run `moe_vs_dense(**options)`; print the CPU line and a table of the rows."""
    from rich.table import Table

    rows = moe_vs_dense(**options)
    o = {"hidden": 1024, "num_experts": 8, "top_k": 2, "expert_intermediate": 512, **options}
    print_cpu_line(console, threads=True)
    console.print(f"MoE: top-{o['top_k']} of {o['num_experts']} experts x "
                  f"{o['expert_intermediate']}; dense: x {o['top_k'] * o['expert_intermediate']} "
                  f"(the same active parameters); hidden {o['hidden']}, float32")
    table = Table()
    for column in ("batch", "MoE ms", "dense ms", "MoE / dense"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r.batch), f"{r.moe_ms:.3f}", f"{r.dense_ms:.3f}", f"{r.ratio:.2f}x")
    console.print(table)
    return rows
