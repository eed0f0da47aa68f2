"""`pkv bench kernels`: the CPU linear kernels of one model shape, per ISA flavour and row
count: a decoder layer's four 4-bit AWQ linears (qkv, o, gate_up, down) and the int8 LM head,
each beside the float32 linears of the same shape, run as the engine runs them
(`Linear.forward` on the flavour's kernels: the GEMV up to the kernels' row limits, the GEMM
above).

The weights are random, in the real layouts: AWQ codes repacked by the loader's own
`process_weights_after_loading`, the head quantized by `Int8LinearMethod.convert`. A decode
step streams every weight from memory, so each kernel rotates over enough copies of its
weights to pass `footprint_mib` (beyond a server CPU's L3): the times are from memory, not
from cache. Quantized and float calls alternate (`interleaved_ms`), so a busy machine slows
both alike.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pkv.cli.bench.cpu_info import print_cpu_line
from pkv.cli.bench.timing import interleaved_ms
from pkv.core.layers.int8_linear import Int8LinearMethod
from pkv.core.layers.linear import Linear
from pkv.csrc import cpp_build
from pkv.plugins.weights.awq import AWQLinearMethod, pack_int4

AWQ_LAYER = "AWQ layer (qkv, o, gate_up, down)"
INT8_HEAD = "int8 LM head"


@dataclass(frozen=True)
class KernelShape:
    """The linears' sizes; the defaults are SmolLM2-135M's (the bundled model)."""

    hidden: int = 576
    intermediate: int = 1536
    qkv: int = 960  # (heads + 2 kv heads) x head size
    vocab: int = 49152
    group: int = 64

    def __post_init__(self) -> None:
        if min(self.hidden, self.intermediate, self.qkv, self.vocab, self.group) < 1:
            raise ValueError("every size must be >= 1")
        for name in ("hidden", "intermediate"):
            if getattr(self, name) % self.group:
                raise ValueError(f"the AWQ group size {self.group} must divide {name} "
                                 f"({getattr(self, name)})")
        for name in ("hidden", "intermediate", "qkv"):
            if getattr(self, name) % 8:
                raise ValueError(f"{name} ({getattr(self, name)}) must be a multiple of 8 "
                                 "(eight 4-bit codes a word)")

    def layer_sizes(self) -> list[tuple[int, int]]:
        """(in, out) of qkv, o, gate_up and down."""
        h, i = self.hidden, self.intermediate
        return [(h, self.qkv), (h, h), (h, 2 * i), (i, h)]


@dataclass(frozen=True)
class KernelRow:
    """One kernel at one row count under one flavour: ms per call, quantized and float32."""

    isa: str
    kernel: str
    rows: int
    quantized_ms: float
    float_ms: float

    @property
    def speedup(self) -> float:
        """float32 time / quantized time."""
        return self.float_ms / self.quantized_ms


class _Rotation:
    """Copies of one set of linears; each call runs the next copy's set on its inputs, so
    consecutive calls read different memory."""

    def __init__(self, linears: list[Linear], footprint_bytes: int) -> None:
        size = sum(p.numel() * p.element_size() for lin in linears for p in lin.parameters())
        for linear in linears:
            linear.kernel = None  # a compiled module does not deep-copy; set per flavour
        count = max(1, math.ceil(footprint_bytes / size))
        self.copies = [linears] + [copy.deepcopy(linears) for _ in range(count - 1)]
        self.next = 0

    def use(self, kernel: Any) -> None:
        for linears in self.copies:
            for linear in linears:
                linear.kernel = kernel

    def caller(self, inputs: dict[int, torch.Tensor]) -> Callable[[], None]:
        def call() -> None:
            for linear in self.copies[self.next]:
                linear(inputs[linear.in_features])
            self.next = (self.next + 1) % len(self.copies)

        return call


def _awq_linear(k: int, n: int, group: int, gen: torch.Generator) -> Linear:
    method = AWQLinearMethod(group, "cpu")
    layer = Linear(k, [n], bias=False, method=method)
    tensors = {"qweight": pack_int4(torch.randint(0, 16, (k, n), generator=gen)),
               "qzeros": pack_int4(torch.randint(0, 16, (k // group, n), generator=gen)),
               "scales": (torch.rand(k // group, n, generator=gen) * 0.02 + 0.001).half()}
    with torch.no_grad():
        for name, tensor in tensors.items():
            layer.load(name, tensor, None, name)
        method.process_weights_after_loading(layer)
    return layer


def _float_linear(k: int, n: int, gen: torch.Generator) -> Linear:
    layer = Linear(k, [n], bias=False, dtype=torch.float32)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=gen) * 0.02)
    return layer


def _int8_head(k: int, n: int, gen: torch.Generator) -> Linear:
    layer = _float_linear(k, n, gen)
    Int8LinearMethod.convert(layer, layer.weight)
    return layer


def _flavours(asked: Sequence[str] | None) -> list[str]:
    runnable = cpp_build.runnable_flavours()
    if not asked:
        return runnable
    for isa in asked:
        if isa not in runnable:
            raise ValueError(f"this CPU cannot run the {isa!r} kernels (it runs "
                             f"{', '.join(runnable)})")
    return list(asked)


def time_kernels(shape: KernelShape = KernelShape(), rows: Sequence[int] = (1, 16, 64),
                 flavours: Sequence[str] | None = None, repeats: int = 20,
                 footprint_mib: float = 96.0, seed: int = 0,
                 advance: Callable[[], None] = lambda: None) -> list[KernelRow]:
    """Time the AWQ layer and the int8 head against float32 for every flavour (default: all
    this CPU runs) and row count; `advance` is called after each (flavour, kernel, rows)."""
    if not rows or min(rows) < 1 or repeats < 1 or footprint_mib < 0:
        raise ValueError("rows (at least one) and repeats must be >= 1, footprint_mib >= 0")
    isas = _flavours(flavours)
    reasons = cpp_build.unusable_reasons()
    if reasons:
        raise ValueError("the CPU kernels cannot be built here: " + "; ".join(reasons))
    gen = torch.Generator().manual_seed(seed)
    footprint = int(footprint_mib * 2**20)
    with torch.inference_mode():
        kernels = {
            AWQ_LAYER: (_Rotation([_awq_linear(k, n, shape.group, gen)
                                   for k, n in shape.layer_sizes()], footprint),
                        _Rotation([_float_linear(k, n, gen) for k, n in shape.layer_sizes()],
                                  footprint)),
            INT8_HEAD: (_Rotation([_int8_head(shape.hidden, shape.vocab, gen)], footprint),
                        _Rotation([_float_linear(shape.hidden, shape.vocab, gen)], footprint)),
        }
        results = []
        for isa in isas:
            module = cpp_build.kernels(isa)
            for name, (quantized, plain) in kernels.items():
                quantized.use(module)
                plain.use(module)
                for m in rows:
                    inputs = {k: torch.randn(m, k, generator=gen)
                              for k in (shape.hidden, shape.intermediate)}
                    q_ms, f_ms = interleaved_ms([quantized.caller(inputs), plain.caller(inputs)],
                                                repeats)
                    results.append(KernelRow(isa, name, m, q_ms, f_ms))
                    advance()
    return results


def print_kernels(console: Any, shape: KernelShape, rows: Sequence[int],
                  flavours: Sequence[str] | None, **options: Any) -> list[KernelRow]:
    """Run `time_kernels` with a progress bar; print the CPU line and a table of the rows."""
    from rich.progress import Progress
    from rich.table import Table

    isas = _flavours(flavours)
    print_cpu_line(console, threads=True)
    console.print(f"hidden {shape.hidden}, intermediate {shape.intermediate}, qkv {shape.qkv}, "
                  f"vocab {shape.vocab}, AWQ group {shape.group}; weights streamed from memory")
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("timing kernels", total=len(isas) * 2 * len(rows))
        results = time_kernels(shape, rows, isas, advance=lambda: progress.advance(task),
                               **options)
    table = Table(title="pkv bench kernels: ms per call, median")
    for column in ("kernels", "linear", "rows", "quantized ms", "float32 ms", "float32 / quant"):
        table.add_column(column, justify="left" if column == "linear" else "right")
    for r in results:
        table.add_row(r.isa, r.kernel, str(r.rows), f"{r.quantized_ms:.3f}", f"{r.float_ms:.3f}",
                      f"{r.speedup:.2f}x")
    console.print(table)
    return results
