"""flatten_batch: one step's requests as the flat tensors the model and attention read."""

import torch

from pkv.core.worker.input_batch import SeqChunk, flatten_batch


def test_mixed_batch_flattens_to_the_slots_and_rows_each_chunk_owns() -> None:
    # Block size 4. Two decodes, then a chunked prefill that does not sample yet (its block
    # table out of order, block 0 in the middle), then a whole short prompt that samples.
    chunks = [
        SeqChunk([7], 5, [[9, 2]], 6, 1),
        SeqChunk([8], 3, [[4]], 4, 1),
        SeqChunk([1, 2, 3, 4, 5], 2, [[6, 0, 3]], 10, 0),
        SeqChunk([11, 12], 0, [[5]], 2, 1),
    ]
    input_ids, positions, meta, logits_idx = flatten_batch(chunks, 4, torch.device("cpu"))

    def values(t: torch.Tensor, dtype: torch.dtype) -> list:
        assert t.dtype == dtype
        return t.tolist()

    assert values(input_ids, torch.long) == [7, 8, 1, 2, 3, 4, 5, 11, 12]
    assert values(positions, torch.long) == [5, 3, 2, 3, 4, 5, 6, 0, 1]
    # position p of a chunk lives in slot table[p // 4] * 4 + p % 4
    assert values(meta.slot_mapping, torch.long) == [9, 19, 26, 27, 0, 1, 2, 20, 21]
    assert values(logits_idx, torch.long) == [0, 1, 8]
    assert values(meta.query_start_loc, torch.int32) == [0, 1, 2, 7, 9]
    assert meta.query_start_loc_cpu == [0, 1, 2, 7, 9]
    assert values(meta.seq_lens, torch.int32) == [6, 4, 7, 2]
    assert meta.seq_lens_cpu == [6, 4, 7, 2]
    assert values(meta.block_tables, torch.int32) == [[9, 2, 0], [4, 0, 0], [6, 0, 3],
                                                      [5, 0, 0]]
    assert meta.num_decode_tokens == 2
    assert values(meta.seq_ids, torch.int32) == [0, 1, 2, 2, 2, 2, 2, 3, 3]
    assert values(meta.kv_lens, torch.int32) == [6, 4, 3, 4, 5, 6, 7, 1, 2]
    assert values(meta.total_lens, torch.int32) == [6, 4, 10, 2]
    for t in (input_ids, positions, logits_idx, meta.slot_mapping, meta.block_tables,
              meta.seq_ids, meta.kv_lens):
        assert t.is_contiguous()  # the kernels take raw pointers


def test_a_prefill_after_a_decode_is_not_counted_as_a_decode() -> None:
    chunks = [SeqChunk([1, 2], 0, [[0]], 2, 1), SeqChunk([3], 4, [[1, 2]], 5, 1)]
    _, _, meta, logits_idx = flatten_batch(chunks, 4, torch.device("cpu"))
    assert meta.num_decode_tokens == 0  # decodes must come first to count
    assert logits_idx.tolist() == [1, 2]
    assert meta.slot_mapping.tolist() == [0, 1, 8]


def test_each_kv_group_gets_its_own_slots_and_tables() -> None:
    # Group 0 (global) holds every block; group 1 (windowed) gave its first block back (0).
    chunks = [SeqChunk([7], 5, [[9, 2], [0, 3]], 6, 1),
              SeqChunk([1, 2], 0, [[4], [6]], 2, 1)]
    _, _, meta, _ = flatten_batch(chunks, 4, torch.device("cpu"), layer_groups=[1, 0, 1])
    g0, g1 = meta.groups
    assert g0.slot_mapping.tolist() == meta.slot_mapping.tolist() == [9, 16, 17]
    assert g1.slot_mapping.tolist() == [13, 24, 25]
    assert g0.block_tables.tolist() == [[9, 2], [4, 0]]
    assert g1.block_tables.tolist() == [[0, 3], [6, 0]]
    assert [meta.for_layer(i) is g for i, g in enumerate([g1, g0, g1])] == [True] * 3
    assert g1.seq_lens_cpu == [6, 2] and g1.kv_lens.tolist() == [6, 1, 2]
