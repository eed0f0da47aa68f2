"""core/worker/huge_pages.py: which weights move onto 2 MB pages, that they keep their values,
identity and ties, that an engine's C++ decoder runs on the moved weights, and that the KV
pool is allocated on 2 MB pages where the kernel grants them."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch
from torch import nn

from pkv.core.config.engine import EngineConfig
from pkv.core.engine.llm_engine import LLMEngine
from pkv.core.sample.sampling_params import SamplingParams
from pkv.core.worker import huge_pages
from pkv.core.worker.huge_pages import (HUGE_PAGE, empty_on_huge_pages, huge_page_block,
                                        move_weights_to_huge_pages, movable_weights, thp_mode)

THP_IN_KERNEL = Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 32)  # a lookup table only: stays
        self.tied_embed = nn.Embedding(64, 32)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.tied_embed.weight  # streamed by the head: moves
        self.a = nn.Linear(64, 48)  # weight 12 KB moves, bias 192 B is too small
        self.b = nn.Linear(48, 40, bias=False)
        whole = torch.randn(4096)
        self.view = nn.Parameter(whole[1024:3072], requires_grad=False)  # a view: stays


def test_thp_mode_reads_the_bracketed_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "_THP_SETTING", setting)
    assert thp_mode() == "madvise"
    setting.write_text("[always] madvise never\n")
    assert thp_mode() == "always"
    monkeypatch.setattr(huge_pages, "_THP_SETTING", tmp_path / "missing")
    assert thp_mode() == ""


def test_movable_weights_are_streamed_whole_and_large_enough():
    model = _Model()
    moved = {id(p) for p in movable_weights(model, 4096)}
    assert moved == {id(model.tied_embed.weight), id(model.a.weight), id(model.b.weight)}


def test_move_keeps_values_identity_and_ties():
    model = _Model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    params = {name: p for name, p in model.named_parameters()}
    embed_ptr = model.embed.weight.data_ptr()
    moved = move_weights_to_huge_pages(model, 4096, mode="madvise")
    if not THP_IN_KERNEL:  # madvise(MADV_HUGEPAGE) fails: nothing moves
        assert moved == 0
        return
    weights = [model.tied_embed.weight, model.a.weight, model.b.weight]
    assert moved == sum(p.nbytes for p in weights)
    storages = {p.untyped_storage().data_ptr() for p in weights}
    assert len(storages) == 1  # one block
    assert min(p.data_ptr() for p in weights) % HUGE_PAGE == 0
    assert all(p.data_ptr() % 64 == 0 for p in weights)
    for name, p in model.named_parameters():
        assert p is params[name] and torch.equal(p, before[name]), name
    assert model.head.weight is model.tied_embed.weight
    assert model.embed.weight.data_ptr() == embed_ptr  # the lookup table stayed
    assert move_weights_to_huge_pages(model, 4096, mode="madvise") == 0  # nothing left


def test_nothing_moves_where_thp_is_never():
    model = _Model()
    ptr = model.a.weight.data_ptr()
    assert move_weights_to_huge_pages(model, 4096, mode="never") == 0
    assert model.a.weight.data_ptr() == ptr


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, torch.float8_e4m3fn])
def test_kv_pool_tensors_start_on_a_huge_page_where_the_kernel_grants_them(dtype: torch.dtype):
    shape = (2, 2, 37, 16, 3, 68)
    t = empty_on_huge_pages(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    granted = huge_page_block(4096) is not None
    assert granted == (thp_mode() in ("always", "madvise") and THP_IN_KERNEL)
    assert (t.data_ptr() % HUGE_PAGE == 0) or not granted
    t.view(torch.uint8).fill_(7)  # every byte is the tensor's own to write
    assert int(t.view(torch.uint8).sum()) == 7 * t.numel() * t.element_size()
    elsewhere = empty_on_huge_pages(shape, dtype, "meta")  # not a CPU: torch.empty's
    assert elsewhere.device.type == "meta" and elsewhere.shape == shape
    assert huge_page_block(4096, mode="never") is None
    assert huge_page_block(0, mode="madvise") is None


def test_engine_decodes_on_the_moved_weights(tiny_llama_dir: Path):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory="4MiB"),
                       show_progress=False)
    model = engine.runner.model
    weights = [layer.mlp.gate_up_proj.weight for layer in model.model.layers]
    block = {w.untyped_storage().data_ptr() for w in weights}
    moved = thp_mode() in ("always", "madvise") and THP_IN_KERNEL
    assert (len(block) == 1) == moved
    assert (engine.runner.kv_cache.data_ptr() % HUGE_PAGE == 0) or not moved
    # The token table (a VocabEmbedding) joins the block only as a tied LM head's weight.
    embed = model.model.embed_tokens.weight
    tied = getattr(model.lm_head, "weight", None) is embed
    assert (embed.untyped_storage().data_ptr() in block) == (moved and tied)
    assert engine.runner.model.model.fused is not None
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request(None, [5, 6, 7, 8], params)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_cache.pool.num_used_blocks == 0
    # The pool's resident bytes are the pages its first blocks brought in: at least the
    # blocks' bytes, whole pages, never more than the pool.
    runner = engine.runner
    touched = runner._num_zeroed_blocks * runner.kv_bytes_per_block
    resident = engine.get_stats().kv_resident_bytes
    assert 0 < touched <= resident <= runner.kv_cache.nbytes
    assert resident % mmap.PAGESIZE == 0
    engine.shutdown()
