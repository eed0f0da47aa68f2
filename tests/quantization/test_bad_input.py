"""Bad quantization input: a one-line error naming the option or tensor, before anything is
written (pkv quantize) or served (loading)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from pkv import LLM
from pkv.cli.main import app
from pkv.quantize.pipeline import QuantizeReport


def _quantize(*args: str):
    return CliRunner().invoke(app, ["quantize", *args])


def _one_line_error(result, text: str) -> None:  # noqa: ANN001
    assert result.exit_code == 2, result.output
    assert text in result.output, result.output
    assert "Traceback" not in result.output and result.output.count("error:") == 1


@pytest.mark.parametrize("args, text", [
    (["--awq", "--w-bit", "8"], "--w-bit 8 is not supported"),
    (["--awq", "--group-size", "100"], "--group-size 100 does not divide the input sizes [64, 128]"),
    (["--awq", "--fp8"], "choose exactly one of --awq and --fp8"),
    (["--fp8", "--fp8-scheme", "block"], "--fp8-scheme must be one of channel, tensor"),
    (["--awq", "--calib", "/nonexistent.txt"], "--calib file /nonexistent.txt does not exist"),
    (["--awq", "--calib-samples", "0"], "--calib-samples must be >= 1"),
    (["--fp8", "--w-bit", "8", "--no-clip"], "--w-bit, --clip: for --awq only"),
    (["--awq", "--fp8-scheme", "tensor"], "--fp8-scheme: for --fp8 only"),
    (["--awq", "--backend", "autoawq", "--no-search"], "--no-search: for the pkv backend only"),
])
def test_bad_options_write_nothing(tmp_path: Path, tiny_llama_dir: Path, args: list[str],
                                   text: str) -> None:
    out = tmp_path / "out"
    result = _quantize(str(tiny_llama_dir), "--output", str(out), *args)
    _one_line_error(result, text)
    assert not out.exists()
    if "--group-size" not in args:  # (that one needs the model's sizes)
        assert "AWQ layers" not in result.output  # refused before any progress bar


def test_an_output_that_cannot_be_written_is_refused_first(tmp_path: Path,
                                                           tiny_llama_dir: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    out = tmp_path / "a-file" / "out"  # under a file: no folder can be made there
    result = _quantize(str(tiny_llama_dir), "--awq", "--output", str(out))
    _one_line_error(result, f"cannot write --output {out}")
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]


def test_output_must_be_new_or_empty(tmp_path: Path, tiny_llama_dir: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    result = _quantize(str(tiny_llama_dir), "--fp8", "--output", str(tmp_path))
    _one_line_error(result, "already exists and is not an empty folder")
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_model_without_the_expected_linear_layers(tmp_path: Path, tiny_llama_dir: Path) -> None:
    broken = tmp_path / "no-mlp"
    shutil.copytree(tiny_llama_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if ".mlp." not in k},
              broken / "model.safetensors")
    out = tmp_path / "out"
    result = _quantize(str(broken), "--awq", "--output", str(out))
    _one_line_error(result, "checkpoint lacks 6 tensor(s), e.g. ['model.layers.0.mlp.down_proj.weight'")
    assert not out.exists()
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(tiny_llama_dir, gpt2)
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    _one_line_error(_quantize(str(gpt2), "--awq", "--output", str(out)),
                    "unsupported architecture ['GPT2LMHeadModel']")


def test_quantized_input_is_refused(tmp_path: Path,
                                    fp8_tiny: tuple[Path, QuantizeReport]) -> None:
    result = _quantize(str(fp8_tiny[0]), "--awq", "--output", str(tmp_path / "o"))
    _one_line_error(result, "is already fp8-quantized")


def _corrupt(src: Path, dst: Path, edit) -> Path:  # noqa: ANN001
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def _load(path: Path, **kwargs) -> LLM:  # noqa: ANN003
    return LLM(str(path), kv_cache_memory="16MiB", max_model_len=128, show_progress=False,
               **kwargs)


def test_inconsistent_awq_shapes_and_missing_tensors(tmp_path: Path,
                                                     awq_tiny: tuple[Path, QuantizeReport]) -> None:
    src = awq_tiny[0]
    name = "model.layers.1.self_attn.o_proj.qzeros"
    wide = _corrupt(src, tmp_path / "wide", lambda t: t.update({name: t[name].repeat(1, 2)}))
    with pytest.raises(ValueError, match=f"'{name}' has shape \\(1, 16\\), the model expects "
                                         "\\(1, 8\\)"):
        _load(wide)
    scales = "model.layers.0.mlp.up_proj.scales"
    missing = _corrupt(src, tmp_path / "missing", lambda t: t.pop(scales))
    with pytest.raises(ValueError, match=f"lacks 1 tensor\\(s\\), e.g. \\['{scales}'\\]"):
        _load(missing)
    bits = tmp_path / "bits"
    shutil.copytree(src, bits)
    config = json.loads((bits / "config.json").read_text())
    config["quantization_config"]["bits"] = 8
    (bits / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="bits=8 are not supported"):
        _load(bits)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
def test_bad_fp8_scales_are_refused(tmp_path: Path, fp8_tiny: tuple[Path, QuantizeReport],
                                    bad: float) -> None:
    name = "model.layers.0.mlp.gate_proj.weight_scale"

    def edit(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name].clone()
        t[name][3] = bad

    broken = _corrupt(fp8_tiny[0], tmp_path / "fp8", edit)
    with pytest.raises(ValueError, match=f"'{name}' holds non-finite or non-positive"):
        _load(broken)


def test_quantization_flag_must_match_the_checkpoint(
        tiny_llama_dir: Path, smol_gguf: Path, awq_tiny: tuple[Path, QuantizeReport],
        fp8_tiny: tuple[Path, QuantizeReport]) -> None:
    awq_dir, fp8_dir = awq_tiny[0], fp8_tiny[0]
    cases = [
        (awq_dir, "fp8", "--quantization fp8 does not match the checkpoint, which is "
                         "awq-quantized (quantization_config in"),
        (fp8_dir, "awq", "which is fp8-quantized"),
        (tiny_llama_dir, "awq", "--quantization awq does not match the checkpoint, which is "
                                "not quantized"),
        (smol_gguf, "awq", "which is gguf-quantized (GGUF file SmolLM2"),
        (awq_dir, "none", "--quantization none was asked for, but the checkpoint is "
                          "awq-quantized"),
        (tiny_llama_dir, "gptq", "unknown quantization method 'gptq', which pkv cannot load; "
                                 "available: awq, fp8, gguf"),
    ]
    for path, flag, message in cases:
        with pytest.raises(ValueError, match=_escape(message)):
            _load(path, quantization=flag)


def test_unsupported_checkpoint_method_is_named(tmp_path: Path, tiny_llama_dir: Path) -> None:
    gptq = tmp_path / "gptq"
    shutil.copytree(tiny_llama_dir, gptq)
    config = json.loads((gptq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (gptq / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="the checkpoint is quantized with quantization "
                                         "method 'gptq', which pkv cannot load"):
        _load(gptq)


def test_block_scaled_fp8_is_refused_by_name(tmp_path: Path, tiny_llama_dir: Path) -> None:
    blocks = tmp_path / "blocks"
    shutil.copytree(tiny_llama_dir, blocks)
    config = json.loads((blocks / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "weight_block_size": [128, 128]}
    (blocks / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"block-scaled FP8 \(weight_block_size \[128, 128\]\)"):
        _load(blocks)


def _escape(text: str) -> str:
    import re

    return re.escape(text)
