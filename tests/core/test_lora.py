"""Multi-LoRA: a batch mixing adapters (different ranks and targets) and the base model
equals transformers with each adapter merged, request by request; prefix-cache isolation;
slots cycling under max_loras; bad adapters refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pkv import LLM, LoRARequest, SamplingParams
from pkv.core.lora.slots import LoRASlotTable
from pkv.tests.conftest import KERNEL_FLAVOURS
from pkv.tests.helpers import (build_tiny_model, hf_greedy, kv_block_bytes, make_lora_adapter,
                               parity_prompts)

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NEW = 12


def _adapters(base: Path, root: Path) -> list[tuple[LoRARequest, object]]:
    """Two adapters: rank 8 on all seven projections, rank 4 (rsLoRA) on q/v and down."""
    a = make_lora_adapter(base, root / "a", 8, ALL, seed=1)
    b = make_lora_adapter(base, root / "b", 4, ["q_proj", "v_proj", "down_proj"], seed=2,
                          rslora=True)
    return [(LoRARequest("a", 1, str(root / "a")), a), (LoRARequest("b", 2, str(root / "b")), b)]


def check_mixed_batch(base: Path, root: Path, prompts: list[list[int]], eos: int | None,
                      python_loop: bool = True, served: Path | None = None) -> None:
    """pkv serving `served` (default: `base`, the HF folder the adapters and the reference
    come from) with two adapters and none, mixed in one batch, against transformers."""
    from transformers import AutoModelForCausalLM

    adapters = _adapters(base, root)
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    loras = [[None, adapters[0][0], adapters[1][0]][i % 3] for i in range(len(prompts))]
    refs = {None: plain, "a": adapters[0][1], "b": adapters[1][1]}
    expected = [hf_greedy(refs[l.lora_name if l else None], [p], NEW, eos)[0]
                for p, l in zip(prompts, loras)]
    assert expected[1] != hf_greedy(plain, [prompts[1]], NEW, eos)[0]  # the adapter matters
    params = SamplingParams(temperature=0, max_tokens=NEW)
    per_block, _ = kv_block_bytes(base, 4)
    longest = max(map(len, prompts)) + NEW
    runs = [dict(max_num_batched_tokens=16, max_model_len=longest + 8,  # chunked, cached,
                 attention_backend="torch"),  # the Python layer loop (else the C++ stack)
            dict(kv_cache_memory=per_block * (2 * -(-longest // 4) + 1),
                 max_model_len=longest + 8)]  # preemption
    runs = runs if python_loop else runs[1:]  # (the layer loop is the same for every family)
    for options in runs:
        options.setdefault("kv_cache_memory", "16MiB")
        llm = LLM(str(served or base), show_progress=False, block_size=4, enable_lora=True,
                  max_loras=2, max_lora_rank=8, **options)
        for _ in range(2):  # the second time from the prefix cache
            outs = llm.generate(prompts, params, lora_request=loras)
            assert [o.outputs[0].token_ids for o in outs] == expected, options
        stats = llm.llm_engine.get_stats()
        assert stats.num_blocks_used == 0
        if "attention_backend" not in options:  # adapters inside the C++ decoder stack
            assert (llm.llm_engine.runner.model.model.fused is not None) == bool(KERNEL_FLAVOURS)
        if "max_num_batched_tokens" not in options:
            assert stats.num_preemptions > 0
        else:
            assert stats.prefix_cache_hits > 0


def test_mixed_adapters_match_merged_transformers_on_tiny_llama(tiny_llama_dir: Path,
                                                                tmp_path: Path):
    check_mixed_batch(tiny_llama_dir, tmp_path, parity_prompts(6, 9, 40), eos=2)


def test_mixed_adapters_match_merged_transformers_on_tiny_qwen3(tmp_path: Path,
                                                                smol_hf_dir: Path):
    base = build_tiny_model(tmp_path / "qwen3", smol_hf_dir, "qwen3", head_dim=16)
    check_mixed_batch(base, tmp_path, parity_prompts(6, 9, 40), eos=2, python_loop=False)


def test_mixed_adapters_match_merged_transformers_on_smollm2(smol_hf_dir: Path,
                                                             smol_prompt_ids, tmp_path: Path):
    check_mixed_batch(smol_hf_dir, tmp_path, smol_prompt_ids[:3], eos=None, python_loop=False)


def test_adapters_on_the_gguf_in_its_blocks_match_merged_transformers(
        smol_hf_dir: Path, smol_gguf: Path, smol_prompt_ids, tmp_path: Path):
    # The bundled GGUF's Q4_1 linears (4-bit tiles) and Q8_0 head under float32 adapters; the
    # reference is transformers on the same weights, dequantized (smol_hf_dir).
    check_mixed_batch(smol_hf_dir, tmp_path, smol_prompt_ids[:3], eos=None, python_loop=False,
                      served=smol_gguf)


def test_an_adapter_on_phi3s_own_fused_projections_matches_merged_transformers(
        tmp_path: Path, smol_hf_dir: Path):
    # Phi-3's checkpoint fuses q/k/v and gate/up, so PEFT targets qkv_proj and gate_up_proj:
    # one A and a B over every shard's rows.
    base = build_tiny_model(tmp_path / "phi3", smol_hf_dir, "phi3", head_dim=16)
    merged = make_lora_adapter(base, tmp_path / "a", 8, ["qkv_proj", "gate_up_proj",
                                                         "down_proj"], seed=5)
    prompts = parity_prompts(3, 9, 30)
    expected = hf_greedy(merged, prompts, NEW, 2)
    llm = LLM(str(base), show_progress=False, kv_cache_memory="8MiB", enable_lora=True)
    request = LoRARequest("a", 1, str(tmp_path / "a"))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW),
                        lora_request=request)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=NEW))[0] \
        .outputs[0].token_ids != expected[0]  # the adapter matters


def test_the_same_prompt_under_two_adapters_shares_no_blocks(tiny_llama_dir: Path,
                                                             tmp_path: Path):
    make_lora_adapter(tiny_llama_dir, tmp_path / "a", 4, ["q_proj"], seed=3)
    make_lora_adapter(tiny_llama_dir, tmp_path / "b", 4, ["q_proj"], seed=4)
    llm = LLM(str(tiny_llama_dir), show_progress=False, kv_cache_memory="8MiB",
              enable_lora=True)
    prompt = parity_prompts(1, 64, 64)[0]
    params = SamplingParams(temperature=0, max_tokens=2)
    a = LoRARequest("a", 1, str(tmp_path / "a"))
    b = LoRARequest("b", 2, str(tmp_path / "b"))
    first = llm.generate([prompt], params, lora_request=a)[0]
    assert first.num_cached_tokens == 0
    assert llm.generate([prompt], params, lora_request=b)[0].num_cached_tokens == 0
    assert llm.generate([prompt], params)[0].num_cached_tokens == 0  # the base model
    assert llm.generate([prompt], params, lora_request=a)[0].num_cached_tokens > 0


def test_more_adapters_than_slots_cycle_and_stay_exact(tiny_llama_dir: Path, tmp_path: Path):
    """Three adapters through one slot: each request waits until the slot is free (never
    overwritten under a running request) and decodes what it decodes alone."""
    requests = []
    for i in range(3):
        make_lora_adapter(tiny_llama_dir, tmp_path / f"l{i}", 4, ALL, seed=10 + i)
        requests.append(LoRARequest(f"l{i}", i + 1, str(tmp_path / f"l{i}")))
    params = SamplingParams(temperature=0, max_tokens=8)
    prompts = parity_prompts(6, 9, 30)
    alone = LLM(str(tiny_llama_dir), show_progress=False, kv_cache_memory="8MiB",
                enable_lora=True, max_loras=3)
    expected = [alone.generate([p], params, lora_request=requests[i % 3])[0].outputs[0].token_ids
                for i, p in enumerate(prompts)]
    llm = LLM(str(tiny_llama_dir), show_progress=False, kv_cache_memory="8MiB",
              enable_lora=True, max_loras=1)
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params, lora_request=requests[i % 3])
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[int(out.request_id)] = out.outputs[0].token_ids
        running = {r.lora.name for r in engine.scheduler.running}
        assert len(running) <= 1  # one slot: one adapter at a time
    assert [finals[i] for i in range(len(prompts))] == expected


def test_slot_table_evicts_least_recently_used_unpinned():
    table = LoRASlotTable(2)
    assert table.acquire(1) == (0, True)
    assert table.acquire(2) == (1, True)
    assert table.acquire(3) is None  # both pinned
    table.release(1)
    assert table.acquire(2) == (1, False)  # resident: no load
    assert table.acquire(3) == (0, True)  # 1 was unpinned: evicted
    assert table.acquire(1) is None


def _write_adapter(folder: Path, config: dict, tensors: dict) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def lora_llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), show_progress=False, kv_cache_memory="4MiB",
               enable_lora=True)


LORA_CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8}
KEY = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("case, message", [
    ("no_config", "no adapter_config.json"),
    ("prefix_tuning", "only LORA adapters serve"),
    ("dora", "sets use_dora: DoRA adapters are not supported"),
    ("rank", "rank 32, above max_lora_rank=16"),
    ("target", "lm_head is not a linear layer of this model's decoder"),
    ("shape", "do not fit the model's projection"),
    ("nan", "NaN or infinite"),
    ("pickle", "pickle, which pkv never loads"),
])
def test_bad_adapters_are_one_line_errors(case: str, message: str, lora_llm: LLM,
                                          tmp_path: Path):
    good = {f"{KEY}.lora_A.weight": torch.randn(4, 64), f"{KEY}.lora_B.weight": torch.randn(64, 4)}
    folder = tmp_path / case
    if case == "no_config":
        folder.mkdir()
    elif case == "prefix_tuning":
        _write_adapter(folder, {**LORA_CONFIG, "peft_type": "PREFIX_TUNING"}, good)
    elif case == "dora":  # as PEFT writes one, less its magnitude vectors
        _write_adapter(folder, {**LORA_CONFIG, "use_dora": True}, good)
    elif case == "rank":
        _write_adapter(folder, LORA_CONFIG, {f"{KEY}.lora_A.weight": torch.randn(32, 64),
                                             f"{KEY}.lora_B.weight": torch.randn(64, 32)})
    elif case == "target":
        head = "base_model.model.lm_head"
        _write_adapter(folder, LORA_CONFIG, {f"{head}.lora_A.weight": torch.randn(4, 64),
                                             f"{head}.lora_B.weight": torch.randn(49152, 4)})
    elif case == "shape":
        _write_adapter(folder, LORA_CONFIG, {f"{KEY}.lora_A.weight": torch.randn(4, 96),
                                             f"{KEY}.lora_B.weight": torch.randn(64, 4)})
    elif case == "nan":
        _write_adapter(folder, LORA_CONFIG, {**good, f"{KEY}.lora_A.weight":
                                             torch.full((4, 64), float("nan"))})
    else:
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps(LORA_CONFIG))
        (folder / "adapter_model.bin").write_bytes(b"\x80\x04")
    llm = lora_llm
    with pytest.raises(ValueError, match=message) as info:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1),
                     lora_request=LoRARequest(case, 1, str(folder)))
    assert "\n" not in str(info.value) and case in str(info.value)
    assert llm.llm_engine.get_stats().num_blocks_used == 0


def test_lora_requests_need_enable_lora(tiny_llama_dir: Path, tmp_path: Path):
    llm = LLM(str(tiny_llama_dir), show_progress=False, kv_cache_memory="4MiB")
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate([[5, 6]], lora_request=LoRARequest("x", 1, str(tmp_path)))


def test_an_adapter_by_hub_id_comes_from_the_cache(tiny_llama_dir: Path, tmp_path: Path,
                                                   hub_cache: Path):
    """Offline, from a hub cache laid out as huggingface_hub writes it: the same output as
    the folder; a missing id is a one-line error naming it."""
    from pkv.tests.models.test_hub import add_snapshot, folder_files

    make_lora_adapter(tiny_llama_dir, tmp_path / "local", 4, ALL, seed=7)
    add_snapshot(hub_cache, "someone/tiny-lora", "c" * 40, folder_files(tmp_path / "local"))
    llm = LLM(str(tiny_llama_dir), show_progress=False, kv_cache_memory="8MiB",
              enable_lora=True)
    params = SamplingParams(temperature=0, max_tokens=8)
    prompt = parity_prompts(1, 12, 12)[0]
    local = llm.generate([prompt], params, lora_request=LoRARequest(
        "local", 1, str(tmp_path / "local")))[0].outputs[0].token_ids
    hub = llm.generate([prompt], params, lora_request=LoRARequest(
        "hub", 2, "someone/tiny-lora"))[0].outputs[0].token_ids
    assert hub == local
    with pytest.raises(ValueError, match="someone/missing is neither a local folder nor in "
                                         "the Hugging Face cache") as info:
        llm.generate([prompt], params, lora_request=LoRARequest("x", 3, "someone/missing"))
    assert "\n" not in str(info.value)
