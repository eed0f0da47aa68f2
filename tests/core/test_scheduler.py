"""The scheduler as pure Python: continuous batching, token budget, chunking, preemption."""

from __future__ import annotations

import pytest

from pkv.core.sample.sampling_params import SamplingParams
from pkv.core.sched.kv_cache_coordinator import KVCacheCoordinator
from pkv.core.sched.kv_cache_manager import KVCacheManager
from pkv.core.sched.request import Request, RequestStatus
from pkv.core.sched.scheduler import Scheduler, SchedulerOutput


def _scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
               budget: int = 64, caching: bool = False) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, block_size, caching), max_num_seqs, budget,
                     max_model_len=256)


def _add(s: Scheduler, rid: str, prompt_len: int, max_tokens: int = 4) -> Request:
    request = Request(rid, list(range(100, 100 + prompt_len)),
                      SamplingParams(temperature=0, max_tokens=max_tokens), frozenset({2}),
                      s.kv_cache.block_size)
    s.add_request(request)
    return request


def _step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    out = s.schedule()
    sampled = {r.request_id: [token] for r in out.scheduled if out.samples(r)}
    s.update_from_output(out, sampled)
    return out


def test_prefill_then_decode_with_new_requests_joining():
    s = _scheduler()
    _add(s, "a", 5)
    out = _step(s)
    assert out.num_scheduled_tokens == {"a": 5}
    _add(s, "b", 3)
    out = _step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 3}
    assert [r.request_id for r in out.scheduled] == ["a", "b"]  # decodes first


def test_finished_requests_leave_and_free_blocks_at_once():
    s = _scheduler()
    a = _add(s, "a", 5, max_tokens=2)
    _step(s)
    _step(s)
    assert a.status == RequestStatus.FINISHED_LENGTH and a.output_token_ids == [7, 7]
    assert not s.running and s.kv_cache.pool.num_used_blocks == 0


def test_eos_stops_unless_ignored_or_below_min_tokens():
    s = _scheduler()
    a = _add(s, "a", 3, max_tokens=10)
    _step(s, token=2)
    assert a.status == RequestStatus.FINISHED_STOPPED
    b = Request("b", [5, 6], SamplingParams(max_tokens=3, ignore_eos=True), frozenset({2}), 4)
    s.add_request(b)
    for _ in range(3):
        _step(s, token=2)
    assert b.status == RequestStatus.FINISHED_LENGTH and b.output_token_ids == [2, 2, 2]


def test_max_num_seqs_bounds_the_batch():
    s = _scheduler(max_num_seqs=2)
    for i in range(4):
        _add(s, f"r{i}", 3)
    out = _step(s)
    assert len(out.scheduled) == 2 and len(s.waiting) == 2


def test_token_budget_chunks_long_prompts_and_keeps_decodes_going():
    s = _scheduler(budget=8)
    _add(s, "short", 2, max_tokens=10)
    _step(s)
    long_request = _add(s, "long", 20)
    chunks = []
    for _ in range(3):
        out = _step(s)
        assert out.num_scheduled_tokens["short"] == 1  # the decode is never starved
        chunks.append(out.num_scheduled_tokens["long"])
    assert chunks == [7, 7, 6]
    assert long_request.num_output_tokens == 1  # sampled only once the prompt was complete


def test_preempts_most_recent_request_and_resumes_it():
    # 6 blocks of 4 tokens: two 8-token prompts fill 4 blocks; growth forces a preemption.
    s = _scheduler(num_blocks=6)
    a = _add(s, "a", 8, max_tokens=12)
    b = _add(s, "b", 8, max_tokens=12)
    preempted = []
    for _ in range(40):
        if not s.has_unfinished_requests():
            break
        preempted += [r.request_id for r in _step(s).preempted]
    assert preempted and preempted[0] == "b"
    assert b.num_preemptions >= 1
    assert a.output_token_ids == [7] * 12 and b.output_token_ids == [7] * 12
    assert s.kv_cache.pool.num_used_blocks == 0


def test_abort_waiting_and_running_requests_frees_blocks():
    s = _scheduler(max_num_seqs=1)
    a = _add(s, "a", 5)
    b = _add(s, "b", 5)
    _step(s)
    s.finish_request(a, RequestStatus.FINISHED_ABORTED)
    s.finish_request(b, RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests()
    assert s.kv_cache.pool.num_used_blocks == 0


def test_speculation_allocates_lookahead_and_rolls_back_rejected_drafts():
    from pkv.core.config.speculative import SpeculativeConfig

    s = Scheduler(KVCacheManager(64, 4, True), 8, 64, max_model_len=256,
                  speculative=SpeculativeConfig("ngram", 3))
    request = _add(s, "a", 6, max_tokens=10)
    _step(s)  # prefill: no lookahead
    out = s.schedule()
    assert out.spec_lookahead == {"a": 3}
    assert len(s.kv_cache.req_blocks["a"]) == 3  # 7 tokens + 3 lookahead slots: 10 -> 3 blocks
    out.set_drafts({"a": [40, 41, 42, 43]})  # more than the lookahead: cut to 3
    assert out.spec_token_ids == {"a": [40, 41, 42]} and out.num_scheduled_tokens["a"] == 4
    assert out.samples(request)
    s.update_from_output(out, {"a": [40, 9]})  # first draft accepted, then the target's 9
    assert request.output_token_ids == [7, 40, 9]
    assert request.num_computed_tokens == request.num_tokens - 1  # drafts 41, 42 rolled back
    # Blocks are hashed from verified tokens only: when the drafts (positions 7-9) were
    # scheduled, one block was full of verified tokens; the next schedule adds the second.
    assert s.kv_cache._num_cached_blocks["a"] == 1
    out = s.schedule()
    assert out.spec_lookahead["a"] == 3
    assert s.kv_cache._num_cached_blocks["a"] == 2
    s.update_from_output(out, {"a": [5]})  # no drafts set: one token, as without speculation
    assert request.num_computed_tokens == request.num_tokens - 1 == 9


def test_lookahead_stops_at_max_tokens_and_for_guided_requests():
    from pkv.core.config.speculative import SpeculativeConfig

    s = Scheduler(KVCacheManager(64, 4, False), 8, 64, max_model_len=256,
                  speculative=SpeculativeConfig("ngram", 4))
    short = _add(s, "short", 5, max_tokens=3)
    guided = _add(s, "guided", 5, max_tokens=30)
    _step(s)
    guided.guided = object()  # a grammar state (never advanced in this test)
    out = s.schedule()
    assert out.spec_lookahead == {"short": 1}  # 1 output so far, 2 more at most: 1 draft
    assert short.num_output_tokens == 1



def test_an_adapter_load_is_not_lost_with_a_step_that_never_runs():
    # Pipeline parallelism: "big" is in flight and holds the pool, so "b" (adapter B) cannot
    # start and nothing is scheduled. The slot B took from A (idle) must load B when "b"
    # does start, not keep A's weights under B's name.
    from types import SimpleNamespace

    from pkv.core.lora.slots import LoRASlotTable

    s = Scheduler(KVCacheManager(4, 4, False), 8, 64, max_model_len=256,
                  lora_slots=LoRASlotTable(1))
    adapter_a, adapter_b = SimpleNamespace(uid=1), SimpleNamespace(uid=2)
    a = _add(s, "a", 3, max_tokens=1)
    a.lora = adapter_a
    assert _step(s).lora_loads == [(0, adapter_a)]  # "a" ran and finished: A idle in slot 0
    _add(s, "big", 12, max_tokens=2)
    _step(s)  # "big" holds 3 of the 4 blocks
    b = _add(s, "b", 6, max_tokens=1)
    b.lora = adapter_b
    stalled = s.schedule(in_flight={"big"})
    assert not stalled.scheduled and not stalled.lora_loads
    _step(s)  # "big" decodes its last token and leaves
    started = s.schedule()
    assert started.scheduled == [b] and started.lora_loads == [(0, adapter_b)]


def test_a_pooling_request_waiting_for_budget_leaves_its_adapter_unpinned():
    from types import SimpleNamespace

    from pkv.core.lora.slots import LoRASlotTable
    from pkv.core.pooling.params import PoolingParams

    slots = LoRASlotTable(1)
    s = Scheduler(KVCacheManager(64, 4, False), 8, 16, max_model_len=256, lora_slots=slots)
    _add(s, "first", 10, max_tokens=3)
    embed = _add(s, "embed", 12)
    embed.pooling, embed.lora = PoolingParams(), SimpleNamespace(uid=1)
    out = _step(s)  # 10 of the 16 tokens go to "first": "embed" waits, whole
    assert embed not in out.scheduled and not slots.pins(1)
    while s.has_unfinished_requests():
        _step(s)
    assert not slots.pins(1)  # (a pin left behind would make other adapters wait)


def test_a_request_waiting_for_a_lora_slot_lets_the_others_pass():
    from types import SimpleNamespace

    from pkv.core.lora.slots import LoRASlotTable

    s = Scheduler(KVCacheManager(64, 4, False), 8, 64, max_model_len=256,
                  lora_slots=LoRASlotTable(1))
    a = _add(s, "a", 3, max_tokens=20)
    a.lora = SimpleNamespace(uid=1)
    _step(s)  # "a" holds the one slot while it runs
    b = _add(s, "b", 3)
    b.lora = SimpleNamespace(uid=2)
    base = _add(s, "base", 3)
    out = _step(s)
    assert base in out.scheduled and b not in out.scheduled  # not stuck behind "b"
    assert list(s.waiting) == [b]


@pytest.mark.parametrize("coordinated", [False, True])
def test_a_request_waiting_for_blocks_is_counted_once_in_the_prefix_stats(coordinated: bool):
    """Looked up again every step it waits, counted once, as it is admitted: a hit rate
    read under KV pressure is the requests' reuse, not the queue's retries."""
    kv = (KVCacheCoordinator(8, 4, True, [None]) if coordinated
          else KVCacheManager(8, 4, True))
    s = Scheduler(kv, 8, 64, max_model_len=256)
    _add(s, "a", 16, max_tokens=6)
    s.add_request(Request("b", list(range(300, 320)), SamplingParams(temperature=0, max_tokens=2),
                          frozenset({2}), 4))  # 5 blocks: more than a leaves
    waited = 0
    while s.waiting or s.running:
        waited += any(r.request_id == "b" for r in s.waiting)
        _step(s)
    assert waited >= 3
    assert (kv.prefix_queries, kv.prefix_hits) == (16 + 20, 0)
    # b's prompt again: its first 4 blocks (the last token is never taken from the cache)
    s.add_request(Request("c", list(range(300, 320)), SamplingParams(temperature=0, max_tokens=1),
                          frozenset({2}), 4))
    _step(s)
    assert (kv.prefix_queries, kv.prefix_hits) == (16 + 20 + 20, 16)
