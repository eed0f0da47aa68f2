"""pkv's own plugin: the built-in attention backends, registered through the `pkv` entry
point like any third-party plugin."""

from __future__ import annotations

from pkv.plugins.hookspecs import hookimpl
from pkv.plugins.registry import AttentionBackendSpec, GuidedDecodingSpec


def _cpu_reasons(device: str) -> list[str]:
    from pkv.plugins.attention.cpu_backend import unusable_reasons

    return unusable_reasons(device)


@hookimpl
def pkv_attention_backends() -> list[AttentionBackendSpec]:
    return [
        AttentionBackendSpec("torch", "pkv.plugins.attention.torch_backend:TorchAttentionBackend",
                             ("cpu", "cuda"), priority=0,
                             description="reference: gathers blocks, dense attention"),
        AttentionBackendSpec("cpu", "pkv.plugins.attention.cpu_backend:CPUAttentionBackend",
                             ("cpu",), priority=10, check=_cpu_reasons,
                             description="C++/OpenMP kernel reading blocks in place"),
    ]


@hookimpl
def pkv_guided_decoding_backends() -> list[GuidedDecodingSpec]:
    return [GuidedDecodingSpec("outlines", "pkv.plugins.guided.outlines_backend:OutlinesBackend",
                               "JSON schema / regex / choice via outlines-core")]
