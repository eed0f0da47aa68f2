"""`pkv quantize --awq --backend autoawq`: delegate the search to AutoAWQ where installed.

AutoAWQ is deprecated upstream, heavy, and on CPU (0.2.9) its weight backup during the
scale search is not a copy, so it can silently write a broken model. Its result is therefore
checked against plain round-to-nearest before pkv reports success.
"""

from __future__ import annotations

import time

import torch

from pkv.core.model_loader.loader import open_model
from pkv.quantize import awq
from pkv.quantize.checkpoint import disk_size, quantizable_weights
from pkv.quantize.dense import perplexity
from pkv.quantize.pipeline import (QuantizeOptions, QuantizeReport, check_options,
                                   choose_group_size, default_calibration, input_sizes,
                                   load_float_model, load_quantized, text_samples)


def quantize_with_autoawq(opts: QuantizeOptions) -> QuantizeReport:
    """Quantize with AutoAWQ into `opts.output`, then verify it beats round-to-nearest."""
    try:
        from awq import AutoAWQForCausalLM
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError("--backend autoawq needs the autoawq package: "
                         "pip install 'pkv[autoawq]'") from None
    start = time.perf_counter()
    check_options(opts)
    source = open_model(opts.model)
    if not source.path.is_dir():
        raise ValueError("--backend autoawq reads Hugging Face folders only; use the default "
                         "backend for GGUF files")
    notices: list[str] = []
    group = choose_group_size(opts.group_size, input_sizes(source), notices)
    calib_path = opts.calib or default_calibration()
    lines = [line.strip() for line in calib_path.read_text().splitlines() if line.strip()]
    model = AutoAWQForCausalLM.from_pretrained(str(source.path))
    tokenizer = AutoTokenizer.from_pretrained(str(source.path))
    model.quantize(tokenizer, quant_config={"zero_point": opts.zero_point, "q_group_size": group,
                                            "w_bit": 4, "version": "GEMM"},
                   calib_data=lines, max_calib_samples=opts.calib_samples,
                   max_calib_seq_len=opts.calib_seq_len)
    model.save_quantized(str(opts.output))
    tokenizer.save_pretrained(str(opts.output))
    report = QuantizeReport(disk_size(source.path), disk_size(opts.output),
                            time.perf_counter() - start, notices)
    _check_against_round_to_nearest(opts, group)
    return report


def _check_against_round_to_nearest(opts: QuantizeOptions, group: int) -> None:
    source = open_model(opts.model)
    samples = text_samples(source, opts.calib or default_calibration(), 4, opts.calib_seq_len)
    theirs = perplexity(load_quantized(opts.output, opts.calib_seq_len), samples)
    rtn = load_float_model(source, opts.calib_seq_len, show_progress=False)
    with torch.no_grad():
        for _, weight in quantizable_weights(rtn):
            weight.copy_(awq.fake_quantize(weight, group, opts.zero_point))
    ours = perplexity(rtn, samples)
    if theirs > ours:
        raise ValueError(f"AutoAWQ wrote a model worse than plain round-to-nearest "
                         f"(perplexity {theirs:.2f} vs {ours:.2f}) in {opts.output}: a known "
                         "AutoAWQ bug on CPU; use the default --backend pkv")
