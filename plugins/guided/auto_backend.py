"""`auto` guided decoding: each constraint goes to the backend measured better for its kind
(`pkv bench guided`; README: Structured outputs), outlines where xgrammar is not installed."""

from __future__ import annotations

import importlib.util
from typing import Any

from pkv.core.structured_outputs import StructuredOutputsParams
from pkv.plugins.guided.outlines_backend import OutlinesBackend

# Constraint kind -> backend. Measured on the bundled model (2 vCPU Xeon): see the README.
ROUTES = {"json": "xgrammar", "json_object": "xgrammar", "regex": "outlines",
          "choice": "outlines"}


class AutoBackend:
    """Routes each constraint by kind; both backends keep their own caches."""

    name = "auto"

    def __init__(self, tokenizer: Any, vocab_size: int, timeout_s: float = 30.0) -> None:
        self.backends: dict[str, Any] = {
            "outlines": OutlinesBackend(tokenizer, vocab_size, timeout_s)}
        if importlib.util.find_spec("xgrammar") is not None:
            from pkv.plugins.guided.xgrammar_backend import XGrammarBackend

            self.backends["xgrammar"] = XGrammarBackend(tokenizer, vocab_size, timeout_s)

    def backend_for(self, params: StructuredOutputsParams) -> Any:
        return self.backends.get(ROUTES[params.kind], self.backends["outlines"])

    def compile(self, params: StructuredOutputsParams) -> Any:
        return self.backend_for(params).compile(params)

    def is_cached(self, params: StructuredOutputsParams) -> bool:
        return self.backend_for(params).is_cached(params)
