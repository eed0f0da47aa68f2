"""`pkv bench embed`: one input per request against one request of all, offline and over a
real server, on a tiny BERT; a generator is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from pkv.cli.bench.embed import write_random_bert
from pkv.cli.main import app

SHAPE = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
             vocab_size=1000, max_position_embeddings=128)


def test_embed_bench_times_both_ways_offline_and_served(tmp_path: Path):
    model = write_random_bert(tmp_path / "bert", SHAPE)
    out = tmp_path / "embed.json"
    result = CliRunner().invoke(app, ["bench", "embed", str(model), "--num-inputs", "6",
                                      "--min-words", "2", "--max-words", "9", "--repeats", "1",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    names = [r["name"] for r in data["runs"]]
    assert names == ["offline, one by one", "offline, batched", "server, one by one",
                     "server, batched"]
    tokens = {r["tokens"] for r in data["runs"]}
    assert len(tokens) == 1 and tokens.pop() >= 6 * 4  # every way embeds the same inputs
    assert data["speedup_offline"] > 0 and data["speedup_server"] > 0
    assert "batched / one by one" in result.output and "flags:" in result.output


def test_embed_bench_refuses_a_generator(tiny_llama_dir: Path):
    result = CliRunner().invoke(app, ["bench", "embed", str(tiny_llama_dir), "--num-inputs",
                                      "2", "--repeats", "1"])
    assert result.exit_code != 0
    assert "not an embedding model" in result.output and "Traceback" not in result.output
