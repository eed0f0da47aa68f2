"""pkv: a self-hosted LLM inference engine (paged KV cache, continuous batching).

`from pkv import LLM, SamplingParams` is the offline API. Heavy imports (torch) are deferred
until one of these names is used, so `pkv --help` stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pkv.core.version import pkv_version

__version__ = pkv_version()

_EXPORTS = {
    "LLM": "pkv.core.engine.llm",
    "TextPrompt": "pkv.core.engine.llm",
    "TokensPrompt": "pkv.core.engine.llm",
    "LLMEngine": "pkv.core.engine.llm_engine",
    "EngineConfig": "pkv.core.config.engine",
    "SamplingParams": "pkv.core.sample.sampling_params",
    "PoolingParams": "pkv.core.pooling.params",
    "PoolingRequestOutput": "pkv.core.engine.outputs",
    "RequestOutput": "pkv.core.engine.outputs",
    "CompletionOutput": "pkv.core.engine.outputs",
    "LoRARequest": "pkv.core.lora.adapter",
    "StructuredOutputsParams": "pkv.core.structured_output.params",
}

if TYPE_CHECKING:
    from pkv.core.config.engine import EngineConfig
    from pkv.core.engine.llm import LLM, TextPrompt, TokensPrompt
    from pkv.core.engine.llm_engine import LLMEngine
    from pkv.core.engine.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
    from pkv.core.lora.adapter import LoRARequest
    from pkv.core.pooling.params import PoolingParams
    from pkv.core.sample.sampling_params import SamplingParams
    from pkv.core.structured_output.params import StructuredOutputsParams

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pkv' has no attribute {name!r}")
