"""pkv's own plugin: the built-in attention backends, weight loaders, guided-decoding backends
and tool parsers, registered through the `pkv` entry point like any third-party plugin."""

from __future__ import annotations

from pkv.core.hookspecs import hookimpl
from pkv.core.registry import (AttentionBackendSpec, GuidedDecodingSpec, ToolParserSpec,
                               WeightLoaderSpec)


def _cpu_reasons(device: str) -> list[str]:
    from pkv.plugins.attention.cpu_backend import unusable_reasons

    return unusable_reasons(device)


def _torch_reasons(device: str) -> list[str]:
    import torch

    return ["no CUDA/ROCm device"] if device == "cuda" and not torch.cuda.is_available() else []


def _triton_reasons(device: str) -> list[str]:
    import importlib.util
    import os

    import torch

    reasons = []
    if importlib.util.find_spec("triton") is None:
        reasons.append("triton is not installed (pip install 'pkv[triton]')")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        reasons.append("runs on CPU only under TRITON_INTERPRET=1 (for tests)")
    if device == "cuda" and not torch.cuda.is_available():
        reasons.append("no CUDA/ROCm device")
    return reasons


@hookimpl
def pkv_attention_backends() -> list[AttentionBackendSpec]:
    return [
        AttentionBackendSpec("torch", "pkv.plugins.attention.torch_backend:TorchAttentionBackend",
                             ("cpu", "cuda"), priority=0, check=_torch_reasons,
                             scaled_kv=True,
                             description="reference: gathers blocks, dense attention"),
        AttentionBackendSpec("cpu", "pkv.plugins.attention.cpu_backend:CPUAttentionBackend",
                             ("cpu",), priority=10, check=_cpu_reasons, scaled_kv=True,
                             description="C++/OpenMP kernel reading blocks in place"),
        AttentionBackendSpec("triton", "pkv.plugins.attention.triton_backend:TritonAttentionBackend",
                             ("cuda", "cpu"), priority=20, check=_triton_reasons,
                             scaled_kv=True,
                             description="Triton paged decode/prefill (CUDA and ROCm)"),
    ]


@hookimpl
def pkv_guided_decoding_backends() -> list[GuidedDecodingSpec]:
    return [GuidedDecodingSpec("outlines", "pkv.plugins.guided.outlines_backend:OutlinesBackend",
                               "JSON schema / regex / choice via outlines-core"),
            GuidedDecodingSpec("xgrammar", "pkv.plugins.guided.xgrammar_backend:XGrammarBackend",
                               "JSON schema / regex / choice via xgrammar"),
            GuidedDecodingSpec("auto", "pkv.plugins.guided.auto_backend:AutoBackend",
                               "per constraint kind, the backend measured better")]


@hookimpl
def pkv_weight_loaders() -> list[WeightLoaderSpec]:
    return [
        WeightLoaderSpec("gguf", "pkv.plugins.weights.gguf:GGUFLoader",
                         "GGUF files (llama.cpp), quantized tensors kept in their blocks",
                         file_magic=b"GGUF"),
        WeightLoaderSpec("awq", "pkv.plugins.weights.awq:AWQLoader",
                         "AutoAWQ GEMM 4-bit checkpoints (fused CPU kernel, Triton on GPU)"),
        WeightLoaderSpec("fp8", "pkv.plugins.weights.fp8:FP8Loader",
                         "FP8 e4m3 checkpoints (vLLM / compressed-tensors), or fp8 on load"),
    ]


@hookimpl
def pkv_tool_parsers() -> list[ToolParserSpec]:
    base = "pkv.plugins.tool_parsers"
    return [
        ToolParserSpec("hermes", f"{base}.hermes:HermesToolParser", ("<tool_call>",),
                       "<tool_call>{json}</tool_call> (Qwen 2.5/3, SmolLM3, Hermes)"),
        ToolParserSpec("llama3_json", f"{base}.llama3_json:Llama3JsonToolParser",
                       ("<|python_tag|>",), '{"name", "parameters"} objects (Llama 3.1/3.3)'),
        ToolParserSpec("mistral", f"{base}.mistral:MistralToolParser", ("[TOOL_CALLS]",),
                       "[TOOL_CALLS][{json}, ...] (Mistral)"),
        ToolParserSpec("pythonic", f"{base}.pythonic:PythonicToolParser", (),
                       "[f(a=1), g()] (Llama 3.2/4, ToolACE)"),
    ]
