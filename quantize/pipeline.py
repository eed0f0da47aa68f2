"""`pkv quantize`: load a float model, quantize it (AWQ or FP8), write it, report size and
perplexity. Every input is checked before anything is written."""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable

import torch

from pkv.core.model_loader.loader import ModelSource, build_model, open_model
from pkv.core.model_loader.quantization import resolve_weight_loader
from pkv.core.models.llama import LlamaForCausalLM
from pkv.core.registry import discover
from pkv.plugins.attention.torch_backend import TorchAttentionBackend
from pkv.quantize import awq, fp8
from pkv.quantize.checkpoint import disk_size, write_checkpoint
from pkv.quantize.dense import perplexity, token_samples

GROUP_SIZES = (128, 64, 32)


@dataclass
class QuantizeOptions:
    model: str | None
    output: Path
    method: str  # "awq" or "fp8"
    w_bit: int = 4
    group_size: int | None = None  # None: 128, else the largest of 128/64/32 that fits
    zero_point: bool = True
    search: bool = True  # False: plain round-to-nearest (a baseline for comparison)
    clip: bool = True
    calib: Path | None = None  # None: the calibration text shipped with pkv
    calib_samples: int = 16
    calib_seq_len: int = 256
    fp8_strategy: str = "channel"
    eval_file: Path | None = None
    eval_seq_len: int = 256


@dataclass
class QuantizeReport:
    size_before: int
    size_after: int
    seconds: float
    notices: list[str] = field(default_factory=list)
    perplexity_before: float | None = None
    perplexity_after: float | None = None
    # Mean over layers of the AWQ block error relative to round-to-nearest, per group.
    awq_vs_rtn: dict[str, float] = field(default_factory=dict)


def default_calibration() -> Path:
    return Path(str(resources.files("pkv.quantize.data") / "calibration.txt"))


def check_options(opts: QuantizeOptions) -> None:
    """Reject bad options before any model is loaded."""
    if opts.method not in ("awq", "fp8"):
        raise ValueError("choose --awq or --fp8")
    if opts.method == "awq" and opts.w_bit != 4:
        raise ValueError(f"--w-bit {opts.w_bit} is not supported: AWQ here packs 4-bit weights")
    if opts.output.exists() and (not opts.output.is_dir() or any(opts.output.iterdir())):
        raise ValueError(f"--output {opts.output} already exists and is not an empty folder")
    if opts.fp8_strategy not in fp8.STRATEGIES:
        raise ValueError(f"--fp8-scheme must be one of {', '.join(fp8.STRATEGIES)}")
    for flag, path in (("--calib", opts.calib), ("--eval", opts.eval_file)):
        if path is not None and not path.is_file():
            raise FileNotFoundError(f"{flag} file {path} does not exist")
    for flag, value in (("--calib-samples", opts.calib_samples),
                        ("--calib-seq-len", opts.calib_seq_len)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if opts.group_size is not None and opts.group_size < 2:
        raise ValueError(f"--group-size must be >= 2, got {opts.group_size}")
    _check_writable(opts.output)


def _check_writable(output: Path) -> None:
    """A ValueError now, not after minutes of search, where `output` cannot be made: a
    folder made and removed in its nearest existing parent (nothing is left behind)."""
    parent = output.absolute()
    while not parent.exists():
        parent = parent.parent
    try:
        os.rmdir(tempfile.mkdtemp(dir=parent))
    except OSError as exc:
        raise ValueError(f"cannot write --output {output}: {parent} is not a writable "
                         f"folder ({exc.strerror})") from None


def input_sizes(source: ModelSource) -> list[int]:
    """The input features of the decoder's linears (hidden, attention output, MLP)."""
    cfg = source.config
    return sorted({cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim,
                   cfg.intermediate_size})


def choose_group_size(requested: int | None, sizes: list[int],
                      notices: list[str]) -> int:
    """The group size: the requested one if it divides every input size, else an error;
    by default 128, falling back to the largest of 128/64/32 that fits."""
    if requested is not None:
        if any(size % requested for size in sizes):
            raise ValueError(f"--group-size {requested} does not divide the input sizes "
                             f"{sizes} of this model's linear layers")
        return requested
    for group in GROUP_SIZES:
        if all(size % group == 0 for size in sizes):
            if group != GROUP_SIZES[0]:
                notices.append(f"group size {GROUP_SIZES[0]} does not divide the input sizes "
                               f"{sizes}; using {group}")
            return group
    raise ValueError(f"none of the group sizes {GROUP_SIZES} divides the input sizes {sizes}")


# AWQ's scale search follows Llama's layer (pre-norm, q/k/v and gate/up sharing an input).
QUANTIZABLE_FAMILIES = ("llama", "mistral", "qwen2")


def load_float_model(source: ModelSource, max_len: int, show_progress: bool) -> LlamaForCausalLM:
    family = source.config.architecture
    if family not in QUANTIZABLE_FAMILIES:
        raise ValueError(f"pkv quantize runs the {', '.join(QUANTIZABLE_FAMILIES)} families; "
                         f"{source.name} is {family}")
    return build_model(source, TorchAttentionBackend(), max_len, torch.float32,
                       torch.device("cpu"), show_progress=show_progress)


def text_samples(source: ModelSource, path: Path, num: int, seq_len: int,
                 whole_if_short: bool = False) -> torch.Tensor:
    """Rows of `seq_len` tokens of the file's text; `whole_if_short`: a text shorter than
    one row is one row of all its tokens (an --eval text, whose row length is not a flag)."""
    lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    ids = [t for line in lines for t in source.tokenizer.encode(line + "\n",
                                                                add_special_tokens=False)]
    if whole_if_short and 1 < len(ids) < seq_len:
        seq_len = len(ids)
    return token_samples(ids, num, seq_len)


def quantize_model(opts: QuantizeOptions, show_progress: bool = True,
                   on_layer: Callable[[int, int], None] | None = None) -> QuantizeReport:
    """Quantize `opts.model` into `opts.output`; returns sizes, times and perplexities."""
    start = time.perf_counter()
    check_options(opts)
    source = open_model(opts.model)
    if source.quantization not in (None, "gguf"):
        raise ValueError(f"{source.path} is already {source.quantization}-quantized; give a "
                         "float model (a Hugging Face folder or a GGUF file)")
    notices: list[str] = []
    settings = None
    if opts.method == "awq":
        group = choose_group_size(opts.group_size, input_sizes(source), notices)
        settings = awq.AWQSettings(group, opts.zero_point, opts.clip and opts.search)
    calib = text_samples(source, opts.calib or default_calibration(), opts.calib_samples,
                         opts.calib_seq_len) if settings and opts.search else None
    evals = (text_samples(source, opts.eval_file, 64, opts.eval_seq_len, whole_if_short=True)
             if opts.eval_file else None)
    max_len = max(opts.calib_seq_len, opts.eval_seq_len)
    model = load_float_model(source, max_len, show_progress)
    report = QuantizeReport(disk_size(source.path), 0, 0.0, notices)
    if evals is not None:
        report.perplexity_before = perplexity(model, evals)
    if settings is not None:
        tensors, quant_config = _awq(model, calib, settings, report, on_layer)
    else:
        tensors = fp8.checkpoint_tensors(model, opts.fp8_strategy)
        quant_config = fp8.quant_config(opts.fp8_strategy)
    write_checkpoint(opts.output, source, tensors, quant_config)
    report.size_after = disk_size(opts.output)
    report.seconds = time.perf_counter() - start
    if evals is not None:
        report.perplexity_after = perplexity(load_quantized(opts.output, max_len), evals)
    return report


def _awq(model: LlamaForCausalLM, calib: torch.Tensor | None, s: awq.AWQSettings,
         report: QuantizeReport, on_layer: Callable[[int, int], None] | None
         ) -> tuple[dict[str, torch.Tensor], dict]:
    ratios: dict[str, list[float]] = {}
    num_layers = len(model.model.layers)

    def record(i: int, layer: awq.LayerReport) -> None:
        for name, error in layer.awq_error.items():
            ratios.setdefault(name, []).append(error / max(layer.rtn_error[name], 1e-30))
        if on_layer:
            on_layer(i + 1, num_layers)

    if calib is not None:
        awq.awq_quantize(model, calib, s, record)
    report.awq_vs_rtn = {k: sum(v) / len(v) for k, v in ratios.items()}
    quant_config = {"quant_method": "awq", "bits": 4, "group_size": s.group_size,
                    "zero_point": s.zero_point, "version": "gemm",
                    "modules_to_not_convert": None}
    return awq.checkpoint_tensors(model, s), quant_config


def load_quantized(path: Path, max_len: int) -> LlamaForCausalLM:
    """Load a quantized folder the way the engine does (its weight-loader plugin)."""
    registry = discover()
    source = open_model(str(path), registry)
    loader = resolve_weight_loader("auto", source, registry)
    device = torch.device("cpu")
    method = loader.linear_method(source, device) if loader else None
    return build_model(source, TorchAttentionBackend(), max_len, torch.float32, device, method,
                       show_progress=False)
