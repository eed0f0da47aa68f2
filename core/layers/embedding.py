"""The token embedding, split over ranks by vocabulary."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pkv.core.distributed.parallel import ShardPlan
from pkv.core.layers.ggml_tensor import GGMLTensor
from pkv.core.layers.linear import as_tensor, check_shape, take


class VocabEmbedding(nn.Module):
    """Token embedding over this rank's slice of the vocabulary; ranks sum their rows.

    A table in ggml blocks (a GGUF's token_embd) stays in them: a lookup dequantizes only
    the rows it reads (csrc/ggml_cpu.cpp's ggml_rows)."""

    def __init__(self, hidden: int, plan: ShardPlan) -> None:
        super().__init__()
        self.start, self.count = plan.vocab
        self.tp = plan.tp
        self.weight = nn.Parameter(torch.empty(self.count, hidden))
        self.table: GGMLTensor | None = None
        self.kernel: Any = None  # the CPU kernels, where the table is in ggml blocks

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return self._lookup(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.count)
        out = self._lookup(local.masked_fill(outside, 0))
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            return F.embedding(ids, self.weight)
        table = self.table
        if self.kernel is None:
            rows = table.data[ids.reshape(-1)]
            values = GGMLTensor(rows, table.qtype, table.cols).dequantize()
        else:
            values = self.kernel.ggml_rows(table.data, table.qtype, ids.reshape(-1), table.cols)
        return values.reshape(*ids.shape, table.cols)

    def load(self, tensor: object, name: str) -> None:
        rows = take(tensor, 0, self.start, self.count) if self.tp.enabled else tensor
        if isinstance(rows, GGMLTensor):
            self._keep_blocks(rows, name)
            return
        rows = as_tensor(rows)
        check_shape(self.weight, rows, name)
        self.weight.copy_(rows)

    def _keep_blocks(self, table: GGMLTensor, name: str) -> None:
        from pkv.csrc import cpp_build

        if table.shape != tuple(self.weight.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {table.shape}, the model "
                             f"expects {tuple(self.weight.shape)}")
        self.table = table
        self.register_buffer("blocks", table.data, persistent=False)
        # The float table is not needed (never touched: it held no memory but its address).
        self.weight = nn.Parameter(torch.empty(0, table.cols), requires_grad=False)
        self.kernel = cpp_build.kernels_or_none()
