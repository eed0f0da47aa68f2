"""Sliding-window attention: Mistral / Qwen2 windows decode as transformers does, and a
request whose every layer is windowed holds about a window of KV blocks, not its length."""

from __future__ import annotations

from pathlib import Path

import pytest

from pkv import LLM, SamplingParams
from pkv.core.sched.kv_cache_manager import KVCacheManager, cdiv
from pkv.core.sched.request import Request
from pkv.tests.helpers import build_tiny_model, check_matches_transformers, hf_greedy

WINDOW = 16


@pytest.fixture(scope="module")
def mistral_window_dir(tmp_path_factory: pytest.TempPathFactory, smol_hf_dir: Path) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("mistral-window"), smol_hf_dir, "mistral",
                            sliding_window=WINDOW, head_dim=32)


def test_mistral_window_matches_transformers(mistral_window_dir: Path):
    check_matches_transformers(mistral_window_dir)


def _with_config(model_dir: Path, **fields: object) -> Path:
    """`model_dir`'s config.json with `fields` set (None: the key removed)."""
    import json

    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for key, value in fields.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return model_dir


def test_windows_are_where_transformers_puts_them(tmp_path: Path, smol_hf_dir: Path):
    from pkv.core.model_loader.loader import open_model

    # transformers loads a Mistral config with layer_types as Ministral: windows per layer
    mistral = _with_config(build_tiny_model(tmp_path / "mistral", smol_hf_dir, "mistral"),
                           sliding_window=8, layer_types=["full_attention", "sliding_attention"])
    check_matches_transformers(mistral)
    # with no sliding_window key, MistralConfig's 4096 (null: none)
    assert open_model(str(_with_config(mistral, sliding_window=None, layer_types=None))) \
        .config.layer_windows == (4096, 4096)
    # its Llama, Granite and OLMo2 attention reads neither field (its generate() then keeps
    # a windowed cache for decode: not the model's attention, so not compared here)
    for arch in ("llama", "granite", "olmo2"):
        model = _with_config(build_tiny_model(tmp_path / arch, smol_hf_dir, arch),
                             sliding_window=8, layer_types=["sliding_attention"] * 2)
        assert open_model(str(model)).config.layer_windows == (None, None)


def test_qwen2_windowed_upper_layers_match_transformers(tmp_path: Path, smol_hf_dir: Path):
    # layer 0 global, layer 1 windowed: the hybrid case keeps every block
    model_dir = build_tiny_model(tmp_path / "qwen2", smol_hf_dir, "qwen2",
                                 use_sliding_window=True, sliding_window=8,
                                 max_window_layers=1)
    check_matches_transformers(model_dir)


def _peak_blocks(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    """Generate one request step by step; (its tokens, the most blocks in use at once)."""
    engine = llm.llm_engine
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                      ignore_eos=True))
    peak, final = 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
        peak = max(peak, engine.get_stats().num_blocks_used)
    assert final is not None and engine.get_stats().num_blocks_used == 0
    return final.outputs[0].token_ids, peak


def test_long_windowed_generation_holds_a_window_of_blocks(mistral_window_dir: Path,
                                                           tmp_path: Path, smol_hf_dir: Path):
    from transformers import AutoModelForCausalLM

    prompt, new, block = [100 + 7 * j for j in range(20)], 100, 4
    llm = LLM(str(mistral_window_dir), block_size=block, kv_cache_memory="4MiB",
              show_progress=False)
    tokens, peak = _peak_blocks(llm, prompt, new)
    hf = AutoModelForCausalLM.from_pretrained(mistral_window_dir,
                                              attn_implementation="eager").eval()
    assert tokens == hf_greedy(hf, [prompt], new, None)[0]
    # the window's blocks, the one being filled and one partly before the window
    assert peak <= cdiv(WINDOW, block) + 2
    # the same model without a window holds its whole length
    full_dir = build_tiny_model(tmp_path / "full", smol_hf_dir, "mistral", head_dim=32)
    _, full_peak = _peak_blocks(LLM(str(full_dir), block_size=block, kv_cache_memory="4MiB",
                                    show_progress=False), prompt, new)
    assert full_peak == cdiv(len(prompt) + new - 1, block)


def _request(rid: str, tokens: list[int]) -> Request:
    from pkv.core.sample.sampling_params import SamplingParams as Params

    return Request(rid, tokens, Params(), frozenset({2}), 4)


def test_blocks_behind_the_window_go_back_to_the_pool():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True, sliding_window=6)
    a = _request("a", list(range(20)))
    assert kv.allocate_slots(a, 10)  # positions 0..9
    a.num_computed_tokens = 10
    assert kv.allocate_slots(a, 1)  # position 10 sees 5..10: block 0 (0..3) is behind
    assert kv.block_ids("a")[0] == kv.null_block.block_id and kv.req_blocks["a"][0] is kv.null_block
    assert kv.pool.num_used_blocks == 2
    # the released block stays findable by its hash until the pool needs it
    b = _request("b", list(range(20)))
    hits, cached = kv.get_computed_blocks(b)
    assert cached == 8 and len(hits) == 2
    kv.free(a)
    assert kv.pool.num_used_blocks == 0 and kv.pool.num_free_blocks == 8


def test_no_window_keeps_every_block():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    a = _request("a", list(range(20)))
    assert kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    assert kv.allocate_slots(a, 6)
    assert kv.pool.num_used_blocks == 4 and kv.null_block not in kv.req_blocks["a"]
