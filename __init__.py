"""pkv: a self-hosted LLM inference engine (paged KV cache, continuous batching).

`from pkv import LLM, SamplingParams` is the offline API. Heavy imports (torch) are deferred
until one of these names is used, so `pkv --help` stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pkv.core.llm",
    "LLMEngine": "pkv.core.llm_engine",
    "EngineConfig": "pkv.core.config",
    "SamplingParams": "pkv.core.sampling_params",
    "RequestOutput": "pkv.core.outputs",
    "CompletionOutput": "pkv.core.outputs",
    "LoRARequest": "pkv.core.lora_adapter",
}

if TYPE_CHECKING:
    from pkv.core.config import EngineConfig
    from pkv.core.llm import LLM
    from pkv.core.llm_engine import LLMEngine
    from pkv.core.lora_adapter import LoRARequest
    from pkv.core.outputs import CompletionOutput, RequestOutput
    from pkv.core.sampling_params import SamplingParams

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pkv' has no attribute {name!r}")
