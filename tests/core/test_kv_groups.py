"""KV groups: hybrid models' layers split by window into groups with their own block tables
over one pool (core/layers/kv_groups.py, core/sched/kv_cache_coordinator.py)."""

from __future__ import annotations

from pkv.core.layers.kv_groups import plan_kv_groups
from pkv.core.sample.sampling_params import SamplingParams
from pkv.core.sched.kv_cache_coordinator import KVCacheCoordinator
from pkv.core.sched.request import Request

BS = 16


def _gemma3_windows(layers: int = 26, window: int = 512) -> list[int | None]:
    return [None if (i + 1) % 6 == 0 else window for i in range(layers)]


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), frozenset(), BS)


def test_gemma3_layers_form_a_global_group_and_windowed_groups_of_its_size():
    plan = plan_kv_groups(_gemma3_windows())
    assert plan.slots == 4
    assert plan.groups[0].window is None and plan.groups[0].layers == (5, 11, 17, 23)
    assert [len(g.layers) for g in plan.groups[1:]] == [4, 4, 4, 4, 4, 2]
    assert all(g.window == 512 for g in plan.groups[1:])
    # Every layer is in exactly one group, at a slot its group's blocks hold.
    assert sorted(i for g in plan.groups for i in g.layers) == list(range(26))
    assert max(plan.slot_of) < plan.slots
    assert [plan.groups[plan.group_of[i]].layers[plan.slot_of[i]] for i in range(26)] == \
        list(range(26))


def test_one_kind_of_layer_is_one_group():
    assert plan_kv_groups([None] * 30).groups[0].layers == tuple(range(30))
    assert plan_kv_groups([None] * 30).slots == 30
    windowed = plan_kv_groups([4096] * 8)
    assert len(windowed.groups) == 1 and windowed.windows == [4096]


def _generate(kv: KVCacheCoordinator, request: Request, tokens: int) -> int:
    """Grow `request` one token at a time; the most blocks the pool had in use."""
    assert kv.allocate_slots(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    peak = kv.pool.num_used_blocks
    for t in range(tokens):
        request.append_output_token(1000 + t % 100)
        assert kv.allocate_slots(request, 1)
        request.num_computed_tokens = request.num_tokens
        peak = max(peak, kv.pool.num_used_blocks)
    return peak


def test_a_long_generation_holds_the_global_blocks_and_a_window_of_the_rest():
    plan = plan_kv_groups(_gemma3_windows())
    kv = KVCacheCoordinator(4096, BS, True, plan.windows)
    peak = _generate(kv, _request("long", list(range(100, 116))), 4096 - 16)
    # Layer-blocks held against the least possible: every global layer's 256 blocks and each
    # windowed layer's window (512 tokens: 32 blocks, 33 while a block is half past it).
    held = peak * plan.slots
    least = 4 * 256 + 22 * 33
    assert held <= 1.3 * least
    assert held < 0.3 * 256 * 26  # one table for every layer held 256 blocks of 26 layers


def test_prefix_hits_need_every_global_block_and_the_window_of_the_others():
    plan = plan_kv_groups([None, 32, 32, None])  # two groups of two layers
    kv = KVCacheCoordinator(64, BS, True, plan.windows)
    doc = list(range(100, 100 + 8 * BS))  # 8 blocks
    first = _request("a", doc + [7])
    assert kv.allocate_slots(first, first.num_tokens)
    kv.free(first)
    hits, tokens = kv.get_computed_blocks(_request("b", doc + [8]))
    assert tokens == 8 * BS
    assert len(hits[0]) == 8 and all(b is not kv.groups[0].null_block for b in hits[0])
    # The token at 128 sees keys 97..128: blocks 6 and 7 of the windowed group, nulls before.
    windowed = kv.groups[1]
    assert hits[1][:6] == [windowed.null_block] * 6 and len(hits[1]) == 8


def test_hits_of_one_group_survive_another_groups_allocation():
    # A full pool freed: the free queue holds group 0's blocks, then group 1's. The next
    # request hits group 0's four and group 1's last; group 0's one new block comes from the
    # front of the queue, which is group 1's hit unless every group takes its hits first.
    plan = plan_kv_groups([None, 8])
    kv = KVCacheCoordinator(8, BS, True, plan.windows)
    doc = list(range(100, 100 + 4 * BS))
    first = _request("a", doc)
    assert kv.allocate_slots(first, first.num_tokens)
    kv.free(first)
    second = _request("b", doc + list(range(500, 500 + BS)))
    hits, tokens = kv.get_computed_blocks(second)
    assert tokens == 4 * BS and len([b for b in hits[1] if b is not kv.groups[1].null_block]) == 1
    assert kv.allocate_slots(second, second.num_tokens - tokens, hits)
    null = kv.groups[1].null_block
    group1 = {b.block_id for b in kv.groups[1].req_blocks["b"] if b is not null}
    assert not set(kv.block_ids("b")[0]) & group1  # no block serves both groups
    assert all(b.ref_cnt == 1 for g in kv.groups for b in g.req_blocks["b"]
               if b is not g.null_block)


def test_admission_counts_every_groups_blocks():
    plan = plan_kv_groups([None, 16, 16, None])
    kv = KVCacheCoordinator(5, BS, False, plan.windows)
    # 3 blocks of tokens: 3 global + 2 windowed (a 16-token window spans two blocks).
    assert not kv.allocate_slots(_request("big", list(range(3 * BS))), 3 * BS)
    assert kv.pool.num_used_blocks == 0 and kv.block_ids("big") == [[], []]
    assert kv.allocate_slots(_request("ok", list(range(2 * BS))), 2 * BS)
    assert kv.pool.num_used_blocks == 4
