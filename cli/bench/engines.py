"""Engines as the benchmarks build and read them: the options that serve LoRA adapters, the
adapters loaded, one warm-up request before timing, and which code computed the decoder
layers (the C++ stack, or the Python loop and why)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def lora_options(modules: list[str] | None) -> dict[str, Any]:
    """Engine options that serve `modules` (NAME=PATH): LoRA on, a slot for each, and the
    highest rank among them (read from each adapter_config.json)."""
    if not modules:
        return {}
    import json

    from pkv.core.lora.manager import parse_lora_modules

    ranks = []
    for _, path in parse_lora_modules(modules):
        config = Path(path).expanduser() / "adapter_config.json"
        ranks.append(json.loads(config.read_text()).get("r", 16) if config.is_file() else 16)
    return {"enable_lora": True, "max_loras": len(modules), "max_lora_rank": max(ranks)}


def add_adapters(engine: Any, modules: list[str] | None) -> list[Any]:
    """Load the adapters into `engine`; their LoRARequests, in order."""
    from pkv.core.lora.adapter import LoRARequest
    from pkv.core.lora.manager import parse_lora_modules

    requests = []
    for name, path in parse_lora_modules(modules or []):
        adapter = engine.add_lora(name, path)
        requests.append(LoRARequest(name, adapter.uid, path))
    return requests


def warm_up(engine: Any, lora_request: Any = None) -> None:
    """One short request through `engine` before timing: kernels built, first-call costs
    paid."""
    from pkv.core.sample.sampling_params import SamplingParams

    engine.add_request(None, [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=8),
                       lora_request=lora_request)
    engine.generate_until_done()


def decoder_path(engine: Any) -> str:
    """Which code computes the decoder layers: the C++ stack, or the Python loop and why."""
    from pkv.core.worker.fused_decoder import fused_decoder_gaps
    from pkv.csrc.cpp_build import selected_flavour

    model = engine.runner.model
    if model.model.fused is not None:
        return f"fused C++ decoder stack (csrc/decoder_cpu.cpp, {selected_flavour()} kernels)"
    gaps = fused_decoder_gaps(model) or ["linears not on the C++ kernels (dtype, device or "
                                         "weight format)"]
    return f"Python layer loop ({model.config.architecture}: {'; '.join(gaps)})"
