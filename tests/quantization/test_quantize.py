"""`pkv quantize` end to end on tiny models: AWQ and FP8 checkpoints load back in pkv,
generate, and keep perplexity close to the float model; the AWQ search beats rounding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pkv import LLM, SamplingParams
from pkv.quantize import awq
from pkv.quantize.pipeline import QuantizeReport
from pkv.tests.quantization.conftest import quantize_tiny


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_awq_checkpoint_is_autoawq_gemm_format(awq_tiny: tuple[Path, QuantizeReport]) -> None:
    out, report = awq_tiny
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
        "version": "gemm", "modules_to_not_convert": None}
    assert report.notices == ["group size 128 does not divide the input sizes [64, 128]; "
                              "using 64"]
    tensors = _tensors(out)
    prefix = "model.layers.0.self_attn.q_proj"
    assert tensors[f"{prefix}.qweight"].dtype == torch.int32
    assert tensors[f"{prefix}.qweight"].shape == (64, 64 // 8)  # [K, N/8]
    assert tensors[f"{prefix}.qzeros"].shape == (1, 64 // 8)  # [K/G, N/8]
    assert tensors[f"{prefix}.scales"].shape == (1, 64) and tensors[f"{prefix}.scales"].dtype == torch.float16
    assert tensors[f"{prefix}.bias"].shape == (64,)  # Qwen2's q bias stays float
    assert "model.layers.1.mlp.down_proj.qweight" in tensors
    assert not any(k.endswith("proj.weight") for k in tensors)
    assert (out / "tokenizer.json").is_file()
    assert report.size_after < report.size_before


def test_awq_model_generates_and_keeps_perplexity(awq_tiny: tuple[Path, QuantizeReport],
                                                  tiny_qwen2_dir: Path) -> None:
    out, report = awq_tiny
    assert report.perplexity_after < report.perplexity_before * 1.05
    quant = LLM(str(out), kv_cache_memory="16MiB", max_model_len=256, show_progress=False)
    assert quant.llm_engine.quantization == "awq"
    float_llm = LLM(str(tiny_qwen2_dir), kv_cache_memory="16MiB", max_model_len=256,
                    show_progress=False)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], list(range(100, 140))]
    q_out = [o.outputs[0].token_ids for o in quant.generate(prompts, params)]
    f_out = [o.outputs[0].token_ids for o in float_llm.generate(prompts, params)]
    assert all(len(ids) == 8 for ids in q_out)
    # A 4-bit random model drifts, but the first greedy token mostly survives.
    assert sum(q[0] == f[0] for q, f in zip(q_out, f_out)) >= 1


def test_awq_search_beats_round_to_nearest_on_every_group(
        awq_tiny: tuple[Path, QuantizeReport]) -> None:
    _, report = awq_tiny
    assert set(report.awq_vs_rtn) == {"qkv", "gate_up", "down"}  # no o: GQA
    assert all(ratio <= 1.0 for ratio in report.awq_vs_rtn.values())


def test_scale_search_protects_salient_channels() -> None:
    """Inputs with a few large channels (as in real LLMs): AWQ scales cut the error of
    4-bit weights well below round-to-nearest."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=gen)
    x[:, :4] *= 30
    w = torch.randn(96, 128, generator=gen)
    weight = w.clone()
    settings = awq.AWQSettings(group_size=32)
    _, best, rtn = awq.search_scales([weight], x, lambda: x @ weight.t(), settings)
    assert best < 0.8 * rtn
    assert torch.equal(weight, w)  # the search restores the weights


def test_clip_search_never_hurts() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(128, 64, generator=gen)
    w = torch.randn(32, 64, generator=gen)
    w[0, 0] = 12.0  # an outlier weight stretches its group's range
    s = awq.AWQSettings(group_size=32)
    plain = (x @ awq.fake_quantize(w, 32, True).t() - x @ w.t()).pow(2).mean()
    clipped = awq.search_clip(w, x, s)
    after = (x @ awq.fake_quantize(clipped, 32, True).t() - x @ w.t()).pow(2).mean()
    assert after <= plain


def test_no_zero_point_uses_symmetric_codes(tmp_path: Path, tiny_llama_dir: Path) -> None:
    out = tmp_path / "sym"
    report = quantize_tiny(tiny_llama_dir, out, "awq", zero_point=False, search=False)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["zero_point"] is False
    zeros = _tensors(out)["model.layers.0.mlp.up_proj.qzeros"]
    assert (zeros == 0x88888888 - 2**32).all()  # every zero point is 8
    assert report.perplexity_after < report.perplexity_before * 1.05


def test_fp8_checkpoint_layout_and_reload(fp8_tiny: tuple[Path, QuantizeReport],
                                          tiny_llama_dir: Path) -> None:
    out, report = fp8_tiny
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"
    assert config["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    tensors = _tensors(out)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.0.self_attn.k_proj.weight_scale"].shape == (32, 1)
    assert report.perplexity_after < report.perplexity_before * 1.02
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=5)
    fp8 = LLM(str(out), kv_cache_memory="16MiB", max_model_len=256, show_progress=False)
    ref = LLM(str(tiny_llama_dir), kv_cache_memory="16MiB", max_model_len=256,
              show_progress=False)
    assert fp8.llm_engine.quantization == "fp8"
    # A random model's logits are nearly flat, so compare distributions, not argmaxes: the
    # FP8 model's greedy token is among the float model's five likeliest.
    prompt = [[5, 6, 7, 8, 9, 10]]
    first = fp8.generate(prompt, params)[0].outputs[0].token_ids[0]
    top5 = ref.generate(prompt, params)[0].outputs[0].logprobs[0]
    assert first in top5


def test_fp8_per_tensor_scales_load_into_fused_layers(tmp_path: Path,
                                                      tiny_llama_dir: Path) -> None:
    out = tmp_path / "fp8-tensor"
    report = quantize_tiny(tiny_llama_dir, out, "fp8", fp8_strategy="tensor")
    assert _tensors(out)["model.layers.0.self_attn.q_proj.weight_scale"].shape == (1,)
    assert report.perplexity_after < report.perplexity_before * 1.05


def test_fp8_on_load_quantizes_a_float_checkpoint(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), quantization="fp8", kv_cache_memory="16MiB",
              max_model_len=256, show_progress=False)
    assert llm.llm_engine.quantization == "fp8"
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0,
                                                   ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_the_written_config_keeps_nulls_and_names_one_dtype() -> None:
    from types import SimpleNamespace

    from pkv.quantize.checkpoint import hf_config

    source = SimpleNamespace(
        hf_config={"model_type": "mistral", "sliding_window": None, "dtype": "bfloat16",
                   "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
        config=SimpleNamespace(architecture="mistral"))
    config = hf_config(source, {"quant_method": "awq"})  # type: ignore[arg-type]
    assert "sliding_window" in config and config["sliding_window"] is None  # no window
    assert config["dtype"] == config["torch_dtype"] == "float16"
    assert config["rope_theta"] == 1e6  # where transformers 4 reads it


def test_an_eval_text_shorter_than_a_row_is_one_row(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """--eval's rows are 256 tokens and no flag changes that: a shorter text is read whole
    (it was refused with a hint naming a flag that does not exist)."""
    from typer.testing import CliRunner

    from pkv.cli.main import app

    short = tmp_path / "short.txt"
    short.write_text("The cat sat on the mat. The dog lay by the door.\n")
    result = CliRunner().invoke(app, ["quantize", str(tiny_llama_dir), "--fp8", "--output",
                                      str(tmp_path / "out"), "--eval", str(short)])
    assert result.exit_code == 0, result.output
    assert "perplexity" in result.output.lower()
