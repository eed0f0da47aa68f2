"""IncrementalDetokenizer: text that grows token by token, correct across BPE merges and
multi-byte UTF-8 characters split over several tokens.

It decodes a short window of trailing tokens twice: up to the last emitted token
(`prefix_offset:read_offset`) and up to the newest one (`prefix_offset:`). The difference is
the new text, held back while it ends in an incomplete character (U+FFFD). The window starts
inside the prompt so that tokenizers that treat the first token specially (a leading-space
marker) decode a continuation, not a fresh start.
"""

from __future__ import annotations

from pkv.core.tokenizer.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text, one token at a time."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""

    def add_token(self, token_id: int) -> str:
        """Append one token; return the text that became final because of it (may be "")."""
        self.token_ids.append(token_id)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        prefix_text = decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = decode(self.token_ids[self.prefix_offset:])
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""  # an incomplete UTF-8 sequence, or a token that adds no text
        new_text = full_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.output_text += new_text
        return new_text
