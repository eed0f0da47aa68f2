"""`xgrammar` guided decoding (the library vLLM uses by default): constraints compiled into
a pushdown automaton over the vocabulary; each step a matcher fills a bitmask of the allowed
tokens, for any grammar state, without a per-state cache."""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import torch

from pkv.core.structured_output.params import StructuredOutputsParams
from pkv.plugins.guided.compiling import CompilingBackend
from pkv.plugins.guided.outlines_backend import choice_regex, token_bytes_map
from pkv.plugins.guided.schema_rewrite import SchemaRewriter


class XGrammarBackend(CompilingBackend):
    """Schemas, regexes and choices compiled by xgrammar (JSON Schema bounds, formats and
    $refs natively)."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, timeout_s: float = 30.0,
                 cache_size: int = 64) -> None:
        if importlib.util.find_spec("xgrammar") is None:
            raise ValueError("the xgrammar backend needs the xgrammar package: "
                             "pip install 'pkv[xgrammar]'")
        super().__init__(timeout_s, cache_size)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: Any = None

    def _build(self, params: StructuredOutputsParams) -> XGrammar:
        import xgrammar as xgr

        if self._compiler is None:
            self._compiler = xgr.GrammarCompiler(self._tokenizer_info(), max_threads=1)
        try:
            if params.kind == "json":
                # The same structural rewrites as for outlines-core (xgrammar, too, runs
                # an allOf's objects together and lets strings run on); bounds it keeps.
                schema = SchemaRewriter(params.json or {}, ranges=False).schema
                compiled = self._compiler.compile_json_schema(json.dumps(schema),
                                                              any_whitespace=False)
            elif params.kind == "json_object":  # an object; the builtin grammar is any value
                compiled = self._compiler.compile_json_schema('{"type": "object"}',
                                                              any_whitespace=False)
            elif params.kind == "regex":
                compiled = self._compiler.compile_regex(params.regex or "")
            else:
                compiled = self._compiler.compile_regex(choice_regex(params.choice or ()))
        except RuntimeError as exc:  # xgrammar reports bad input as RuntimeError
            raise ValueError(str(exc).splitlines()[0]) from None
        return XGrammar(compiled, self.vocab_size)

    def _tokenizer_info(self) -> Any:
        import xgrammar as xgr

        vocab = [b""] * self.vocab_size  # special tokens stay empty: never allowed
        for data, ids in token_bytes_map(self.tokenizer).items():
            for tid in ids:
                if tid < self.vocab_size:
                    vocab[tid] = data
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                 stop_token_ids=list(self.tokenizer.eos_token_ids))


class XGrammar:
    """A compiled xgrammar grammar; each sequence gets its own matcher."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        self.compiled = compiled
        self.vocab_size = vocab_size
        self.bit_index = torch.arange(32, dtype=torch.int32)

    def new_state(self) -> XGrammarState:
        import xgrammar as xgr

        return XGrammarState(self, xgr.GrammarMatcher(self.compiled))


class XGrammarState:
    """One sequence's matcher."""

    def __init__(self, grammar: XGrammar, matcher: Any) -> None:
        import xgrammar as xgr

        self.grammar = grammar
        self.matcher = matcher
        # Filled anew every step (the mask returned is a fresh tensor): one per sequence.
        self.bitmask = xgr.allocate_token_bitmask(1, grammar.vocab_size)

    def allowed_mask(self) -> torch.Tensor:
        self.matcher.fill_next_token_bitmask(self.bitmask)
        bits = (self.bitmask[0].unsqueeze(-1) >> self.grammar.bit_index) & 1
        return bits.flatten()[: self.grammar.vocab_size].bool()

    def advance(self, token_id: int) -> None:
        if not self.matcher.is_terminated():
            self.matcher.accept_token(token_id)
