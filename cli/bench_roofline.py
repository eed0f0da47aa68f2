"""`pkv bench --roofline`: the float32 GEMM roofline of one decode step, measured here.

For a batch of B sequences a decode step multiplies B rows through every linear layer of the
model and its LM head. This times exactly those GEMMs (the model's own shapes, one weight
copy per layer so the weights stream from memory as in a real step), with both GEMMs torch
has on CPU (MKL on plain weights, oneDNN on packed ones), and keeps the faster per shape.
B / that time is the throughput a step made of nothing but GEMMs would reach: attention,
norms, sampling and the engine all come on top, so a real engine stays below it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from pkv.core.model_config import ModelConfig
from pkv.core.progress import make_progress


@dataclass(frozen=True)
class GemmShape:
    name: str
    in_features: int
    out_features: int
    count: int  # how many times a step multiplies by a weight of this shape


@dataclass
class Roofline:
    batch: int
    step_s: float  # the GEMMs of one decode step
    flops: float  # per step

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_s

    @property
    def gflops_per_s(self) -> float:
        return self.flops / self.step_s / 1e9


def gemm_shapes(cfg: ModelConfig) -> list[GemmShape]:
    """The linear layers of a Llama-family decode step (q/k/v and gate/up fused, as pkv runs
    them)."""
    h, d, layers = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    return [GemmShape("qkv", h, q + 2 * kv, layers), GemmShape("o", q, h, layers),
            GemmShape("gate_up", h, 2 * cfg.intermediate_size, layers),
            GemmShape("down", cfg.intermediate_size, h, layers),
            GemmShape("lm_head", h, cfg.vocab_size, 1)]


def _best_time(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm up (oneDNN builds its primitive on the first call)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _shape_time(shape: GemmShape, batch: int, repeat: int) -> float:
    """Seconds for `count` GEMMs of this shape at `batch` rows, each on its own weight."""
    weights = [torch.randn(shape.out_features, shape.in_features) for _ in range(shape.count)]
    x = torch.randn(batch, shape.in_features)
    mkl = _best_time(lambda: [F.linear(x, w) for w in weights], repeat)
    if not torch.backends.mkldnn.is_available():
        return mkl
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, batch_size=16) for w in weights]
    del weights
    onednn = _best_time(lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                                 for w in packed], repeat)
    return min(mkl, onednn)


@torch.inference_mode()
def measure(cfg: ModelConfig, batches: list[int], repeat: int = 3) -> dict[int, Roofline]:
    """The GEMM roofline of a decode step at each batch size."""
    shapes = gemm_shapes(cfg)
    results = {}
    with make_progress() as progress:
        task = progress.add_task("GEMM roofline", total=len(batches) * len(shapes), info="")
        for batch in batches:
            step_s = flops = 0.0
            for shape in shapes:
                progress.update(task, info=f"batch {batch}: {shape.name}")
                step_s += _shape_time(shape, batch, repeat)
                flops += 2.0 * batch * shape.in_features * shape.out_features * shape.count
                progress.advance(task)
            results[batch] = Roofline(batch, step_s, flops)
    return results
