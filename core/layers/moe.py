"""A sparse mixture of experts: a softmax router picks `top_k` experts per token; each
expert is a gated MLP.

The step's tokens are grouped by expert (a stable sort of the (token, expert) pairs), so
each active expert runs one GEMM pair over all its tokens: the Python loop is over the
experts a step uses, never over tokens. Under tensor parallelism every rank holds a slice
of every expert's intermediate channels, as a dense MLP is split, and the partial outputs
are summed.

Checkpoints store experts either one module per expert (`experts.3.gate_proj.weight`,
Mixtral's `experts.3.w1.weight`) or stacked (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]); both load.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from pkv.core.distributed.parallel import ShardPlan
from pkv.core.layers.ggml_linear import sixteen_bit_blocks
from pkv.core.layers.ggml_tensor import GGMLTensor
from pkv.core.layers.linear import as_tensor, check_shape, take
from pkv.core.layers.mlp import ACTIVATIONS, check_activation

# per-expert checkpoint names -> our part
_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down",
          "w1": "gate", "w3": "up", "w2": "down"}


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int,
                 intermediate: tuple[int, int], act: str, renormalize: bool,
                 plan: ShardPlan, float32_weights: bool = False) -> None:
        """`intermediate` is this rank's (start, count) of each expert's channels;
        `float32_weights`: the routing weights stay float32 and scale the experts' outputs in
        float32, rounded once (Mixtral's), not rounded to a 16-bit compute dtype first
        (Qwen3-MoE's)."""
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.float32_weights = float32_weights
        self.start, self.size = intermediate
        self.tp = plan.tp
        self.act = check_activation(act)
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.size))
        self.kernel: Any = None  # the CPU kernels (float32): their f32_linear per expert
        # A GGUF's experts in their ggml blocks, (part, expert) -> this rank's slice, and the
        # kernels that multiply them (csrc/ggml_cpu.cpp); empty for float experts.
        self.expert_blocks: dict[tuple[str, int], GGMLTensor] = {}
        self.block_kernel: Any = None
        self._block_types: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._loaded: set[tuple[str, int]] = set()
        self._float_parts = False  # an expert tensor of this layer came (or went) float
        # A 16-bit checkpoint's experts kept as float16 / bfloat16 blocks (the model sets it
        # where its linears keep their 16 bits), not widened to float32.
        self.keeps_16_bit = False

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids), both [T, top_k]."""
        logits = self.gate(x)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float32_weights else weights.to(x.dtype)), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        flat = experts.flatten()  # [T * top_k]
        order = torch.argsort(flat, stable=True)
        token = order // self.top_k  # the token of each (token, expert) pair, grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        grouped = x[token]  # [T * top_k, hidden]
        out = torch.empty_like(grouped)
        start = 0
        act = ACTIVATIONS[self.act]
        for e, n in enumerate(counts):
            if n == 0:
                continue
            out[start:start + n] = self._expert(e, grouped[start:start + n], act)
            start += n
        out = (out * weights.flatten()[order].unsqueeze(-1)).to(x.dtype)
        y = torch.zeros_like(x).index_add_(0, token, out)
        return self.tp.all_reduce(y)

    def _expert(self, e: int, x: torch.Tensor, act: Any) -> torch.Tensor:
        """Expert e's gated MLP of its rows x [n, hidden]."""
        if self.expert_blocks:
            return self._block_expert(e, x, act)
        if self.kernel is not None and x.dtype == torch.float32:
            # The CPU kernels' float32 linear: a GEMV for the few rows an expert mostly gets,
            # a GEMM above (torch.mm is MKL's, which runs its generic code on AMD CPUs).
            h = self.kernel.f32_linear(x, self.w13[e], None)  # [n, 2 * size]
            return self.kernel.f32_linear(act(h[:, :self.size]) * h[:, self.size:], self.w2[e],
                                          None)
        # W @ x^T rather than x @ W^T: with ~16 rows per expert MKL runs this form ~1.5x
        # faster on CPU, the whole layer ~25% (`pkv bench moe`, batch 64)
        h = torch.mm(self.w13[e], x.t())  # [2 * size, n]
        return torch.mm(self.w2[e], act(h[:self.size]) * h[self.size:]).t()

    def _block_expert(self, e: int, x: torch.Tensor, act: Any) -> torch.Tensor:
        blocks, kernel = self.expert_blocks, self.block_kernel
        gate, up, down = blocks[("gate", e)], blocks[("up", e)], blocks[("down", e)]
        if e not in self._block_types:  # made once, not every step
            self._block_types[e] = (torch.tensor([gate.qtype, up.qtype]),
                                    torch.tensor([down.qtype]))
        gate_up_types, down_types = self._block_types[e]
        h = kernel.ggml_linear(x.float().contiguous(), [gate.data, up.data], gate_up_types, None)
        h = (act(h[:, :self.size]) * h[:, self.size:]).contiguous()
        return kernel.ggml_linear(h, [down.data], down_types, None).to(x.dtype)

    # --- loading -------------------------------------------------------------------------

    def load_checkpoint(self, rest: str, tensor: Any, name: str) -> None:
        """Load `rest` (the checkpoint name after this module's path)."""
        if rest == "gate.weight":
            self._copy(self.gate.weight, as_tensor(tensor), name)
            self._loaded.add(("gate", -1))
            return
        match = re.fullmatch(r"experts\.(\d+)\.(\w+)\.weight", rest)
        if match and match.group(2) in _PARTS and int(match.group(1)) < self.num_experts:
            e = int(match.group(1))
            self._load_part(_PARTS[match.group(2)], e, tensor, name, expert_dim=None)
            return
        if rest in ("experts.gate_up_proj", "experts.down_proj"):
            for e in range(self.num_experts):
                part = "down" if rest.endswith("down_proj") else "gate_up"
                self._load_part(part, e, tensor, name, expert_dim=0)
            return
        raise ValueError(f"checkpoint tensor {name!r} has no place in the model")

    def _load_part(self, part: str, e: int, tensor: Any, name: str,
                   expert_dim: int | None) -> None:
        # One expert's whole tensor (a stacked checkpoint: its row of the stack), then this
        # rank's channels of it.
        # A layer's experts are all in blocks or all float: a GGUF can hold some of them
        # float (16-bit rows too short for whole blocks), in any order.
        if isinstance(tensor, GGMLTensor) and part in ("gate", "up", "down"):
            if not self._float_parts:
                self._keep_blocks(part, e, tensor, name)
                return
            tensor = tensor.dequantize()
        t = as_tensor(take(tensor, 0, e, 1))[0] if expert_dim is not None else as_tensor(tensor)
        if not isinstance(tensor, GGMLTensor) and self._sixteen_bit_blocks(part, e, t, name):
            return
        if self.expert_blocks:
            self._unblock()
        self._float_parts = True
        s, n = self.start, self.size
        if part == "down":
            self._copy(self.w2[e], t[:, s:s + n], name)
            self._loaded.add(("down", e))
            return
        if part == "gate_up":
            half = t.shape[0] // 2
            pieces = {"gate": t[s:s + n], "up": t[half + s:half + s + n]}
        else:
            pieces = {part: t[s:s + n]}
        for piece, rows in pieces.items():
            i = 0 if piece == "gate" else 1
            self._copy(self.w13[e, i * n:(i + 1) * n], rows, name)
            self._loaded.add((piece, e))

    def _sixteen_bit_blocks(self, part: str, e: int, t: torch.Tensor, name: str) -> bool:
        """Keep expert `e`'s 16-bit `part` (gate_up: both halves) as blocks, where whole
        32-value blocks make its rows; False: it goes float."""
        if not self.keeps_16_bit or self._float_parts or self.start % 32 or self.size % 32:
            return False  # (and a rank's slice must be whole blocks)
        half = t.shape[0] // 2
        pieces = {"gate": t[:half], "up": t[half:]} if part == "gate_up" else {part: t}
        blocks = {piece: sixteen_bit_blocks(rows.contiguous()) for piece, rows in pieces.items()}
        if not all(isinstance(b, GGMLTensor) for b in blocks.values()):
            return False
        for piece, rows in blocks.items():
            self._keep_blocks(piece, e, rows, name)
        return True

    def _keep_blocks(self, part: str, e: int, tensor: GGMLTensor, name: str) -> None:
        """A GGUF expert tensor kept in its blocks: this rank's channels (rows of gate / up,
        whole-block columns of down)."""
        from pkv.csrc import cpp_build

        if not self.expert_blocks:
            self.block_kernel = cpp_build.kernels_or_none()
            if self.block_kernel is None:  # nothing multiplies blocks here: float experts
                self.expert_blocks = {}
                self._load_part(part, e, tensor.dequantize(), name, expert_dim=None)
                return
            # the float stacks are never used (never touched, so never resident either)
            self.w13 = nn.Parameter(torch.empty(0), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(0), requires_grad=False)
        s, n = self.start, self.size
        rows = tensor.narrow(1, s, n) if part == "down" else tensor.narrow(0, s, n)
        wanted = (self.gate.in_features, n) if part == "down" else (n, self.gate.in_features)
        if rows.shape != wanted:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tensor.shape}, the model "
                             f"expects {wanted} per rank")
        self.expert_blocks[(part, e)] = rows
        self.register_buffer(f"blocks_{part}_{e}", rows.data, persistent=False)
        self._loaded.add((part, e))

    def _unblock(self) -> None:
        """The experts kept in blocks so far, widened into the float stacks."""
        n, hidden = self.size, self.gate.in_features
        dtype = self.gate.weight.dtype
        self.w13 = nn.Parameter(torch.empty(self.num_experts, 2 * n, hidden, dtype=dtype),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_experts, hidden, n, dtype=dtype),
                               requires_grad=False)
        blocks, self.expert_blocks = self.expert_blocks, {}
        for (part, e), rows in blocks.items():
            delattr(self, f"blocks_{part}_{e}")
            values = rows.dequantize()
            if part == "down":
                self.w2.data[e].copy_(values)
            else:
                i = 0 if part == "gate" else 1
                self.w13.data[e, i * n:(i + 1) * n].copy_(values)

    @staticmethod
    def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
        check_shape(param, tensor, name)
        param.copy_(tensor)

    def missing(self) -> list[str]:
        """What the checkpoint did not fill (empty once complete)."""
        need = {("gate", -1)} | {(p, e) for e in range(self.num_experts)
                                 for p in ("gate", "up", "down")}
        return sorted(f"{p}[{e}]" for p, e in need - self._loaded)
