"""The sampler on hand-made logits: penalties, top-k/top-p/min-p, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pkv.core.sample.sampler import Sampler, SamplingRow, _top_k_top_p, draw
from pkv.core.sample.sampling_params import SamplingParams


def _row(params: SamplingParams, prompt=(), output=(), seed: int | None = None,
         banned=()) -> SamplingRow:
    generator = None
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
    return SamplingRow(params, list(prompt), list(output), generator, list(banned))


def _sampler() -> Sampler:
    return Sampler(torch.Generator().manual_seed(0))


def test_greedy_takes_argmax_per_row():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 1.0, 2.0]])
    out = _sampler()(logits, [_row(SamplingParams(temperature=0))] * 2)
    assert out.token_ids == [1, 0]


def test_greedy_breaks_ties_to_the_first_token_as_argmax_does():
    logits = torch.randn(64, 1000).round()  # integers: many rows tie at their max
    logits[:, 500] = logits.max(dim=-1).values
    out = _sampler()(logits, [_row(SamplingParams(temperature=0))] * 64)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert all(logits[i, :t].max() < logits[i, t] for i, t in enumerate(out.token_ids) if t)


def _awkward_logits(rows: int, n: int) -> torch.Tensor:
    """Rows that tie at their max, hold NaNs, -inf or +inf, or peak in the tail."""
    torch.manual_seed(rows * 7 + n)
    logits = torch.randn(rows, n).mul(4).round()  # integers: rows tie at their max
    logits[0, n // 2] = logits[0].max()  # a second maximum after the first
    if rows > 1:
        logits[1, [n // 3, n - 1]] = float("nan")  # the first NaN wins
    if rows > 2:
        logits[2] = float("-inf")
    if rows > 3:
        logits[3, n - 1] = float("inf")  # the very last element
    if rows > 4:
        logits[4, 0] = float("nan")
    return logits


@pytest.mark.parametrize("rows,n", [(1, 3), (5, 37), (9, 1000), (70, 49153), (2, 64)])
def test_first_argmax_kernel_is_torch_argmax(rows: int, n: int, cpu_kernels):
    logits = _awkward_logits(rows, n)
    assert cpu_kernels.first_argmax(logits).tolist() == logits.argmax(dim=-1).tolist()
    assert cpu_kernels.first_argmax(logits[:0]).tolist() == []


def test_first_argmax_kernel_refuses_what_it_cannot_read(cpu_kernels):
    for bad in (torch.zeros(4, 6)[:, ::2], torch.zeros(4, 6, dtype=torch.float64),
                torch.zeros(6), torch.zeros(3, 0)):
        with pytest.raises(RuntimeError, match="contiguous float32"):
            cpu_kernels.first_argmax(bad)


def test_sampler_with_the_kernel_samples_as_with_torch(cpu_kernels):
    logits = _awkward_logits(6, 500)
    logits[1:3] = torch.randn(2, 500)  # rows to sample (no NaN or -inf rows among them)
    rows = [_row(SamplingParams(temperature=0))] * 6
    rows[1] = _row(SamplingParams(temperature=0.8, top_k=50), seed=3)
    rows[2] = _row(SamplingParams(temperature=1.0, top_p=0.9), seed=4)
    fast = Sampler(torch.Generator().manual_seed(0), cpu_kernels.first_argmax)
    want = _sampler()(logits.clone(), rows).token_ids
    for row in rows:  # the seeded rows draw again from the start
        if row.generator is not None:
            row.generator.manual_seed(3 if row is rows[1] else 4)
    assert fast(logits.clone(), rows).token_ids == want
    # a view the kernel cannot read goes to torch's argmax
    wide = torch.cat([logits, logits], dim=1)[:, :500]
    assert not wide.is_contiguous()
    assert fast.greedy(wide).tolist() == logits.argmax(dim=-1).tolist()


def test_penalties_follow_their_definitions():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    rows = lambda **kw: [_row(SamplingParams(temperature=0, **kw), prompt=[1], output=[0, 0, 2])]
    apply = Sampler._apply_penalties
    freq = apply(logits, rows(frequency_penalty=0.5))
    assert freq.tolist() == [[2.0 - 1.0, -2.0, 1.0 - 0.5, 0.5]]  # minus penalty x count
    pres = apply(logits, rows(presence_penalty=0.5))
    assert pres.tolist() == [[1.5, -2.0, 0.5, 0.5]]  # minus penalty once per seen token
    rep = apply(logits, rows(repetition_penalty=2.0))
    # prompt and output tokens: positive logits halved, negative doubled; unseen untouched
    assert rep.tolist() == [[1.0, -4.0, 0.5, 0.5]]


def test_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.5]])
    row = _row(SamplingParams(temperature=0, frequency_penalty=1.0), output=[0])
    assert _sampler()(logits, [row]).token_ids == [1]


def test_top_k_one_is_greedy_whatever_the_seed():
    torch.manual_seed(0)
    logits = torch.randn(16, 100)
    rows = [_row(SamplingParams(temperature=1.5, top_k=1), seed=s) for s in range(16)]
    assert _sampler()(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_a_top_k_past_int64_keeps_every_token_as_top_k_off_does():
    torch.manual_seed(0)
    logits = torch.randn(8, 100)
    huge = [_row(SamplingParams(temperature=1.0, top_k=2**70), seed=s) for s in range(8)]
    off = [_row(SamplingParams(temperature=1.0, top_k=0), seed=s) for s in range(8)]
    assert _sampler()(logits, huge).token_ids == _sampler()(logits, off).token_ids


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(200, 1)
    rows = [_row(SamplingParams(temperature=1.0, top_p=0.6), seed=s) for s in range(200)]
    seen = set(_sampler()(logits, rows).token_ids)
    assert seen == {0, 1}


def _sorted_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor,
                        top_p: torch.Tensor) -> torch.Tensor:
    """The definition, on each row sorted whole: the top-k best, then the smallest prefix of
    them whose probability (over the kept top-k) reaches top_p."""
    ordered, order = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k, logits.shape[1])
    ordered = ordered.masked_fill(torch.arange(logits.shape[1]) >= k.unsqueeze(1), -math.inf)
    probs = ordered.softmax(dim=-1)
    ordered = ordered.masked_fill(probs.cumsum(-1) - probs >= top_p.unsqueeze(1), -math.inf)
    return torch.full_like(logits, -math.inf).scatter(1, order, ordered)


def test_top_k_top_p_among_candidates_keeps_what_a_full_sort_keeps():
    # A 5,000-token vocabulary: nuclei among the best 1,024 tokens, one wider (a flat row, sorted
    # whole), top-k alone, both, a top-k past 1,024 (the candidates grow to it), a row left be.
    torch.manual_seed(3)
    logits = torch.randn(7, 5000) * torch.tensor([[8.0], [8.0], [0.1], [8.0], [2.0], [3.0], [1.0]])
    top_k = torch.tensor([0, 0, 0, 40, 30, 2000, 0])
    top_p = torch.tensor([0.9, 0.5, 0.95, 1.0, 0.8, 0.9, 1.0])
    got, expected = _top_k_top_p(logits, top_k, top_p), _sorted_top_k_top_p(logits, top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert torch.equal(got[~torch.isinf(got)], logits[~torch.isinf(expected)])
    kept = (~torch.isinf(got)).sum(dim=-1)
    assert int(kept[2]) > 1024 and int(kept[6]) == 5000 and int(kept[3]) == 40


def test_draw_never_lands_on_a_zero_and_follows_the_row():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]]).repeat(4000, 1)
    generator = torch.Generator().manual_seed(0)
    tokens = draw(probs * 3, [generator] * 4000)  # unnormalized rows draw the same
    freq = torch.bincount(tokens, minlength=5).float() / 4000
    assert set(tokens.tolist()) == {1, 3} and abs(float(freq[3]) - 0.75) < 0.03
    # Nothing to draw from: the row's argmax, not an index past its end.
    assert draw(torch.tensor([[0.0, 0.0], [math.nan, 1.0]]), [generator] * 2).tolist() == [0, 0]


def test_min_p_drops_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]])).repeat(200, 1)
    rows = [_row(SamplingParams(temperature=1.0, min_p=0.3), seed=s) for s in range(200)]
    assert set(_sampler()(logits, rows).token_ids) == {0, 1}


def test_min_p_comes_before_top_p():
    """vLLM's order: the nucleus is taken over what min-p kept, renormalized (0.4 and 0.3 ->
    0.57 and 0.43: token 0 alone reaches top_p 0.5; over the whole row it would not)."""
    probs = torch.tensor([0.4, 0.3] + [0.001] * 300)
    logits = probs.log().repeat(200, 1)
    rows = [_row(SamplingParams(temperature=1.0, top_p=0.5, min_p=0.5), seed=s)
            for s in range(200)]
    assert set(_sampler()(logits, rows).token_ids) == {0}


def test_logit_bias_comes_before_the_penalties():
    """vLLM's order: a biased token the repetition penalty also hits is (2 + 5) / 1.3."""
    params = SamplingParams(temperature=1.0, repetition_penalty=1.3, logit_bias={1: 5.0})
    logits, _ = _sampler().process(torch.tensor([[0.0, 2.0, 1.0]]), [_row(params, prompt=[1])])
    assert logits[0, 1].item() == pytest.approx(7.0 / 1.3)


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    logits = probs.log().repeat(4000, 1)
    out = _sampler()(logits, [_row(SamplingParams(temperature=1.0))] * 4000).token_ids
    freq = torch.bincount(torch.tensor(out), minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.04)


def test_same_seed_same_sample_regardless_of_batch():
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    alone = _sampler()(logits[1:2], [_row(SamplingParams(temperature=1.0), seed=42)])
    batch = _sampler()(logits, [_row(SamplingParams(temperature=1.0), seed=s) for s in (7, 42, 9)])
    assert alone.token_ids[0] == batch.token_ids[1]


def test_banned_tokens_are_never_sampled():
    logits = torch.tensor([[10.0, 0.0, 0.0]])
    out = _sampler()(logits, [_row(SamplingParams(temperature=0), banned=[0])])
    assert out.token_ids != [0]


def test_logprobs_report_raw_top_k_and_rank():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    out = _sampler()(logits, [_row(SamplingParams(temperature=0, logprobs=2))])
    top_ids, top_vals, chosen, rank = out.logprobs[0]
    expected = torch.log_softmax(logits, -1)[0]
    assert top_ids == [1, 2] and rank == 1
    assert chosen == pytest.approx(float(expected[1]))
    assert top_vals == pytest.approx([float(expected[1]), float(expected[2])])
    assert math.isclose(sum(math.exp(v) for v in expected.tolist()), 1.0, rel_tol=1e-5)
