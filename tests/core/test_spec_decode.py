"""Speculative decoding: exact greedy output (prompt lookup and draft models, batched, chunked,
preempted, cached, aborted), the target's distribution when sampling, metrics, bad configs."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from pkv import LLM, SamplingParams
from pkv.core.config.engine import EngineConfig
from pkv.core.config.speculative import SpeculativeConfig
from pkv.core.sample.rejection_sampler import RejectionSampler
from pkv.core.sample.sampler import Sampler, SamplingRow
from pkv.core.server.metrics import ServerMetrics
from pkv.core.spec_decode.ngram_proposer import NgramProposer
from pkv.core.structured_output.params import StructuredOutputsParams
from pkv.tests.conftest import PROMPTS
from pkv.tests.helpers import build_tiny_model, check_matches_transformers

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
# A prompt whose answer copies text it holds: prompt lookup drafts most of it.
COPY = ("Repeat the following text exactly.\n\nThe scheduler runs requests first, one decode "
        "token each, then admits waiting requests while the token budget and the free blocks "
        "allow. When blocks run out, the most recently admitted request is preempted.\n\n"
        "Repeated text:\nThe scheduler runs")


def chi_square_bound(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at p = 0.001 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


# ---- configuration ---------------------------------------------------------------------------

@pytest.mark.parametrize("spec, message", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be .*\[1, 16\]"),
    ({"method": "ngram", "num_speculative_tokens": 17}, r"\[1, 16\], got 17"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)"),
    ({"num_speculative_tokens": 2, "lookahead": 3}, "unknown speculative_config key"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a model"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ('{"method": ', "not valid JSON"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
     "disable_by_batch_size"),
])
def test_bad_speculative_configs_are_one_line_errors(spec, message):
    with pytest.raises(ValueError, match=message) as info:
        EngineConfig(speculative_config=spec)
    assert "\n" not in str(info.value)


def test_a_draft_that_cannot_serve_fails_before_the_engine_starts(tmp_path: Path,
                                                                  tiny_llama_dir: Path,
                                                                  smol_hf_dir: Path):
    with pytest.raises(ValueError, match="speculative_config model .*missing"):
        LLM(str(tiny_llama_dir), show_progress=False, kv_cache_memory="4MiB",
            speculative_config={"model": str(tmp_path / "missing"), "num_speculative_tokens": 2})
    other_vocab = build_tiny_model(tmp_path / "small-vocab", smol_hf_dir, vocab_size=1000)
    with pytest.raises(ValueError, match="vocabulary has 1000 tokens, the target's 49152"):
        LLM(str(tiny_llama_dir), show_progress=False, kv_cache_memory="4MiB",
            speculative_config={"model": str(other_vocab), "num_speculative_tokens": 2})


def test_serve_check_refuses_a_bad_speculative_config():
    from typer.testing import CliRunner

    from pkv.cli.main import app

    result = CliRunner().invoke(app, ["serve", "--check", "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 99}'])
    assert result.exit_code != 0 and "num_speculative_tokens" in result.output
    assert "Traceback" not in result.output


# ---- prompt lookup ---------------------------------------------------------------------------

def test_prompt_lookup_takes_the_longest_then_latest_match():
    lookup = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_min=1,
                                             prompt_lookup_max=3)).lookup
    # Suffix 7 8 9 occurs whole at 1..3; 8 9 alone also at 9..10: the longest wins.
    assert lookup([1, 7, 8, 9, 4, 5, 6, 0, 2, 8, 9, 3, 7, 8, 9], 3) == [4, 5, 6]
    assert lookup([5, 1, 5, 2, 5], 2) == [2, 5]  # 5 occurs twice: the latest
    assert lookup([1, 2, 3, 4, 5, 3], 2) == [4, 5]  # what follows is cut at k
    strict = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_min=2,
                                             prompt_lookup_max=3)).lookup
    assert strict([1, 2, 3, 4, 5, 3], 3) == []  # only a 1-token match: below the minimum
    assert strict([9], 3) == []


# ---- exactness, greedy -----------------------------------------------------------------------

def test_ngram_matches_transformers_on_a_tiny_llama(tiny_llama_dir: Path):
    check_matches_transformers(tiny_llama_dir, new_tokens=24, speculative_config=NGRAM)


def test_a_disagreeing_draft_model_matches_transformers(tmp_path: Path, tiny_qwen2_dir: Path,
                                                        smol_hf_dir: Path):
    """A different random model as the draft: most drafts are rejected and rolled back."""
    draft = build_tiny_model(tmp_path / "draft", smol_hf_dir, "llama", hidden_size=32,
                             num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, intermediate_size=64)
    check_matches_transformers(tiny_qwen2_dir, new_tokens=16, speculative_config={
        "model": str(draft), "num_speculative_tokens": 3})


def test_a_q4_0_gguf_of_the_model_drafts_for_it(tmp_path: Path, smol_hf_dir: Path,
                                                smol_gguf: Path, smol_llm):
    """The natural draft of a GGUF: the same model in Q4_0 (its weights in the 4-bit kernel,
    the target's in its own blocks). Greedy output is the target's alone; drafts land
    (~47% at 135M parameters, where Q4_0 and Q4_1 part ways often)."""
    from pkv.tests.gguf_writer import write_gguf

    draft = write_gguf(smol_hf_dir, tmp_path / "smol-q4_0.gguf", "Q4_0", smol_gguf)
    params = SamplingParams(temperature=0, max_tokens=32)
    expected = [o.outputs[0].token_ids for o in smol_llm.generate(PROMPTS[:4], params)]
    llm = LLM(kv_cache_memory="64MiB", max_model_len=512, show_progress=False,
              speculative_config={"model": str(draft), "num_speculative_tokens": 3})
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params)]
        spec = llm.llm_engine.spec_stats
        assert got == expected
        assert spec.num_accepted_tokens > 0.3 * spec.num_draft_tokens > 0
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def smol_ngram(smol_gguf: Path) -> LLM:
    return LLM(kv_cache_memory="64MiB", max_model_len=512, show_progress=False,
               guided_decoding_backend="outlines", speculative_config=NGRAM)


def test_smol_greedy_is_identical_with_prompt_lookup(smol_llm, smol_ngram):
    params = SamplingParams(temperature=0, max_tokens=48)
    prompts = [COPY, *PROMPTS]
    expected = [o.outputs[0].token_ids for o in smol_llm.generate(prompts, params)]
    spec = smol_ngram.llm_engine.spec_stats
    before = spec.num_accepted_tokens
    got = [o.outputs[0].token_ids for o in smol_ngram.generate(prompts, params)]
    assert got == expected
    assert spec.num_accepted_tokens - before > 20  # the copy prompt really speculated
    assert smol_ngram.llm_engine.get_stats().num_blocks_used == 0


def test_a_mixed_batch_keeps_every_request_exact(smol_llm, smol_ngram):
    """Speculating greedy requests next to a guided one (never speculates), logprobs, stop
    strings, min_tokens and a seeded sampled one: each as without speculation."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = [
        SamplingParams(temperature=0, max_tokens=40),
        SamplingParams(temperature=0, max_tokens=40, logprobs=2),
        SamplingParams(temperature=0, max_tokens=40, stop=["preempted"]),
        SamplingParams(temperature=0, max_tokens=20, min_tokens=12, presence_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(json=schema)),
    ]
    prompts = [COPY] * len(params)
    expected = smol_llm.generate(prompts, params)
    got = smol_ngram.generate(prompts, params)
    for e, g in zip(expected, got):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert g.outputs[0].text == e.outputs[0].text
        assert g.outputs[0].finish_reason == e.outputs[0].finish_reason
    assert got[2].outputs[0].finish_reason == "stop"
    lp_e, lp_g = expected[1].outputs[0].logprobs, got[1].outputs[0].logprobs
    assert len(lp_g) == len(got[1].outputs[0].token_ids)
    for a, b in zip(lp_e, lp_g):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-3 for t in a)
    seeded = SamplingParams(temperature=0.8, max_tokens=24, seed=7)
    first, second = (smol_ngram.generate([COPY], seeded)[0].outputs[0].token_ids
                     for _ in range(2))
    assert first == second


def test_abort_mid_speculation_leaves_the_pool_whole(smol_llm, smol_ngram):
    params = SamplingParams(temperature=0, max_tokens=40)
    expected = smol_llm.generate([COPY, PROMPTS[4]], params)
    engine = smol_ngram.llm_engine
    kept = engine.add_request("kept", COPY, params)
    engine.add_request("dropped", COPY + " the", params)
    engine.add_request("other", PROMPTS[4], params)
    drafted = engine.spec_stats.num_draft_tokens
    while engine.spec_stats.num_draft_tokens == drafted:
        engine.step()
    engine.abort_request("dropped")
    finals = {o.request_id: o for o in engine.generate_until_done()}
    assert finals[kept].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert finals["other"].outputs[0].token_ids == expected[1].outputs[0].token_ids
    assert engine.get_stats().num_blocks_used == 0


def test_self_draft_accepts_everything_and_disable_by_batch_size_stops_it(smol_gguf: Path,
                                                                          smol_llm):
    """The bundled model as its own draft: greedy drafts are all accepted (checking the
    draft's paged KV); over the batch limit nothing is drafted, output unchanged."""
    llm = LLM(kv_cache_memory="64MiB", max_model_len=512, show_progress=False,
              speculative_config={"model": str(smol_gguf), "num_speculative_tokens": 3,
                                  "disable_by_batch_size": 2})
    params = SamplingParams(temperature=0, max_tokens=24)
    expected = [o.outputs[0].token_ids for o in smol_llm.generate(PROMPTS[:4], params)]
    spec = llm.llm_engine.spec_stats
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS[:2]]
    assert alone == expected[:2]
    assert spec.num_draft_tokens > 0
    assert spec.num_accepted_tokens >= 0.9 * spec.num_draft_tokens
    drafted = spec.num_draft_tokens
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params)] == expected
    assert spec.num_draft_tokens - drafted < 3 * 2 * 24  # only once <= 2 were left running
    assert llm.llm_engine.get_stats().num_blocks_used == 0


# ---- exactness, sampled ----------------------------------------------------------------------

def test_rejection_sampling_keeps_the_target_distribution():
    """Target rows p0 (first token) and p1 (after the draft): the first token follows p0 and,
    after an accepted draft, the second follows p1, whatever the draft proposed."""
    torch.manual_seed(0)
    p0 = torch.tensor([0.05, 0.4, 0.1, 0.2, 0.25])
    p1 = torch.tensor([0.3, 0.1, 0.1, 0.4, 0.1])
    trials, draft = 4000, [[3, 0]]  # proposes token 3 (p0 = 0.2), then 0
    sampler = RejectionSampler(Sampler(torch.Generator().manual_seed(1)))
    params = SamplingParams(temperature=1.0)
    logits = torch.stack([p0.log(), p1.log(), p1.log()]).repeat(trials, 1)
    rows = [SamplingRow(params, [], [], None, []) for _ in range(3 * trials)]
    out = sampler(logits, rows, draft * trials)
    first = Counter(t[0] for t in out.token_ids)
    second = Counter(t[1] for t in out.token_ids if t[0] == 3)
    for counts, p in ((first, p0), (second, p1)):
        n = sum(counts.values())
        stat = sum((counts[i] - n * float(p[i])) ** 2 / (n * float(p[i])) for i in range(5))
        assert stat < chi_square_bound(4), (counts, p)
    assert first[3] > 0 and sum(first.values()) - first[3] > 0  # both branches taken


def test_engine_sampling_with_a_draft_follows_the_target(tiny_llama_dir: Path):
    """Sampled (top-k 5) with the model as its own draft: the second token, the first that a
    verify step decides, is distributed as transformers' top-5 softmax after the first."""
    from transformers import AutoModelForCausalLM

    prompt = [100 + 7 * i for i in range(12)]
    llm = LLM(str(tiny_llama_dir), show_progress=False, kv_cache_memory="32MiB",
              speculative_config={"model": str(tiny_llama_dir), "num_speculative_tokens": 2})
    params = SamplingParams(n=400, temperature=1.0, top_k=5, max_tokens=3, seed=11,
                            ignore_eos=True)
    outs = llm.generate([prompt], params)[0].outputs
    assert llm.llm_engine.spec_stats.num_drafts >= 400
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    groups: dict[int, Counter] = {}
    for o in outs:
        groups.setdefault(o.token_ids[0], Counter())[o.token_ids[1]] += 1
    stat, df = 0.0, 0
    for first, counts in groups.items():
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + [first]])).logits[0, -1]
        top = logits.topk(5)
        probs = dict(zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist()))
        n = sum(counts.values())
        assert set(counts) <= set(probs)
        stat += sum((counts[t] - n * p) ** 2 / (n * p) for t, p in probs.items())
        df += len(probs) - 1
    assert stat < chi_square_bound(df), (stat, df)


def test_a_blocks_bytes_count_the_drafts_kv_too(tiny_llama_dir: Path):
    # Each block of the pool holds the draft model's K/V of its tokens beside the target's.
    from pkv.core.sched.cache_inspector import take_snapshot

    llm = LLM(str(tiny_llama_dir), show_progress=False, kv_cache_memory="1MiB",
              speculative_config={"model": str(tiny_llama_dir), "num_speculative_tokens": 2})
    engine = llm.llm_engine
    held = sum(kv.numel() * kv.element_size()
               for kv in (engine.runner.kv_cache, engine.proposer.runner.kv_cache))
    assert engine.kv_cache_bytes == held
    per_block = take_snapshot(engine).bytes_per_block
    assert per_block * engine.runner.num_blocks == held
    assert f'bytes_per_block="{per_block}"' in ServerMetrics(engine).render().decode()


# ---- metrics ---------------------------------------------------------------------------------

def test_metrics_count_drafts_and_acceptance(smol_ngram):
    metrics = ServerMetrics(smol_ngram.llm_engine)

    def scrape() -> dict[str, float]:
        values = {}
        for line in metrics.render().decode().splitlines():
            if line.startswith("pkv:spec_decode"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    before = scrape()
    smol_ngram.generate([COPY], SamplingParams(temperature=0, max_tokens=32))
    after = scrape()
    spec = smol_ngram.llm_engine.spec_stats
    drafted = after["pkv:spec_decode_num_draft_tokens_total"]
    accepted = after["pkv:spec_decode_num_accepted_tokens_total"]
    assert drafted > before["pkv:spec_decode_num_draft_tokens_total"]
    assert accepted > before["pkv:spec_decode_num_accepted_tokens_total"]
    assert (drafted, accepted) == (spec.num_draft_tokens, spec.num_accepted_tokens)
    verifies = after["pkv:spec_decode_num_drafts_total"]
    assert after['pkv:spec_decode_acceptance_length_bucket{le="+Inf"}'] == verifies
    assert after["pkv:spec_decode_acceptance_length_sum"] == accepted
    assert after['pkv:spec_decode_acceptance_length_bucket{le="0"}'] == spec.acceptance_lengths[0]
    assert after['pkv:spec_decode_acceptance_length_bucket{le="4"}'] == verifies


# ---- a failing draft -------------------------------------------------------------------------

def test_a_failing_draft_fails_the_speculating_requests_only(tiny_llama_dir: Path):
    """The draft model's pass raises (fault injected into the real engine): the request it
    drafted for ends with the error, a request prefilling in the same step goes on, and the
    next requests speculate again; no block leaks."""
    from pkv.core.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory="8MiB",
                                    speculative_config={"model": str(tiny_llama_dir),
                                                        "num_speculative_tokens": 2}),
                       show_progress=False)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine.add_request("solo", [9, 10, 11], greedy)
    solo = engine.generate_until_done()[-1].outputs[0].token_ids
    engine.add_request("victim", [5, 6, 7, 8], greedy)
    engine.step()  # prefilled: it drafts from the next step on
    runner = engine.proposer.runner

    def explode(*args: object) -> None:
        raise RuntimeError("injected draft fault")

    runner.run_step = explode
    engine.add_request("bystander", [9, 10, 11], greedy)
    outputs = {o.request_id: o for o in engine.step()}
    del runner.run_step  # the draft works again
    assert "injected draft fault" in (outputs["victim"].error or "")
    assert outputs["victim"].finished
    finals = {o.request_id: o for o in engine.generate_until_done()}
    assert finals["bystander"].outputs[0].token_ids == solo and not finals["bystander"].error
    drafted = engine.spec_stats.num_draft_tokens
    engine.add_request("after", [9, 10, 11], greedy)
    assert engine.generate_until_done()[-1].outputs[0].token_ids == solo
    assert engine.spec_stats.num_draft_tokens > drafted
    assert engine.get_stats().num_blocks_used == 0


def test_a_draft_reuses_its_kv_of_a_cached_prefix(tiny_llama_dir: Path):
    """Requests sharing a long prefix (the model as its own draft, so every draft of right
    K/V is accepted): the later ones' catch-up starts after the cached blocks that still
    hold the draft's K/V of that prefix, with the same tokens and every draft accepted."""
    doc = [100 + (31 * i) % 4000 for i in range(96)]  # 6 blocks of 16
    prompts = [doc + [7000 + r] for r in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    options = dict(max_model_len=256, block_size=16, show_progress=False)
    plain = LLM(str(tiny_llama_dir), **options)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    plain.shutdown()
    llm = LLM(str(tiny_llama_dir), **options,
              speculative_config={"model": str(tiny_llama_dir), "num_speculative_tokens": 3})
    engine = llm.llm_engine
    got = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert got == expected
    stats = engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    # The first request's draft runs its whole prompt; each later one only its last token
    # and what it generates (the document's 6 blocks are cached with the draft's K/V).
    generated = sum(len(g) for g in got)
    assert engine.proposer.num_catch_up_tokens <= len(prompts[0]) + 3 * 1 + generated
    llm.shutdown()


def test_a_windowed_models_draft_never_writes_into_the_blocks_it_gave_back(
        tmp_path: Path, smol_hf_dir: Path):
    """Behind a window a request's table keeps placeholders where other requests' blocks
    now are: a long prompt's draft catch-up starts at the blocks it holds, so a neighbour's
    drafts (here a short request holding block 0) are what they are alone."""
    from pkv.tests.helpers import build_tiny_model

    model = str(build_tiny_model(tmp_path / "mistral", smol_hf_dir, "mistral",
                                 sliding_window=16))
    llm = LLM(model, kv_cache_memory="16MiB", max_model_len=256, block_size=4,
              show_progress=False,
              speculative_config={"model": model, "num_speculative_tokens": 3})
    short = [(11 * j) % 40000 + 300 for j in range(8)]
    long = [(7 * j) % 40000 + 100 for j in range(59)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = llm.llm_engine.spec_stats

    def drafted(prompts: list[list[int]]) -> tuple[list[list[int]], int, int]:
        before = (spec.num_accepted_tokens, spec.num_draft_tokens)
        llm.llm_engine.kv_cache.pool.reset_prefix_cache()
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        return outs, spec.num_accepted_tokens - before[0], spec.num_draft_tokens - before[1]

    alone = [drafted([p]) for p in (short, long)]
    together = drafted([short, long])
    assert together[0] == [alone[0][0][0], alone[1][0][0]]
    assert together[1:] == (alone[0][1] + alone[1][1], alone[0][2] + alone[1][2])
    assert alone[0][1] == alone[0][2] > 0  # the short one: every draft accepted
