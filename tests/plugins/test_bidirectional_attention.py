"""The CPU kernels' bidirectional attention (encoders: each prompt's rows over all of its own
rows) against a float64 reference, under every ISA flavour this CPU runs: prompts shorter
than a tile, longer than a query tile and a key tile, empty ones, GQA, q as a strided view
of a fused qkv; and its refusals."""

from __future__ import annotations

import pytest
import torch

from pkv.csrc import cpp_build

pytestmark = pytest.mark.skipif(bool(cpp_build.unusable_reasons()),
                                reason="the CPU kernels cannot be built here")


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               lens: list[int]) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q, dtype=torch.float64)
    start = 0
    for n in lens:
        rows = slice(start, start + n)
        keys = k[rows].double().repeat_interleave(group, 1)
        vals = v[rows].double().repeat_interleave(group, 1)
        scores = torch.einsum("thd,nhd->htn", q[rows].double(), keys) * q.shape[2] ** -0.5
        out[rows] = torch.einsum("htn,nhd->thd", scores.softmax(-1), vals)
        start += n
    return out.float()


def _starts(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)


# (prompt lengths, heads, kv heads, head size): 1..64-row tiles, 130 and 300 rows (several
# query tiles; more keys than a key tile), an empty prompt between others
CASES = [
    ([1, 5, 40, 64, 65, 3], 12, 12, 32),
    ([130, 0, 17], 4, 2, 64),
    ([300], 6, 2, 48),
    ([7, 0, 1, 33], 2, 1, 16),
]


@pytest.mark.parametrize("flavour", cpp_build.runnable_flavours())
@pytest.mark.parametrize("lens, heads, kv_heads, head_dim", CASES,
                         ids=["-".join(map(str, c[1:])) + f"-{len(c[0])}p" for c in CASES])
def test_each_prompt_attends_over_its_own_rows(flavour: str, lens: list[int], heads: int,
                                               kv_heads: int, head_dim: int):
    kernels = cpp_build.kernels(flavour)
    gen = torch.Generator().manual_seed(sum(lens) + heads)
    tokens = sum(lens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 2
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)  # strided rows, as a model's
    k, v = (t.reshape(tokens, kv_heads, head_dim).contiguous()
            for t in qkv[:, heads * head_dim:].chunk(2, 1))
    out = kernels.bidirectional_attention(q, k, v, _starts(lens), head_dim ** -0.5)
    torch.testing.assert_close(out, _reference(q, k, v, lens), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("flavour", cpp_build.runnable_flavours())
def test_a_prompt_never_sees_another_prompt_s_rows(flavour: str):
    """NaN in one prompt's keys and values: exactly that prompt's rows come out NaN."""
    kernels = cpp_build.kernels(flavour)
    q, k, v = (torch.randn(90, 4, 32) for _ in range(3))
    k[40:70], v[40:70] = float("nan"), float("nan")
    out = kernels.bidirectional_attention(q, k, v, _starts([40, 30, 20]), 32 ** -0.5)
    assert out[40:70].isnan().all()
    assert torch.isfinite(out[:40]).all() and torch.isfinite(out[70:]).all()


def test_bad_operands_are_refused_in_one_line():
    kernels = cpp_build.kernels(cpp_build.runnable_flavours()[0])
    q, k, v = (torch.randn(10, 2, 32) for _ in range(3))
    starts = _starts([4, 6])
    cases = [
        ((q, torch.randn(10, 4, 32)[:, :2], v, starts), "contiguous"),  # rows apart
        ((*(torch.randn(10, 2, 24) for _ in range(3)), starts), "multiple of 16"),
        ((q, k, v, starts.int()), "starts must be int64"),
        ((q, k, v, _starts([6, 4]).flip(0)), "must not decrease"),
        ((q, k, v, _starts([4, 5])), "from 0 to 10"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            kernels.bidirectional_attention(*args, 32 ** -0.5)
