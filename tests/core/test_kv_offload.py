"""The disk tier of the prefix cache: the store alone (round trip, LRU bound, torn and
corrupt files, tenants, restart), a hybrid model's prefix found block by block in RAM and on
disk, and engines on tiny random models (same greedy tokens as without the tier, hits after a
restart; one KV group and several)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from pkv.core.sched.kv_offload import KVOffloadStore, model_fingerprint
from pkv.core.sched.kv_offload_files import HEADER, SUFFIX, file_id
from pkv.core.sched.request import hash_block

FP = b"f" * 32
# [layers, 2, num_blocks, block_size, heads, row]
SHAPE = (2, 2, 8, 4, 2, 3)


def _kv(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(SHAPE, generator=g).to(dtype)


def _block(i: int, salt: bytes = b"") -> tuple[bytes, tuple]:
    tokens = [10 * i + j for j in range(SHAPE[3])]
    return hash_block(None, tokens, salt), (None, tuple(tokens), salt)


def _store(path: Path, kv: torch.Tensor, max_bytes: int = 1 << 20, **kw) -> KVOffloadStore:
    return KVOffloadStore(path, max_bytes, FP, lambda: kv, **kw)


def _files(path: Path) -> list[Path]:
    return sorted(path.glob("*" + SUFFIX))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_round_trip_as_raw_bytes(tmp_path: Path, dtype: torch.dtype) -> None:
    kv = _kv(dtype)
    store = _store(tmp_path, kv)
    h, key = _block(1)
    store.save(h, key, 3)
    assert store.flush(10)
    data = store.load(h, key)
    assert data is not None
    want = kv.view(torch.uint8)[:, :, 3]
    assert torch.equal(data.view(want.shape), want)
    assert store.stats.writes == 1 and store.stats.files == 1
    store.close()


def test_a_block_still_staged_is_read_from_staging(tmp_path: Path) -> None:
    import threading

    kv = _kv()
    store = _store(tmp_path, kv)
    release = threading.Event()
    write = store.files.write
    store.files.write = lambda *a: (release.wait(10), write(*a))  # hold the writer back
    h, key = _block(1)
    store.save(h, key, 5)
    kv.zero_()  # the pool reuses the block at once
    data = store.load(h, key)
    other_salt = store.load(h, (key[0], key[1], b"tenant-b"))  # same hash, another key
    release.set()
    assert store.flush(10) and store.stats.files == 1
    want = _kv().view(torch.uint8)[:, :, 5]
    assert data is not None and torch.equal(data.view(want.shape), want)
    assert other_salt is None  # staged bytes answer only their own key
    assert torch.equal(store.load(h, key).view(want.shape), want)  # and now from the file
    store.close()


def _file_size(path: Path, kv: torch.Tensor) -> int:
    """The bytes of one block's file."""
    probe = _store(path, kv)
    probe.save(*_block(0), 0)
    probe.flush(10)
    size = probe.stats.bytes_used
    probe.close()
    return size


def test_lru_bound_deletes_oldest_first(tmp_path: Path) -> None:
    kv = _kv()
    size = _file_size(tmp_path / "probe", kv)
    store = _store(tmp_path / "lru", kv, max_bytes=3 * size)
    for i in range(3):
        store.save(*_block(i), i)
    store.flush(10)
    assert store.load(*_block(0)) is not None  # block 0 is now the most recently used
    store.save(*_block(3), 3)
    store.flush(10)
    s = store.stats
    assert s.files == 3 and s.bytes_used <= 3 * size and s.evictions == 1
    assert store.load(*_block(1)) is None  # the least recently used went
    assert all(store.load(*_block(i)) is not None for i in (0, 2, 3))
    store.close()


def test_a_block_evicted_again_is_the_most_recently_used_file(tmp_path: Path) -> None:
    kv = _kv()
    store = _store(tmp_path / "lru", kv, max_bytes=2 * _file_size(tmp_path / "probe", kv))
    for i in (0, 1, 0, 2):  # block 0 read back into RAM and evicted again, then a new one
        store.save(*_block(i), i)
        store.flush(10)
    assert store.load(*_block(1)) is None  # the coldest went, not block 0
    assert store.load(*_block(0)) is not None and store.load(*_block(2)) is not None
    store.close()


def test_a_failed_write_is_counted_and_said_once(tmp_path: Path, caplog) -> None:
    import shutil

    store = _store(tmp_path / "gone", _kv())
    shutil.rmtree(tmp_path / "gone")  # the folder vanishes (a full disk fails alike)
    with caplog.at_level("WARNING", logger="pkv.kv_offload"):
        for i in range(3):
            store.save(*_block(i), i)
        store.flush(10)
    assert store.stats.write_errors == 3 and store.stats.writes == 0
    assert sum("cannot write" in r.message for r in caplog.records) == 1
    store.close()


def test_a_file_that_cannot_be_opened_now_is_a_miss_and_kept(tmp_path: Path,
                                                             monkeypatch) -> None:
    import errno

    from pkv.core.sched import kv_offload_files

    store, path = _one_file(tmp_path)

    def too_many_open_files(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(kv_offload_files, "open", too_many_open_files, raising=False)
    assert store.load(*_block(1)) is None
    monkeypatch.undo()
    assert path.exists() and store.stats.corrupt == 0
    assert store.load(*_block(1)) is not None  # whole all along
    store.close()


def _one_file(tmp_path: Path) -> tuple[KVOffloadStore, Path]:
    store = _store(tmp_path, _kv())
    store.save(*_block(1), 2)
    store.flush(10)
    (path,) = _files(tmp_path)
    return store, path


def test_torn_write_is_a_miss_and_deleted(tmp_path: Path) -> None:
    store, path = _one_file(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    assert store.load(*_block(1)) is None
    assert not path.exists() and store.stats.corrupt == 1 and store.stats.files == 0
    store.close()


def test_checksum_corruption_is_a_miss(tmp_path: Path) -> None:
    store, path = _one_file(tmp_path)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # one payload byte
    path.write_bytes(bytes(data))
    assert store.load(*_block(1)) is None
    assert not path.exists() and store.stats.corrupt == 1
    store.close()


def test_bad_header_is_a_miss(tmp_path: Path) -> None:
    store, path = _one_file(tmp_path)
    data = bytearray(path.read_bytes())
    data[:HEADER.size] = b"\0" * HEADER.size
    path.write_bytes(bytes(data))
    assert store.load(*_block(1)) is None
    store.close()


def test_tenants_never_read_each_other(tmp_path: Path) -> None:
    store = _store(tmp_path, _kv())
    h_a, key_a = _block(1, b"tenant-a:")
    store.save(h_a, key_a, 1)
    store.flush(10)
    h_b, key_b = _block(1, b"tenant-b:")
    assert h_b != h_a and store.load(h_b, key_b) is None
    # Even a lookup by tenant A's hash (a collision) is refused: the stored key differs.
    assert store.load(h_a, key_b) is None
    assert store.load(h_a, (None, key_a[1][::-1], key_a[2])) is None
    assert store.load(h_a, key_a) is not None
    store.close()


def test_restart_rebuilds_the_index(tmp_path: Path) -> None:
    kv = _kv()
    store = _store(tmp_path, kv)
    for i in range(3):
        store.save(*_block(i), i)
    store.close()
    (tmp_path / ("0" * 64 + ".1.2.tmp")).write_bytes(b"half a write")
    again = _store(tmp_path, kv)
    assert again.stats.files == 3 and not list(tmp_path.glob("*.tmp"))
    data = again.load(*_block(2))
    assert data is not None and torch.equal(data.view(kv.view(torch.uint8)[:, :, 2].shape),
                                            kv.view(torch.uint8)[:, :, 2])
    other = KVOffloadStore(tmp_path, 1 << 20, b"g" * 32, lambda: kv)  # another model
    assert other.load(*_block(2)) is None
    again.close()
    other.close()


def test_full_staging_drops_instead_of_waiting(tmp_path: Path) -> None:
    store = _store(tmp_path, _kv(), max_pending=1)
    store._staging.take(1, False)  # the one buffer is busy
    store.save(*_block(1), 1)
    assert store.stats.drops == 1
    store.close()


def test_fingerprint_follows_the_weights(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"a")
    first = model_fingerprint(tmp_path, {"dtype": "float32"})
    assert model_fingerprint(tmp_path, {"dtype": "bfloat16"}) != first
    os.utime(weights, ns=(1, 1))
    assert model_fingerprint(tmp_path, {"dtype": "float32"}) != first
    assert file_id(first, b"h") != file_id(model_fingerprint(tmp_path, {}), b"h")


def test_config_checks() -> None:
    from pkv.core.config.engine import EngineConfig

    assert EngineConfig(kv_offload_dir="/tmp/x", kv_offload_size="1GiB").kv_offload_size == 2**30
    with pytest.raises(ValueError, match="kv_offload_size"):
        EngineConfig(kv_offload_size="lots")
    assert EngineConfig(kv_offload_dir="/tmp/x", pipeline_parallel_size=2).world_size == 2
    with pytest.raises(ValueError, match="prefix_caching"):
        EngineConfig(kv_offload_dir="/tmp/x", enable_prefix_caching=False)


BS = 16
HYBRID_DOC = list(range(100, 100 + 6 * BS))  # 6 blocks


def _hybrid_cache(path: Path) -> tuple[torch.Tensor, KVOffloadStore, Any]:
    """A pool of 16 blocks (one slot, K and V) for a global group and a windowed one (window
    20: the token after 6 blocks sees blocks 4 and 5), with a disk tier."""
    from pkv.core.sched.kv_cache_coordinator import KVCacheCoordinator

    kv = torch.zeros(1, 2, 16, BS, 1, 4)
    store = _store(path, kv)
    return kv, store, KVCacheCoordinator(16, BS, True, [None, 20], store)


def _request(rid: str, tokens: list[int]) -> Any:
    from pkv.core.sample.sampling_params import SamplingParams
    from pkv.core.sched.request import Request

    return Request(rid, tokens, SamplingParams(max_tokens=1), frozenset(), BS)


def test_a_hybrid_prefix_comes_from_ram_and_disk_block_by_block(tmp_path: Path) -> None:
    """A global group and a windowed one (window 20: the token after 6 blocks sees blocks 4
    and 5): the global group's blocks 4 and 5 evicted to disk, the rest in RAM. The prefix
    is all 6 blocks: the global group's 0-3 and the windowed group's 4-5 from RAM, the
    windowed group's 0-3 behind its window (never read), the global 4-5 read from disk into
    fresh blocks with the bytes they were evicted with."""
    kv, store, cache = _hybrid_cache(tmp_path)
    first = _request("a", HYBRID_DOC + [7])
    assert cache.allocate_slots(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    for block in range(16):  # every block's bytes say which block it was
        kv[:, :, block] = block
    evicted = cache.block_ids("a")[0][4:6]
    cache.free(first)
    # Six blocks for an unrelated request: the two never used, the two unhashed tails,
    # then the least recently freed: the global group's blocks 5 and 4 (saved on eviction).
    other = _request("c", list(range(3000, 3000 + 3 * BS)))
    assert cache.allocate_slots(other, other.num_tokens)
    store.flush()
    assert store.stats.writes == 2

    second = _request("b", HYBRID_DOC + [8])
    hits, tokens = cache.get_computed_blocks(second)
    null = cache.groups[1].null_block
    assert tokens == 6 * BS
    assert [b is None for b in hits[0]] == [False] * 4 + [True] * 2
    assert hits[1][:4] == [null] * 4 and None not in hits[1][4:]
    assert cache.allocate_slots(second, second.num_tokens - tokens, hits)
    loads = cache.take_loads()
    table = cache.block_ids("b")[0]
    assert [block for block, _ in loads] == table[4:6]
    for (_, data), old in zip(loads, evicted):
        assert torch.equal(data.view(torch.float32), torch.full((2 * BS * 4,), float(old)))
    assert store.stats.hits == 2 and store.saved_tokens == 2 * BS
    store.close()


def test_a_file_that_does_not_read_stops_the_reads_of_its_plan(tmp_path: Path) -> None:
    """Every block of a document on disk in both groups (global, window 20), the global
    group's block 2 torn: the first plan (all 6 blocks) reads the global blocks 0-2 and stops
    there, not going on to the windowed group's; the prefix made again without it is 2
    blocks, each of its disk blocks read once more."""
    _, store, cache = _hybrid_cache(tmp_path)
    first = _request("a", HYBRID_DOC + [7])
    assert cache.allocate_slots(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    cache.free(first)
    other = _request("c", list(range(3000, 3000 + 8 * BS)))  # the whole pool: all evicted
    assert cache.allocate_slots(other, other.num_tokens)
    store.flush()
    second = _request("b", HYBRID_DOC + [8])
    torn = tmp_path / (file_id(store.fingerprint, cache.groups[0].cache_key(second, 2)[0])
                       + SUFFIX)
    torn.write_bytes(torn.read_bytes()[:10])
    reads: list[bytes] = []
    load = store.load
    store.load = lambda block_hash, key: reads.append(block_hash) or load(block_hash, key)
    hits, tokens = cache.get_computed_blocks(second)
    assert tokens == 2 * BS and store.stats.corrupt == 1
    first_plan = [cache.groups[0].cache_key(second, i)[0] for i in range(3)]
    assert reads[:3] == first_plan
    assert len(reads) == 3 + sum(b is None for group in hits for b in group)
    assert any(b is None for b in hits[1])  # (so the first plan had windowed blocks to read)
    store.close()


# ---- the engine ------------------------------------------------------------------------------

DOC_LEN = 96  # tokens per document: 6 blocks of 16


def _engine(model_dir: Path, offload: Path | None, kv_cache_dtype: str = "auto",
            draft: Path | None = None) -> Any:
    """An LLMEngine whose pool holds about two documents, so documents evict each other;
    `draft`: a draft model of the same shape (its K/V doubles a block's bytes)."""
    from pkv.core.config.engine import EngineConfig
    from pkv.core.engine.llm_engine import LLMEngine

    # 2 layers, K and V, 16 slots, 2 heads, rows of head_dim 16 (int8: + a 4-byte scale)
    row_bytes = 16 + 4 if kv_cache_dtype == "int8" else 16 * 4
    block = 2 * 2 * 16 * 2 * row_bytes * (2 if draft else 1)
    spec = {"model": str(draft), "num_speculative_tokens": 3} if draft else None
    config = EngineConfig(model=str(model_dir), kv_cache_memory=16 * block,
                          max_model_len=200, kv_offload_dir=str(offload) if offload else None,
                          max_num_seqs=1, kv_cache_dtype=kv_cache_dtype,
                          speculative_config=spec)
    engine = LLMEngine(config, show_progress=False)
    assert engine.runner.num_blocks == 16
    return engine


def _prompts(num_docs: int, rounds: int) -> list[tuple[str, list[int]]]:
    docs = [[100 + (d * 997 + 31 * i) % 5000 for i in range(DOC_LEN)] for d in range(num_docs)]
    out = []
    for r in range(rounds):
        for d in range(num_docs):
            out.append((f"r{r}d{d}", docs[d] + [7000 + r, 7100 + d, 7200]))
    return out


def _run(engine: Any, prompts: list[tuple[str, list[int]]],
         salt: str | None = None) -> dict[str, list[int]]:
    from pkv.core.sample.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = {}
    for request_id, prompt in prompts:  # one at a time: the pool holds one document
        engine.add_request(request_id, prompt, params, cache_salt=salt)
        for o in engine.generate_until_done():
            out[o.request_id] = o.outputs[0].token_ids
    return out


def _tenant_salt(api_key: str) -> str:
    """The salt the server gives a request made with `api_key` (no cache_salt of its own)."""
    from pkv.core.server.middleware import tenant_id

    return f"{tenant_id(api_key)}:"


def test_engine_same_tokens_with_the_tier_and_hits_after_restart(tiny_llama_dir: Path,
                                                                 tmp_path: Path) -> None:
    prompts = _prompts(num_docs=3, rounds=2)
    tenant_a, tenant_b = _tenant_salt("key-a"), _tenant_salt("key-b")
    plain = _engine(tiny_llama_dir, None)
    want = _run(plain, prompts, tenant_a)
    plain_prefill = plain.scheduler.num_prefill_tokens
    plain.shutdown()

    engine = _engine(tiny_llama_dir, tmp_path / "kv")
    got = _run(engine, prompts, tenant_a)
    assert got == want
    stats = engine.get_stats().kv_offload
    assert stats is not None and stats.writes > 0 and stats.hits > 0
    # RAM behaves as without the tier; every disk hit is a block not prefilled.
    assert engine.scheduler.num_prefill_tokens == plain_prefill - stats.saved_tokens
    engine.shutdown()  # saves the blocks still in RAM and flushes the writer

    restarted = _engine(tiny_llama_dir, tmp_path / "kv")
    assert restarted.get_stats().kv_offload.files > 0
    first_id, first_prompt = prompts[0]
    # Another API key asking for the same document computes it: it never reads A's files.
    other = _run(restarted, [("b", first_prompt)], tenant_b)
    assert other["b"] == want[first_id]
    assert restarted.get_stats().kv_offload.hits == 0
    again = _run(restarted, [(first_id, first_prompt)], tenant_a)
    assert again == {first_id: want[first_id]}
    after = restarted.get_stats().kv_offload
    assert after.hits == DOC_LEN // 16 and after.saved_tokens == DOC_LEN

    from pkv.core.server.metrics import ServerMetrics

    text = ServerMetrics(restarted).render().decode()
    assert f"pkv:kv_offload_hits_total {float(after.hits)}" in text
    assert "pkv:kv_offload_bytes " in text and "pkv:kv_offload_drops_total 0.0" in text
    restarted.shutdown()


def test_engine_int8_cache_round_trips_as_bytes(tiny_llama_dir: Path, tmp_path: Path) -> None:
    prompts = _prompts(num_docs=3, rounds=2)
    plain = _engine(tiny_llama_dir, None, "int8")
    want = _run(plain, prompts)
    plain.shutdown()
    engine = _engine(tiny_llama_dir, tmp_path / "kv", "int8")
    assert _run(engine, prompts) == want
    assert engine.get_stats().kv_offload.hits > 0
    engine.shutdown()


def test_engine_with_a_draft_model_keeps_its_tokens_and_drafts(tiny_llama_dir: Path,
                                                              tmp_path: Path) -> None:
    """A draft model beside the tier (here the target itself, whose drafts are right when its
    K/V is): the draft computes its own K/V of every prompt from the first token, so a
    prefix read from disk, even after a restart, leaves its drafts as good as ever."""
    prompts = _prompts(num_docs=3, rounds=2)
    plain = _engine(tiny_llama_dir, None)
    want = _run(plain, prompts)
    plain.shutdown()
    for run in range(2):  # the second after a restart, on the first run's files
        engine = _engine(tiny_llama_dir, tmp_path / "kv", draft=tiny_llama_dir)
        try:
            assert _run(engine, prompts) == want
            assert engine.get_stats().kv_offload.hits > 0
            stats = engine.spec_stats
            assert stats.num_draft_tokens > 0
            assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens
        finally:
            engine.shutdown()


def test_blocks_a_failed_step_was_reading_from_disk_are_not_found(tiny_llama_dir: Path,
                                                                   tmp_path: Path,
                                                                   monkeypatch) -> None:
    # The step failed copying them in: their blocks hold another document's K/V.
    prompts = _prompts(num_docs=3, rounds=1)
    engine = _engine(tiny_llama_dir, tmp_path / "kv")
    want = _run(engine, prompts)  # the first document is on disk now, not in RAM
    first_id, first_prompt = prompts[0]

    def copy_fails(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected fault: staging out of memory")

    from pkv.core.sample.sampling_params import SamplingParams

    engine.add_request("x", first_prompt, SamplingParams(temperature=0, max_tokens=6,
                                                         ignore_eos=True))
    monkeypatch.setattr(engine.runner, "load_kv_blocks", copy_fails)
    with pytest.raises(RuntimeError, match="injected fault"):
        engine.step()
    monkeypatch.undo()
    engine.abort_request("x")
    hits = engine.get_stats().kv_offload.hits
    assert _run(engine, [prompts[0]]) == {first_id: want[first_id]}
    assert engine.get_stats().kv_offload.hits > hits  # read from disk again, not from RAM
    engine.shutdown()


def test_engine_corrupt_file_is_recomputed(tiny_llama_dir: Path, tmp_path: Path) -> None:
    prompts = _prompts(num_docs=2, rounds=1)
    engine = _engine(tiny_llama_dir, tmp_path / "kv")
    want = _run(engine, prompts)
    engine.shutdown()
    for path in _files(tmp_path / "kv"):  # damage every file: each must read as a miss
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x55
        path.write_bytes(bytes(data))
    restarted = _engine(tiny_llama_dir, tmp_path / "kv")
    assert _run(restarted, prompts[:1]) == {prompts[0][0]: want[prompts[0][0]]}
    stats = restarted.get_stats().kv_offload
    assert stats.hits == 0 and stats.corrupt >= 1
    restarted.shutdown()


@pytest.mark.parametrize("family,window,pp", [("qwen2", 8, 1), ("qwen2", 40, 1),
                                               ("gemma3", 40, 1), ("gemma3", 40, 2)])
def test_engine_hybrid_model_reads_each_groups_blocks_back(family: str, window: int, pp: int,
                                                          smol_hf_dir: Path,
                                                          tmp_path: Path) -> None:
    """Models of global and sliding-window layers (Qwen2's two layers: two KV groups of one;
    Gemma 3's five: a global group and two windowed ones of two slots, also over two
    pipeline stages): every group's blocks are saved, and a prefix comes back with the
    global groups' blocks and the windowed groups' visible ones only, with the same tokens,
    after a restart too."""
    from pkv.core.config.engine import EngineConfig
    from pkv.core.engine.llm_engine import LLMEngine
    from pkv.tests.helpers import build_tiny_model, kv_block_bytes
    from pkv.tests.models.test_gemma import GEMMA3

    shape = (dict(use_sliding_window=True, max_window_layers=1) if family == "qwen2"
             else dict(GEMMA3, num_hidden_layers=5))
    hybrid = build_tiny_model(tmp_path / family, smol_hf_dir, family,
                              **{**shape, "sliding_window": window})
    per_block, _ = kv_block_bytes(hybrid, 16)
    pool = 20 if family == "qwen2" else 28  # blocks: about two documents (in every group)

    def engine(offload: Path | None) -> Any:
        return LLMEngine(EngineConfig(model=str(hybrid), kv_cache_memory=pool * per_block,
                                      max_model_len=112, max_num_seqs=1,
                                      pipeline_parallel_size=pp if offload else 1,
                                      kv_offload_dir=str(offload) if offload else None),
                         show_progress=False)

    prompts = _prompts(num_docs=3, rounds=2)
    plain = engine(None)
    windows = plain.runner.kv_groups.windows
    assert None in windows and window in windows and plain.runner.num_blocks == pool
    want = _run(plain, prompts)
    plain_prefill = plain.scheduler.num_prefill_tokens
    plain.shutdown()
    tiered = engine(tmp_path / "kv")
    try:
        assert _run(tiered, prompts) == want
        stats = tiered.get_stats().kv_offload
        assert stats.writes > 0 and stats.hits > 0 and stats.drops == 0
        assert tiered.scheduler.num_prefill_tokens == plain_prefill - stats.saved_tokens
    finally:
        tiered.shutdown()
    restarted = engine(tmp_path / "kv")
    first_id, first_prompt = prompts[0]
    try:
        assert _run(restarted, [(first_id, first_prompt)]) == {first_id: want[first_id]}
        after = restarted.get_stats().kv_offload
    finally:
        restarted.shutdown()
    prefix = DOC_LEN // 16  # blocks: every one in the global group, the visible ones windowed
    visible = prefix - (DOC_LEN - window + 1) // 16
    assert after.saved_tokens == DOC_LEN
    assert after.hits == sum(prefix if w is None else visible for w in windows)


@pytest.mark.parametrize("pp", [1, 2])
def test_bench_offload_runs(pp: int, tiny_llama_dir: Path) -> None:
    """The bench sizes the pool to two documents (of 6 blocks) on every stage."""
    from pkv.cli.bench.offload import offload_table, run_offload_bench

    result = run_offload_bench(str(tiny_llama_dir), num_docs=3, doc_tokens=64, num_requests=6,
                               pool_docs=2, question_tokens=16, max_tokens=2, seed=0,
                               offload_dir=None, pipeline_parallel_size=pp)
    assert result["num_blocks"] == 12
    s = result["summary"]
    assert s["restart_hit"] and s["restart_disk_hit_tokens"] == 64
    assert s["prefill_tokens_disk"] < s["prefill_tokens_none"]
    assert s["num_disk_hit_requests"] > 0
    offload_table(result)  # renders


def test_a_tier_that_holds_no_block_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from pkv.core.config.engine import EngineConfig
    from pkv.core.engine.llm_engine import LLMEngine

    # 2 layers, K and V, 16 slots, 2 heads of 16 float32 values: 8,192 bytes a block
    # (and a file holds its key too: one of exactly 8,192 bytes would hold nothing)
    config = EngineConfig(model=str(tiny_llama_dir), kv_cache_memory="1MiB", max_model_len=200,
                          kv_offload_dir=str(tmp_path), kv_offload_size="8192")
    with pytest.raises(ValueError, match=r"kv_offload_size \(8192 bytes\) holds no KV block "
                                         r"of this model \(\d+ bytes a file: 8192 of K/V"):
        LLMEngine(config, show_progress=False)
