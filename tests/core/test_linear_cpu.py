"""Float32 linears on CPU: csrc/gemv_cpu.cpp's GEMV, csrc/gemm_cpu.cpp's GEMM and f32_linear
against torch, under every ISA flavour; the engine running its plain weights through them (no
packed copies), and its LM head writing into one reused logits buffer."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from pkv.core.config.engine import EngineConfig
from pkv.core.engine.llm_engine import LLMEngine
from pkv.core.layers.linear import Linear

EMPTY = torch.empty(0)


def _case(rows: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen) * 0.1,
            torch.randn(n, generator=gen))


def _check_matches_torch(kernel: Callable, rows: int, k: int, n: int) -> None:
    x, w, bias = _case(rows, k, n, rows * 1000 + k + n)
    torch.testing.assert_close(kernel(x, w, EMPTY), x @ w.t(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kernel(x, w, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-4)


def _check_refuses_bad_operands(kernel: Callable, name: str) -> None:
    x, w, bias = _case(3, 40, 12, 0)
    for bad in ((x.t().contiguous().t(), w, EMPTY),  # strided x
                (x, w[:, :20], EMPTY),  # K differs
                (x, w.t().contiguous().t(), EMPTY),  # strided w
                (x.double(), w.double(), EMPTY),
                (x, w, bias[:5])):
        with pytest.raises(RuntimeError, match=name):
            kernel(*bad)


# Rows 1 to 70 (one row, the row blocks of every flavour and their remainders, past the GEMV's
# limit); K a whole number of vectors or not (a scalar tail); N a multiple of the 4-row
# weight groups or 1-3 past it.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 70])
@pytest.mark.parametrize(("k", "n"), [(64, 32), (576, 193), (37, 6), (1537, 7)])
def test_f32_gemv_matches_torch(cpu_kernels, rows: int, k: int, n: int):
    _check_matches_torch(cpu_kernels.f32_gemv, rows, k, n)


def test_f32_gemv_takes_zero_rows_and_refuses_bad_operands(cpu_kernels):
    x, w, _ = _case(3, 40, 12, 0)
    assert cpu_kernels.f32_gemv(x[:0], w, EMPTY).shape == (0, 12)
    _check_refuses_bad_operands(cpu_kernels.f32_gemv, "f32_gemv")


# Rows 1 to 300 (one x^T block and its remainder, several, and past a pass's 16 blocks); N
# whole 6-row panels or 1-5 past them; K in one chunk, in chunks (above 768), or tiny.
@pytest.mark.parametrize("rows", [1, 5, 16, 25, 70, 300])
@pytest.mark.parametrize(("k", "n"), [(96, 42), (577, 193), (3, 7), (1601, 11)])
def test_f32_gemm_matches_torch(cpu_kernels, rows: int, k: int, n: int):
    _check_matches_torch(cpu_kernels.f32_gemm, rows, k, n)


def test_f32_gemm_takes_empty_operands_and_refuses_bad_ones(cpu_kernels):
    x, w, bias = _case(3, 40, 12, 0)
    assert cpu_kernels.f32_gemm(x[:0], w, EMPTY).shape == (0, 12)
    assert cpu_kernels.f32_gemm(x, w[:0], EMPTY).shape == (3, 0)
    assert torch.equal(cpu_kernels.f32_gemm(x[:, :0], w[:, :0], bias), bias.expand(3, 12))
    assert torch.equal(cpu_kernels.f32_gemm(x[:, :0], w[:, :0], EMPTY), torch.zeros(3, 12))
    _check_refuses_bad_operands(cpu_kernels.f32_gemm, "f32_gemm")


@pytest.mark.parametrize("bias", [False, True])
def test_f32_linear_is_the_gemv_then_the_gemm_then_onednn(cpu_kernels, bias: bool):
    limit, gemm_limit = cpu_kernels.f32_gemv_max_rows, cpu_kernels.f32_gemm_max_rows
    assert limit >= 8
    # The weight-broadcast GEMM takes a decode batch on the AVX2 flavour only (measured).
    assert gemm_limit == (256 if cpu_kernels.isa in ("avx2", "avxvnni") else 0)
    for rows in sorted({1, limit, limit + 1, 70, gemm_limit, gemm_limit + 1} - {0}):
        x, w, b = _case(rows, 96, 40, rows)
        b = b if bias else None
        got = cpu_kernels.f32_linear(x, w, b)
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
        # Bit for bit the GEMV's up to `limit` rows, f32_gemm's up to `gemm_limit`, oneDNN's
        # GEMM above (torch's own linear, MKL's, where torch has no oneDNN).
        if rows <= limit:
            assert torch.equal(got, cpu_kernels.f32_gemv(x, w, b if bias else EMPTY))
        elif rows <= gemm_limit:
            assert torch.equal(got, cpu_kernels.f32_gemm(x, w, b if bias else EMPTY))
        elif torch.backends.mkldnn.is_available():
            assert torch.equal(got, torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], ""))
        else:
            assert torch.equal(got, F.linear(x, w, b))


def test_f32_linear_writes_into_out_by_the_gemv_or_the_gemm(cpu_kernels):
    # With `out`, every row count above the GEMV's takes f32_gemm (in place) on every flavour;
    # a strided weight takes the copying path.
    limit = cpu_kernels.f32_gemv_max_rows
    for rows in (1, limit, limit + 1, 70, 300):
        x, w, b = _case(rows, 96, 40, rows)
        out = torch.full((rows, 40), float("nan"))
        got = cpu_kernels.f32_linear(x, w, b, out)
        assert got.data_ptr() == out.data_ptr()
        kernel = cpu_kernels.f32_gemv if rows <= limit else cpu_kernels.f32_gemm
        assert torch.equal(out, kernel(x, w, b))
        strided = torch.cat([w, w], dim=1)[:, :96]
        out.fill_(float("nan"))
        assert cpu_kernels.f32_linear(x, strided, b, out).data_ptr() == out.data_ptr()
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    x, w, b = _case(30, 96, 40, 1)
    for kernel in (cpu_kernels.f32_gemv, cpu_kernels.f32_gemm):
        out = torch.empty(30, 40)
        assert kernel(x, w, b, out=out).data_ptr() == out.data_ptr()
        assert torch.equal(out, kernel(x, w, b))
    for bad in (torch.empty(30, 41), torch.empty(40, 30).t(), torch.empty(30, 40).double()):
        for call in (lambda o: cpu_kernels.f32_linear(x, w, b, o),
                     lambda o: cpu_kernels.f32_gemv(x, w, b, o),
                     lambda o: cpu_kernels.f32_gemm(x, w, b, o)):
            with pytest.raises(RuntimeError, match="out must be contiguous float32 .30, 40."):
                call(bad)
    with pytest.raises(RuntimeError, match="out needs a 2-D x"):
        cpu_kernels.f32_linear(x[None], w, b, torch.empty(30, 40))


def test_strided_operands_go_through_f32_linear(cpu_kernels):
    x, w, b = _case(5, 64, 24, 3)
    strided_x = torch.cat([x, x], dim=1)[:, :64]
    strided_w = torch.cat([w, w], dim=1)[:, :64]
    for args in ((strided_x, w, b), (x, strided_w, b), (x, w, torch.stack([b, b], 1)[:, 0])):
        torch.testing.assert_close(cpu_kernels.f32_linear(*args), F.linear(x, w, b),
                                   rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 70])
def test_linear_layer_with_kernels_matches_plain(cpu_kernels, rows: int):
    torch.manual_seed(rows)
    layer = Linear(48, [40, 24], True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        plain = layer(x)
        layer.kernel = cpu_kernels
        fast = layer(x)
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)


def test_engine_runs_plain_float_weights(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory="4MiB"),
                       show_progress=False)
    linears = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight is not None and m.kernel is not None for m in linears)
    assert all(not m._buffers for m in linears)  # no packed copies beside the weights


def test_lm_head_writes_every_step_into_one_logits_buffer(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory="4MiB"),
                       show_progress=False)
    model = engine.runner.model
    head = model.lm_head
    hidden = torch.randn(5, head.weight.shape[1])
    with torch.inference_mode():
        first = model.compute_logits(hidden)
        torch.testing.assert_close(first, hidden @ head.weight.t(), rtol=1e-5, atol=1e-4)
        second = model.compute_logits(hidden[:3] * 2)  # fewer rows: the same buffer
        assert second.data_ptr() == first.data_ptr() == model._logits_buffer.data_ptr()
        torch.testing.assert_close(second, (hidden[:3] * 2) @ head.weight.t(),
                                   rtol=1e-5, atol=1e-4)
        bigger = model.compute_logits(torch.randn(9, head.weight.shape[1]))  # grows it
        assert model._logits_buffer.shape[0] == 9 and bigger.data_ptr() == \
            model._logits_buffer.data_ptr()
    engine.shutdown()


def test_tied_head_is_the_embedding_counted_once(smol_llm):
    runner = smol_llm.llm_engine.runner
    model = runner.model
    assert model.config.tie_word_embeddings
    # The GGUF's tied head runs on the embedding's own Q8_0 blocks, counted once.
    table = model.model.embed_tokens.table
    assert model.lm_head.parts[0].data.data_ptr() == table.data.data_ptr()
    assert model.lm_head.blocks_0 is model.model.embed_tokens.blocks  # one buffer, two owners
    every = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    assert runner.weight_bytes == sum(t.numel() * t.element_size() for t in every.values())
    assert runner.weight_bytes_by_type["Q8_0"] == table.nbytes


def test_a_step_s_kernels_leave_other_threads_running():
    """The server's event loop runs on its own thread: it must make progress while the
    engine's thread is inside a kernel (the kernels release the GIL)."""
    import threading
    import time

    from pkv.csrc import cpp_build

    kernels = cpp_build.kernels()
    x, w, _ = _case(512, 2048, 4096, 0)  # ~8.6 GFLOP: tens of ms on two cores
    started, finished = threading.Event(), threading.Event()
    call: list[float] = []

    def compute() -> None:
        started.set()
        call.append(time.perf_counter())
        kernels.f32_linear(x, w, None)
        call.append(time.perf_counter())
        finished.set()

    worker = threading.Thread(target=compute)
    worker.start()
    started.wait()
    stamps = []
    while not finished.is_set():
        stamps.append(time.perf_counter())
    worker.join()
    t0, t1 = call
    inside = [t0, *(t for t in stamps if t0 < t < t1), t1]
    longest = max(b - a for a, b in zip(inside, inside[1:]))
    # Holding the GIL, the kernel would keep this thread from running through its whole call.
    assert longest < 0.5 * (t1 - t0), (longest, t1 - t0)
