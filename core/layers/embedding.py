"""The token embedding, split over ranks by vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pkv.core.distributed.parallel import ShardPlan
from pkv.core.layers.linear import as_tensor, check_shape, take


class VocabEmbedding(nn.Module):
    """Token embedding over this rank's slice of the vocabulary; ranks sum their rows."""

    def __init__(self, hidden: int, plan: ShardPlan) -> None:
        super().__init__()
        self.start, self.count = plan.vocab
        self.tp = plan.tp
        self.weight = nn.Parameter(torch.empty(self.count, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.count)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))

    def load(self, tensor: object, name: str) -> None:
        rows = take(tensor, 0, self.start, self.count) if self.tp.enabled else as_tensor(tensor)
        check_shape(self.weight, rows, name)
        self.weight.copy_(rows)
