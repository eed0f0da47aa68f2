"""`auto` guided decoding: each constraint goes to the backend measured better for its kind
(`pkv bench guided`; README: Structured outputs), outlines where xgrammar is not installed."""

from __future__ import annotations

import importlib.util
from typing import Any

from pkv.core.structured_output.params import StructuredOutputsParams
from pkv.plugins.guided.outlines_backend import OutlinesBackend

# Constraint kind -> backend, measured on the bundled model (README: Structured outputs):
# for JSON schemas outlines decodes faster once compiled (masks cached per state: batch 32
# at 0.90 of unguided throughput against 0.79); xgrammar compiles any JSON object in 10 ms
# where outlines takes 7 s, and regexes and choices 10-20x faster with masks as cheap.
ROUTES = {"json": "outlines", "json_object": "xgrammar", "regex": "xgrammar",
          "choice": "xgrammar"}


class AutoBackend:
    """Routes each constraint by kind; both backends keep their own caches."""

    name = "auto"

    def __init__(self, tokenizer: Any, vocab_size: int, timeout_s: float = 30.0) -> None:
        self.backends: dict[str, Any] = {
            "outlines": OutlinesBackend(tokenizer, vocab_size, timeout_s)}
        if importlib.util.find_spec("xgrammar") is not None:
            from pkv.plugins.guided.xgrammar_backend import XGrammarBackend

            self.backends["xgrammar"] = XGrammarBackend(tokenizer, vocab_size, timeout_s)

    @property
    def timeout_s(self) -> float:
        return self.backends["outlines"].timeout_s

    @timeout_s.setter
    def timeout_s(self, seconds: float) -> None:
        for backend in self.backends.values():
            backend.timeout_s = seconds

    def backend_for(self, params: StructuredOutputsParams) -> Any:
        return self.backends.get(ROUTES[params.kind], self.backends["outlines"])

    def compile(self, params: StructuredOutputsParams) -> Any:
        return self.backend_for(params).compile(params)

    def cache_sizes(self) -> dict[str, tuple[float, float | None, str]]:
        return {k: v for backend in self.backends.values()
                for k, v in backend.cache_sizes().items()}

    def is_cached(self, params: StructuredOutputsParams) -> bool:
        return self.backend_for(params).is_cached(params)
