"""A cap on a request's thinking: past `budget` tokens of its thinking block, the engine
writes the block's end marker itself and the answer follows.

The block is found by token ids: `start` (the tokens that open it; empty when the chat
template has opened it already, as DeepSeek-R1's does) and `end` (`</think>`'s tokens).
An output that does not open the block is never touched. Forcing continues the end marker
from however much of it the output already holds at its tail.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ThinkingBudget:
    budget: int
    start: list[int]
    end: list[int]
    phase: str = field(default="opening", init=False)  # opening -> thinking -> done
    opened: int = field(default=0, init=False)  # tokens of `start` seen
    count: int = field(default=0, init=False)  # thinking tokens so far
    matched: int = field(default=0, init=False)  # tokens of `end` at the output's tail

    def __post_init__(self) -> None:
        if not self.start:
            self.phase = "thinking"

    def forced(self) -> int | None:
        """The token the budget puts next, or None (the model's own)."""
        if self.phase == "thinking" and self.count >= self.budget:
            return self.end[self.matched]
        return None

    def observe(self, token: int) -> None:
        """Follow the output by one token."""
        if self.phase == "opening":
            if token != self.start[self.opened]:
                self.phase = "done"  # it answers without thinking
                return
            self.opened += 1
            if self.opened == len(self.start):
                self.phase = "thinking"
            return
        if self.phase != "thinking":
            return
        self.count += 1
        if token == self.end[self.matched]:
            self.matched += 1
        else:
            self.matched = 1 if token == self.end[0] else 0
        if self.matched == len(self.end):
            self.phase = "done"
