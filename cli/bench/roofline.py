"""`pkv bench --roofline`: the float32 GEMM roofline of a decode step and of a prefill,
measured here.

For a batch of B sequences a decode step multiplies B rows through every linear layer of the
model and its LM head. This times exactly those GEMMs (the model's own shapes, one weight
copy per layer so the weights stream from memory as in a real step), with both GEMMs torch
has on CPU (MKL on plain weights, oneDNN on packed ones) and, at the few rows it takes, the
kernels' float32 GEMV (csrc/gemv_cpu.cpp), and keeps the fastest per shape.
B / that time is the throughput a step made of nothing but GEMMs would reach: attention,
norms, sampling and the engine all come on top, so a real engine stays below it.

That roofline's GEMMs are in turn judged against the CPU itself: `fma_peak_gflops` is the
float32 multiply-add rate all threads reach on independent chains (csrc/peak_cpu.cpp, in the
kernels' ISA flavour), the most any float32 GEMM could do here. GEMMs near it leave lower
precision as the only way up.

A prefill's roofline counts its FLOPs: the linears at the rows of each chunk the scheduler
runs (`max_num_batched_tokens`), the LM head on each prompt's last token, and causal
attention (QK^T and PV: 4 x head_dim x heads multiply-adds per query per key it sees), all at
the FLOP rate the linears' GEMMs reach at that chunk size. Prompt tokens / that time is what a
prefill made of nothing but GEMM-speed matrix products would reach.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from pkv.core.models.config import ModelConfig
from pkv.core.progress import make_progress
from pkv.csrc import cpp_build


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


# Rounds of twelve multiply-add chains a thread runs per peak measurement (~0.2 s).
PEAK_ITERS = 100_000_000


def fma_peak_gflops(repeat: int = 3) -> float | None:
    """The float32 multiply-add peak of this CPU over torch's threads, as the CPU kernels'
    flavour reaches it; best of `repeat`. None where the kernels did not build."""
    ext = cpp_build.kernels_or_none()
    if ext is None:
        return None
    ext.fma_peak_gflops(PEAK_ITERS // 100)  # threads started, clocks up
    return max(ext.fma_peak_gflops(PEAK_ITERS) for _ in range(repeat))


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
    best = _best_time(lambda: [F.linear(x, w) for w in weights], repeat)
    ext = cpp_build.kernels_or_none()
    if ext is not None and batch <= ext.f32_gemv_max_rows:
        none = torch.empty(0)
        best = min(best, _best_time(lambda: [ext.f32_gemv(x, w, none) for w in weights], repeat))
    if not torch.backends.mkldnn.is_available():
        return best
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, batch_size=16) for w in weights]
    del weights
    onednn = _best_time(lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                                 for w in packed], repeat)
    return min(best, onednn)


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


@dataclass
class PrefillRoofline:
    tokens: int
    step_s: float  # the whole prefill at GEMM speed
    flops: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s


def _chunks(prompt_lens: list[int], chunk: int) -> list[int]:
    """The rows of each prefill step: the prompts back to back, `chunk` tokens a step."""
    total = sum(prompt_lens)
    return [min(chunk, total - start) for start in range(0, total, chunk)]


def attention_flops(cfg: ModelConfig, prompt_len: int) -> float:
    """Causal attention FLOPs of one prompt over all layers (no sliding window)."""
    keys_seen = prompt_len * (prompt_len + 1) / 2
    return 4.0 * cfg.head_dim * cfg.num_attention_heads * keys_seen * cfg.num_hidden_layers


@torch.inference_mode()
def measure_prefill(cfg: ModelConfig, prompt_lens: list[int], chunk: int,
                    repeat: int = 3) -> PrefillRoofline:
    """The GEMM roofline of prefilling these prompts in steps of `chunk` tokens."""
    linears = [s for s in gemm_shapes(cfg) if s.name != "lm_head"]
    head = next(s for s in gemm_shapes(cfg) if s.name == "lm_head")
    flops_per_row = sum(2.0 * s.in_features * s.out_features * s.count for s in linears)
    steps = _chunks(prompt_lens, chunk)
    rate: dict[int, float] = {}  # FLOP/s of the linears at each chunk size
    with make_progress() as progress:
        task = progress.add_task("prefill roofline", total=len(set(steps)), info="")
        for rows in sorted(set(steps)):
            # Prefill GEMMs are compute-bound: time one weight per shape, count it `count` times.
            seconds = sum(_shape_time(GemmShape(s.name, s.in_features, s.out_features, 1), rows,
                                      repeat) * s.count for s in linears)
            rate[rows] = rows * flops_per_row / seconds
            progress.advance(task)
    linear_s = sum(rows * flops_per_row / rate[rows] for rows in steps)
    # Attention and the LM head at the rate of the largest chunk's GEMMs.
    other = (sum(attention_flops(cfg, n) for n in prompt_lens)
             + 2.0 * len(prompt_lens) * head.in_features * head.out_features)
    return PrefillRoofline(sum(prompt_lens), linear_s + other / rate[max(steps)],
                           sum(steps) * flops_per_row + other)
