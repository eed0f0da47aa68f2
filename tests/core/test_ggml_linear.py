"""Weights in ggml's block formats (core/layers/ggml_tensor.py, csrc/ggml_cpu.cpp): every type
dequantized exactly as the gguf package dequantizes it, linears at GEMV and GEMM sizes against
torch on the dequantized weight, under every ISA flavour; slicing by rows and by whole blocks."""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from pkv.core.layers.ggml_linear import GGMLLinearMethod, ggml_storage, int4_form, use_ggml
from pkv.core.layers.ggml_tensor import FORMATS, GGMLTensor
from pkv.core.layers.int4_tiles import tiled as float_tiles
from pkv.core.layers.linear import Linear

# Byte offsets of each quantized type's float16 scales (d, and dmin/m where it has one) in
# a block: random bytes there could be NaN or huge; everywhere else any byte is valid.
_SCALES = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
           "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
TYPES = sorted(FORMATS, key=lambda t: FORMATS[t].name)


def random_blocks(qtype: int, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row bytes]: random codes with small positive scales, or random floats."""
    rng = np.random.default_rng(seed)
    fmt = FORMATS[qtype]
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    if fmt.name == "F32":
        return values.view(np.uint8)
    if fmt.name == "F16":
        return values.astype(np.float16).view(np.uint8)
    if fmt.name == "BF16":
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    count = cols // fmt.values
    blocks = rng.integers(0, 256, (rows, count, fmt.bytes), dtype=np.uint8)
    for offset in _SCALES[fmt.name]:
        scale = (rng.random((rows, count)) * 0.02 + 0.001).astype(np.float16)
        blocks[:, :, offset:offset + 2] = scale.view(np.uint8).reshape(rows, count, 2)
    return blocks.reshape(rows, count * fmt.bytes)


def reference(blocks: np.ndarray, qtype: int, cols: int) -> torch.Tensor:
    """The gguf package's float32 values of `blocks` (bf16 by widening: it has no reader)."""
    if FORMATS[qtype].name == "BF16":
        wide = blocks.view(np.uint16).astype(np.uint32) << 16
        return torch.from_numpy(wide.view(np.float32).reshape(-1, cols))
    values = quants.dequantize(blocks, GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(-1, cols))


@pytest.mark.parametrize("qtype", TYPES, ids=[FORMATS[t].name for t in TYPES])
def test_every_type_dequantizes_as_the_gguf_package(cpu_kernels, qtype: int):
    blocks = random_blocks(qtype, 7, 512, seed=qtype)
    want = reference(blocks, qtype, 512)
    got = cpu_kernels.ggml_dequantize(torch.from_numpy(blocks), qtype, 512)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    ids = torch.tensor([6, 0, 3, 3])
    torch.testing.assert_close(cpu_kernels.ggml_rows(torch.from_numpy(blocks), qtype, ids, 512),
                               want[ids], rtol=0, atol=0)


# Rows 1 to 130: the GEMV (passes of up to 16 rows), from 14 rows to 128 x transposed against
# broadcast weights (one and two vectors of x^T, passes of them, weight rows past a whole
# tile; at 100 rows of 4864 inputs, groups of one pass), and the panel GEMM past 128; K one
# chunk, several, and a last chunk of 32-value blocks short of 256 (896 = 3.5 chunks).
@pytest.mark.parametrize("qtype", TYPES, ids=[FORMATS[t].name for t in TYPES])
@pytest.mark.parametrize("rows", [1, 3, 14, 16, 17, 32, 40, 70, 100, 130])
def test_linear_matches_torch_on_the_dequantized_weight(cpu_kernels, qtype: int, rows: int):
    cols = 4864 if rows == 100 else 512 if FORMATS[qtype].values == 256 else 896
    first, second = random_blocks(qtype, 19, cols, seed=1), random_blocks(qtype, 6, cols, seed=2)
    weight = torch.cat([reference(first, qtype, cols), reference(second, qtype, cols)])
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, cols, generator=gen), torch.randn(25, generator=gen)
    parts = [torch.from_numpy(first), torch.from_numpy(second)]
    types = torch.tensor([qtype, qtype])
    want = torch.nn.functional.linear(x, weight, bias)
    torch.testing.assert_close(cpu_kernels.ggml_linear(x, parts, types, bias), want,
                               rtol=1e-4, atol=1e-4 * want.abs().max().item())
    out = torch.empty(rows, 25)
    assert cpu_kernels.ggml_linear(x, parts, types, None, out).data_ptr() == out.data_ptr()


@pytest.mark.parametrize("rows", [2, 24])
def test_parts_of_different_types_make_one_output(cpu_kernels, two_threads, rows: int):
    q4k, q6k, q8 = (FORMATS_BY_NAME[n] for n in ("Q4_K", "Q6_K", "Q8_0"))
    # 72 weight rows: the second thread's share starts inside the first part
    parts = [random_blocks(t, n, 256, seed=n) for t, n in ((q4k, 40), (q6k, 21), (q8, 11))]
    weight = torch.cat([reference(p, t, 256) for p, t in zip(parts, (q4k, q6k, q8))])
    x, bias = torch.randn(rows, 256), torch.randn(72)
    y = cpu_kernels.ggml_linear(x, [torch.from_numpy(p) for p in parts],
                                torch.tensor([q4k, q6k, q8]), bias)
    torch.testing.assert_close(y, x @ weight.t() + bias, rtol=1e-4, atol=1e-3)


def q8_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T with x quantized as the K-quants' int8 GEMV takes it (llama.cpp's Q8_K):
    per 256 inputs, q = round(x * 127 / max |x|) and x ~ q max |x| / 127; float64 sums."""
    m, k = x.shape
    blocks = x.reshape(m, k // 256, 256)
    amax = blocks.abs().amax(-1, keepdim=True)
    # (127 / tensor would be tensor.reciprocal() * 127 in torch: an ulp off the kernel's)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax.clamp_min(1e-30), 0)
    q = torch.round(blocks * inv).double()  # (round half to even, as the kernel's)
    w = weight.double().reshape(weight.shape[0], k // 256, 256)
    return torch.einsum("mbk,nbk,mb->mn", q, w, (amax / 127).double().squeeze(-1))




# The K-quants take int8 activations in AVX2 and AVX-512 code; the generic flavour keeps the
# float GEMV. At rows 17 and 32 the tiles take all four parts.
def int8_layer(kernels: Any, names: tuple[str, ...], rows: int, cols: int, seed: int,
               outlier: slice) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor],
                                        torch.Tensor]:
    """Parts of the named types (5, 6, ... rows) through `rows` rows of x on int8 activations,
    x's block at `outlier` scaled up (its scale is its own): x, bias, the parts' dequantized
    weights and y in float64."""
    types = [FORMATS_BY_NAME[n] for n in names]
    parts = [random_blocks(t, 5 + i, cols, seed=seed + i) for i, t in enumerate(types)]
    weights = [reference(p, t, cols) for p, t in zip(parts, types)]
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, cols, generator=gen)
    bias = torch.randn(sum(w.shape[0] for w in weights), generator=gen)
    x[0, outlier] *= 20
    y = kernels.ggml_linear(x, [torch.from_numpy(p) for p in parts], torch.tensor(types), bias,
                            None, 8).double()
    return x, bias, weights, y


# Rows 1-11: the K-quants' int8 GEMV, a weight row decoded once per run of rows of x (8 on
# AVX-512, 4 elsewhere) and the rows left; from 12 the tiles.
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 11, 17, 32])
def test_int8_activations_are_the_q8_scheme_for_the_k_quants(cpu_kernels, two_threads,
                                                             rows: int):
    x, bias, weights, y = int8_layer(cpu_kernels, ("Q4_K", "Q5_K", "Q6_K", "Q8_0"), rows, 1024,
                                     10, slice(0, 256))
    k_quants = torch.cat(weights[:3])
    int8 = bool(cpu_kernels.ggml_int8_kquants)
    assert int8 == (cpu_kernels.isa != "generic")
    tiled(cpu_kernels, ("Q4_K", "Q5_K", "Q6_K", "Q8_0"), rows)  # the rule, checked
    if tiled(cpu_kernels, ("Q4_K", "Q5_K", "Q6_K"), rows):  # the tiles: x per 32 inputs
        want = q8_0_reference(x, k_quants)
    else:
        want = q8_reference(x, k_quants) if int8 else x.double() @ k_quants.double().t()
    w = weights[3]  # Q8_0: grouped in int8 at 3-6 rows with VBMI, tiled from 5, else float
    in_int8 = q8_0_in_int8(cpu_kernels, rows)
    q8_0 = q8_0_reference(x, w) if in_int8 else x.double() @ w.double().t()
    want = torch.cat([want, q8_0], dim=1)
    want += bias.double()
    torch.testing.assert_close(y, want, rtol=0, atol=2e-5 * want.abs().max().item())
    if int8:  # and not the float result: x really went through int8
        exact = x.double() @ k_quants.double().t() + bias[:18].double()
        assert (y[:, :18] - exact).abs().max() > 1e-3 * exact.abs().max()


def q8_0_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T with x quantized per 32 inputs (llama.cpp's Q8_0 activations), as the
    32-value types' int8 GEMV takes it; float64 sums."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    # (127 / tensor would be tensor.reciprocal() * 127 in torch: an ulp off the kernel's)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax.clamp_min(1e-30), 0)
    q = torch.round(blocks * inv).double()
    w = weight.double().reshape(weight.shape[0], k // 32, 32)
    return torch.einsum("mbk,nbk,mb->mn", q, w, (amax / 127).double().squeeze(-1))


# Q4_0, Q4_1, Q5_0 and Q5_1 take x in int8 per 32 inputs at 1-6 rows (grouped), Q8_0 at 2 (at
# 1 too on AVX2) and, grouped where the CPU has VBMI and VNNI, at 3-6; at 3-4 rows it otherwise
# stays float (from 5 the tiles take it). A Q6_K part beside them takes x per 256.
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_int8_activations_are_the_q8_0_scheme_for_32_value_types(cpu_kernels, two_threads,
                                                                  rows: int):
    names = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q6_K")
    x, bias, weights, y = int8_layer(cpu_kernels, names, rows, 512, 20, slice(32, 64))
    int8 = cpu_kernels.isa != "generic"
    in_int8 = [int8, int8, int8, int8, q8_0_in_int8(cpu_kernels, rows)]
    want = [q8_0_reference(x, w) if q8 else x.double() @ w.double().t()
            for w, q8 in zip(weights[:5], in_int8)]
    want.append(q8_reference(x, weights[5]) if int8 else x.double() @ weights[5].double().t())
    want = torch.cat(want, dim=1) + bias.double()
    torch.testing.assert_close(y, want, rtol=0, atol=2e-5 * want.abs().max().item())
    first = 0
    for w, q8 in zip(weights[:5], in_int8):  # x really went through int8, or really did not
        part = slice(first, first + w.shape[0])
        exact = x.double() @ w.double().t() + bias[part].double()
        assert bool((y[:, part] - exact).abs().max() > 1e-3 * exact.abs().max()) == q8
        first += w.shape[0]


def q8_0_in_int8(kernels: Any, rows: int) -> bool:
    """Whether a Q8_0 part takes int8 x at `rows` rows: at 2 rows (its int8 GEMV; at 1 too in
    the avx2 flavour), grouped at 3-6 where the CPU has VBMI and VNNI, and where the tiles
    take it."""
    if kernels.isa == "generic":
        return False
    grouped = kernels.ggml_q8_0_groups and 3 <= rows <= 6
    one_row = rows == 1 and kernels.isa in ("avx2", "avxvnni")
    return rows == 2 or one_row or grouped or tiled(kernels, ("Q8_0",), rows)


def before_a_guard_page(blocks: np.ndarray) -> torch.Tensor:
    """`blocks` as a tensor whose last byte is followed by a page no one may read: a kernel
    that loads past the weights faults there instead of reading a neighbour's bytes."""
    page = mmap.PAGESIZE
    size = -(-blocks.nbytes // page) * page + page
    memory = mmap.mmap(-1, size)
    guard = ctypes.addressof(ctypes.c_char.from_buffer(memory)) + size - page
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(guard, page, 0) == 0, ctypes.get_errno()  # PROT_NONE
    start = size - page - blocks.nbytes
    tensor = torch.frombuffer(memory, dtype=torch.uint8, offset=start, count=blocks.nbytes)
    tensor.copy_(torch.from_numpy(blocks.reshape(-1)))
    return tensor.view(blocks.shape)


# At 1-6 rows of x, Q4_0, Q4_1, Q5_0 and Q5_1 rows take four blocks at a time (AVX2, AVX-512),
# Q8_0 rows at 3-6 where the CPU has VBMI and VNNI: widths of 17-20 blocks end in short
# groups, whose bytes past the last row must not be read; 37 rows split between two threads,
# one to four weight rows at a time.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("cols", [544, 576, 608, 640, 4864])
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_grouped_types_at_few_rows_of_int8_x(cpu_kernels, two_threads, name: str, cols: int,
                                             rows: int):
    qtype = FORMATS_BY_NAME[name]
    blocks = random_blocks(qtype, 37, cols, seed=cols)
    gen = torch.Generator().manual_seed(cols)
    x, bias = torch.randn(rows, cols, generator=gen), torch.randn(37, generator=gen)
    x[-1, 40:70] *= 30  # blocks of x with scales of their own
    y = cpu_kernels.ggml_linear(x, [before_a_guard_page(blocks)], torch.tensor([qtype]), bias,
                                None, 8).double()
    weight = reference(blocks, qtype, cols)
    int8 = cpu_kernels.isa != "generic" if name != "Q8_0" else q8_0_in_int8(cpu_kernels, rows)
    want = (q8_0_reference(x, weight) if int8 else x.double() @ weight.double().t()) + bias
    torch.testing.assert_close(y, want, rtol=0, atol=2e-5 * want.abs().max().item())


# Past the float GEMV's 32 rows an int8 layer keeps integer kernels for the parts the tiles read
# (at any rows); the float32 GEMM takes the rest (Q2_K beside a tiled Q5_0 part; Q8_0 without
# VNNI).
@pytest.mark.parametrize(("rows", "names"), [(100, ("Q4_K", "Q6_K")), (130, ("Q4_K", "Q6_K")),
                                             (70, ("Q4_K", "Q8_0")), (70, ("Q5_0", "Q2_K"))])
def test_int8_layers_keep_integer_kernels_past_32_rows(cpu_kernels, rows: int,
                                                      names: tuple[str, ...]):
    types = [FORMATS_BY_NAME[n] for n in names]
    parts = [random_blocks(t, 7, 512, seed=i) for i, t in enumerate(types)]
    weights = [reference(p, t, 512) for p, t in zip(parts, types)]
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    y = cpu_kernels.ggml_linear(x, [torch.from_numpy(p) for p in parts], torch.tensor(types),
                                None, None, 8).double()
    tiled(cpu_kernels, names, rows)  # (the rule, for the whole layer)
    want = []
    for name, w in zip(names, weights):  # the tiles take the parts they read, each on its own
        if tiled(cpu_kernels, (name,), rows):
            want.append(q8_0_reference(x, w))
        else:
            want.append(x.double() @ w.double().t())
    want = torch.cat(want, dim=1)
    torch.testing.assert_close(y, want, rtol=0, atol=2e-5 * want.abs().max().item())


def tiled(kernels: Any, names: tuple[str, ...], rows: int) -> bool:
    """Whether the tiles take a layer of the named types at `rows` rows, checked against the
    rule they are chosen by: with AVX2 or AVX-512 every type they read from 5 rows, the
    K-quants from 12, any number of rows; not the 32-value types up to 6 rows (Q8_0 there only
    with VBMI): their grouped GEMV takes them."""
    kquants = any(n.endswith("_K") for n in names)
    readable = set(names) <= {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}
    rule = (kernels.isa != "generic" and readable and rows >= 5
            and (not kquants or rows >= 12)
            and (not {"Q4_0", "Q4_1", "Q5_0", "Q5_1"} & set(names) or rows > 6)
            and ("Q8_0" not in names or rows > 6 or not kernels.ggml_q8_0_groups))
    tiles = kernels.ggml_int8_tiles(torch.tensor([FORMATS_BY_NAME[n] for n in names]), rows)
    assert tiles == rule, (names, rows)
    return tiles


# The tiles (csrc/ggml_tiles_cpu.cpp): every type they read, at one vector of x^T (5, 16 rows)
# and two (17), in passes (40) and in groups of passes, the last one short (130: AVX2's 16
# passes a group; 400: AVX-512's 10 or 12 at these widths); parts of 5 to 7 weight rows (tiles
# cut short) on two threads (a thread's share starting inside a part); K several chunks and a
# last one short of 256 (896 inputs); x's outlier block with a scale of its own.
@pytest.mark.parametrize("names", [("Q4_0", "Q5_0", "Q8_0"), ("Q4_1", "Q5_1"),
                                   ("Q4_K", "Q5_K", "Q6_K")], ids="+".join)
@pytest.mark.parametrize("rows", [5, 12, 16, 17, 40, 130, 400])
def test_int8_tiles_are_the_q8_0_scheme(cpu_kernels, two_threads, names: tuple[str, ...],
                                        rows: int):
    cols = 1024 if names[0].endswith("_K") else 896
    x, bias, weights, y = int8_layer(cpu_kernels, names, rows, cols, 30, slice(64, 96))
    if not tiled(cpu_kernels, names, rows):
        return  # the rule above holds; the GEMVs' and the GEMM's values are tested elsewhere
    want = q8_0_reference(x, torch.cat(weights)) + bias.double()
    torch.testing.assert_close(y, want, rtol=0, atol=2e-5 * want.abs().max().item())
    exact = x.double() @ torch.cat(weights).double().t() + bias.double()
    assert (y - exact).abs().max() > 1e-3 * exact.abs().max()  # x really went through int8


# A layer mixing types the tiles read and types they do not: each part goes its own way, the
# tiled ones in int8, the others in float (16 rows: the broadcast GEMV; 40: the GEMM), each
# with its own bias, into its own columns.
@pytest.mark.parametrize("rows", [16, 40])
def test_int8_tiles_take_their_parts_of_a_mixed_layer(cpu_kernels, two_threads, rows: int):
    names = ("Q2_K", "Q5_0", "Q8_0")
    x, bias, weights, y = int8_layer(cpu_kernels, names, rows, 512, 40, slice(0, 32))
    parts = [tiled(cpu_kernels, (name,), rows) for name in names]
    assert parts[0] is False and parts[1] == (cpu_kernels.isa != "generic")
    want = torch.cat([q8_0_reference(x, w) if tile else x.double() @ w.double().t()
                      for w, tile in zip(weights, parts)], dim=1) + bias.double()
    torch.testing.assert_close(y, want, rtol=0, atol=2e-5 * want.abs().max().item())


def test_int8_activations_keep_a_bad_row_to_itself(cpu_kernels):
    # three rows: the K-quants' GEMV, or Q5_0's grouped one; sixteen of Q5_0: the tiles,
    # where there are some
    for name, rows in (("Q6_K", 3), ("Q5_0", 3), ("Q5_0", 16)):
        qtype = FORMATS_BY_NAME[name]
        blocks = torch.from_numpy(random_blocks(qtype, 9, 512, seed=4))
        x = torch.randn(rows, 512)
        x[1, 300] = float("nan")
        y = cpu_kernels.ggml_linear(x, [blocks], torch.tensor([qtype]), None, None, 8)
        good = [r for r in range(rows) if r != 1]
        assert y[1].isnan().all() and y[good].isfinite().all()
        torch.testing.assert_close(y[good], cpu_kernels.ggml_linear(
            x[good], [blocks], torch.tensor([qtype]), None, None, 8))
    q6k = FORMATS_BY_NAME["Q6_K"]
    blocks = torch.from_numpy(random_blocks(q6k, 9, 512, seed=4))
    with pytest.raises(RuntimeError, match="activation_bits must be 32 or 8, got 16"):
        cpu_kernels.ggml_linear(x, [blocks], torch.tensor([q6k]), None, None, 16)


def test_the_generic_flavour_refuses_integer_activations(monkeypatch: pytest.MonkeyPatch):
    # it has no byte or word dot products: a one-line refusal when the model is built,
    # not an error from inside the first step
    monkeypatch.setenv("PKV_CPU_ISA", "generic")
    for activations in ("int16", "int8"):
        with pytest.raises(ValueError, match=f"awq_activations={activations} needs the avx2 or "
                                             "avx512 CPU kernels; this model runs the generic"):
            GGMLLinearMethod().set_activations(activations)
    method = GGMLLinearMethod()
    method.set_activations("float32")
    assert method.activation_bits == 32


def test_kernels_refuse_bad_operands(cpu_kernels):
    q4k = FORMATS_BY_NAME["Q4_K"]
    blocks = torch.from_numpy(random_blocks(q4k, 4, 512))
    x = torch.randn(2, 512)
    with pytest.raises(RuntimeError, match="not a whole number of blocks"):
        cpu_kernels.ggml_linear(torch.randn(2, 320), [blocks], torch.tensor([q4k]), None)
    with pytest.raises(RuntimeError, match="ggml type 99"):
        cpu_kernels.ggml_linear(x, [blocks], torch.tensor([99]), None)
    with pytest.raises(RuntimeError, match="uint8"):
        cpu_kernels.ggml_linear(x, [blocks[:, :100]], torch.tensor([q4k]), None)
    with pytest.raises(RuntimeError, match="outside the table"):
        cpu_kernels.ggml_rows(blocks, q4k, torch.tensor([4]), 512)
    codes = torch.zeros(1, 64, 32, dtype=torch.int32)  # Q4_K's tiles: d and dmin per 8 groups
    scale_codes, supers = torch.zeros(1, 16, 2, 32, dtype=torch.uint8), torch.zeros(1, 2, 2, 32)
    assert cpu_kernels.awq_gemv(x, codes, scale_codes, supers, 32, 32).shape == (2, 32)
    with pytest.raises(RuntimeError, match="Q4_K scales must be"):
        cpu_kernels.awq_gemv(x, codes, scale_codes, supers[:, :1], 32, 32)
    with pytest.raises(RuntimeError, match="Q4_K scales must be"):
        cpu_kernels.awq_gemv(x, codes, scale_codes[:, :, 0], supers, 32, 32)


# Q4_K's tiles keep its own scales: 6-bit scale and min codes per 32 inputs under float32 d and
# dmin per 256 (4.75 bits a weight, where float scales and zero terms per 32 hold 6). The
# products equal those of the float form, bit for bit, in every 4-bit kernel: the float GEMV
# (1 to 9 rows: one and several passes), the GEMM (40), the int16 and int8 GEMVs.
@pytest.mark.parametrize("rows", [1, 2, 5, 9, 40])
def test_q4_k_tiles_hold_its_scale_codes_and_compute_as_float_scales(cpu_kernels, two_threads,
                                                                     rows: int):
    q4k, cols, sizes = FORMATS_BY_NAME["Q4_K"], 512, (40, 24)
    parts = [GGMLTensor(torch.from_numpy(random_blocks(q4k, n, cols, seed=n)), q4k, cols)
             for n in sizes]
    forms = [int4_form(p) for p in parts]
    float_form = float_tiles(*(torch.cat([f[i] for f in forms]).t().contiguous() for i in range(3)))
    assert float_form[1].dtype == torch.float32
    n, weight = sum(sizes), torch.cat([p.dequantize() for p in parts])
    layer = Linear(cols, list(sizes), False)
    use_ggml(layer)
    for shard, part in enumerate(parts):  # (their pages handed back once repacked)
        layer.load("weight", part, shard, "w")
    layer.method.process_weights_after_loading(layer)
    assert layer.parts is None and layer.scales.dtype == torch.uint8
    held = sum(t.numel() * t.element_size() for _, t in ggml_storage(layer))
    assert held == 2 * 32 * cols * 4.75 / 8  # two tiles of 32 columns (64 for 40 + 24)
    torch.testing.assert_close(cpu_kernels.awq_dequantize(layer.codes, layer.scales, layer.zs,
                                                          n, 32), weight.t(), rtol=0, atol=0)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    for bits in (32, 16, 8) if cpu_kernels.awq_gemv_has_integer() else (32,):
        gemv = cpu_kernels.awq_gemv_max_rows if bits == 32 else rows
        got = cpu_kernels.awq_linear(x, layer.codes, layer.scales, layer.zs, None, n, 32, gemv,
                                     bits)
        want = cpu_kernels.awq_linear(x, *float_form, None, n, 32, gemv, bits)
        assert torch.equal(got, want), (bits, (got - want).abs().max())
    # float32 against the dequantized weight, within the 4-bit GEMV's bound: 2e-5 of sum |x W|
    error = (layer(x).double() - x.double() @ weight.double().t()).abs()
    assert (error <= 2e-5 * (x.abs() @ weight.abs().t()).double()).all()


def test_a_tensor_narrows_by_rows_and_by_whole_blocks():
    q4_0 = FORMATS_BY_NAME["Q4_0"]
    blocks = random_blocks(q4_0, 6, 128)
    tensor = GGMLTensor(torch.from_numpy(blocks), q4_0, 128)
    full = reference(blocks, q4_0, 128)
    assert tensor.shape == (6, 128) and tensor.nbytes == 6 * 4 * 18
    torch.testing.assert_close(tensor.narrow(0, 2, 3).dequantize(), full[2:5])
    torch.testing.assert_close(tensor.narrow(1, 64, 64).dequantize(), full[:, 64:])
    torch.testing.assert_close(tensor[:], full)  # read as a lazy handle: float32
    with pytest.raises(ValueError, match="splits only between its 32-value blocks"):
        tensor.narrow(1, 16, 64)
    with pytest.raises(ValueError, match="takes 72 bytes"):
        GGMLTensor(torch.from_numpy(blocks[:, :70]), q4_0, 128)


FORMATS_BY_NAME = {fmt.name: qtype for qtype, fmt in FORMATS.items()}


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K"])
def test_int8_activations_keep_4_bit_layers_in_their_blocks(isa: str, name: str):
    # The 4-bit types go to the 4-bit tiles for float activations (5-6 bits a weight) and stay
    # in their blocks (4.5 or 5 bits) for int8 ones, which the blocks' int8 kernels read; an LM
    # head made a ggml layer (use_ggml) takes the bits it is given. The generic flavour keeps
    # the tiles.
    q4 = FORMATS_BY_NAME[name]
    blocks = [random_blocks(q4, n, 512, seed=n) for n in (8, 5)]
    x = torch.randn(3, 512)
    layers = {}
    for bits in (32, 8):
        layer = Linear(512, [8, 5], False)
        use_ggml(layer, bits)
        for shard, b in enumerate(blocks):
            layer.load("weight", GGMLTensor(torch.from_numpy(b), q4, 512), shard, "w")
        layer.method.process_weights_after_loading(layer)
        layers[bits] = layer
    kernels = layers[8].kernel
    assert layers[32].parts is None  # tiles
    if isa == "generic":
        assert layers[8].parts is None and not kernels.ggml_int8_kquants
        return
    assert [label for label, _ in ggml_storage(layers[8])] == [name, name]
    assert layers[8].method.fused_operands(layers[8]).activation_bits == 8
    want = kernels.ggml_linear(x, [torch.from_numpy(b) for b in blocks],
                               torch.tensor([q4, q4]), None, None, 8)
    torch.testing.assert_close(layers[8](x), want, rtol=0, atol=0)
    assert not torch.allclose(layers[32](x), want, rtol=0, atol=1e-6)
