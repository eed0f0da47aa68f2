"""`pkv bench families`: every family decodes on random weights and says its code path."""

from __future__ import annotations

from pkv.cli.bench_families import bench_families, families_table

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
