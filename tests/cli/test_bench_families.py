"""`pkv bench families`: every family decodes on random weights and says its code path."""

from __future__ import annotations

from pkv.cli.bench.families import bench_families, families_table

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16)


def test_rows_for_a_dense_and_a_moe_family():
    rows = bench_families(["llama", "gemma2", "mixtral"], [1, 2], 4,
                          shape={**TINY, "vocab_size": 49152})
    assert [r.family for r in rows] == ["llama", "gemma2", "mixtral"]
    for row in rows:
        assert set(row.decode_tps) == {1, 2} and all(v > 0 for v in row.decode_tps.values())
    llama, gemma2, mixtral = rows
    assert llama.path.startswith("fused C++") and gemma2.path.startswith("fused C++")
    assert mixtral.path.startswith("Python layer loop") and "MLP" in mixtral.path
    assert families_table(rows, [1, 2]).row_count == 3


def test_window_bench_levels_off_with_a_window():
    from pkv.cli.bench.window import window_table, window_vs_full

    runs = window_vs_full(8, 8, 96, 16, shape={**TINY, "vocab_size": 49152})
    windowed, full = runs["window 8"], runs["no window"]
    assert sorted(windowed) == sorted(full) == [24, 40, 56, 72, 88]
    assert max(windowed.values()) <= 2  # the window's keys span two blocks at most
    assert full[88] == -(-87 // 16) and full[88] > full[24]  # 87 tokens computed so far
    assert window_table(runs, 16).row_count == 5


def test_hybrid_window_bench_holds_near_the_least():
    from pkv.cli.bench.window import hybrid_vs_least, window_table

    # Gemma 3's pattern at six layers: five windowed (16 tokens), the last one global.
    runs = hybrid_vs_least("gemma3", 8, 192, 32, shape={**TINY, "vocab_size": 49152,
                                                        "num_hidden_layers": 6,
                                                        "sliding_window": 16})
    held, least, one_table = runs["pkv"], runs["least"], runs["one table"]
    assert sorted(held) == sorted(least) == [40, 72, 104, 136, 168]
    assert least[168] == -(-167 // 16) + 5 * 2  # the global layer's blocks + two per window
    assert least[168] <= held[168] <= 1.3 * least[168]
    assert one_table[168] == 6 * -(-167 // 16) > 2.5 * held[168]
    assert window_table(runs, 16, "layer-blocks").row_count == 5
