"""DraftModelProposer: a small model with the target's vocabulary guesses the next tokens.

The draft shares the target's block tables: block b holds the target's K/V of its tokens in
the target's pool and the draft's K/V of the same tokens in the draft's own tensor, so one
KV cache manager (and one memory budget) serves both, and freeing a request frees both.
A target with several KV groups (global and windowed layers) lends the draft its first
group's tables, the global layers' (every block of the sequence).

Per step, before the target verifies, for every request with a lookahead:

    catch-up  tokens the draft has not seen (the prompt at first, later the tokens accepted
              last step and the newest one), one multi-token pass -> d1
    then      d1 -> d2, d2 -> d3, ... one single-token pass each, up to the lookahead

Drafts are the draft's argmax (a point-mass proposal, which rejection sampling verifies
exactly, greedy or not). Draft K/V written for drafts the target rejects sit past the
request's verified tokens and are overwritten by the next catch-up before anything reads them.

A prompt whose prefix hits the prefix cache starts its catch-up after the blocks that still
hold the draft's K/V of that prefix: the proposer remembers, per block, the hash of the full
block of verified tokens the draft last wrote there. A block the draft writes anything else
into forgets it; a block the target reuses for other tokens is only ever handed to a request
under the hash of what it holds now, which matches the one remembered only if the tokens
(and so the draft's K/V of them) are the same.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pkv.core.config.engine import EngineConfig
from pkv.core.config.speculative import SpeculativeConfig
from pkv.core.sched.request import Request
from pkv.core.worker.input_batch import SeqChunk
from pkv.core.worker.model_runner import ModelRunner
from pkv.core.worker.model_setup import ModelSetup


def check_draft_vocab(spec: SpeculativeConfig, draft_vocab: int, target_vocab: int) -> None:
    """A draft proposes token ids of the target's vocabulary, so the two must share it."""
    if draft_vocab != target_vocab:
        raise ValueError(f"speculative_config model {spec.model!r}: its vocabulary has "
                         f"{draft_vocab} tokens, the target's {target_vocab}; a draft must "
                         "share the target's tokenizer")


class DraftModelProposer:
    """Runs the draft model over the target's block tables."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._held: dict[int, bytes] = {}  # block id -> hash of the block whose draft K/V it holds
        self.num_catch_up_tokens = 0  # verified tokens the draft has run (prompts included)

    @classmethod
    def load(cls, config: EngineConfig, spec: SpeculativeConfig, max_model_len: int,
             vocab_size: int, show_progress: bool) -> DraftModelProposer:
        """Open and load the draft (its KV pool is sized later, `allocate_kv`); any problem
        is a one-line ValueError naming the draft."""
        # The draft runs whole on the driver, whatever the target's split.
        draft_config = replace(config, model=spec.model, quantization=spec.quantization,
                               revision=None, gguf_file=None, max_model_len=max_model_len,
                               speculative_config=None, enable_lora=False,
                               tensor_parallel_size=1, pipeline_parallel_size=1,
                               pp_layer_partition=None)
        try:
            setup = ModelSetup.prepare(draft_config)
            check_draft_vocab(spec, setup.source.config.vocab_size, vocab_size)
            runner = ModelRunner(draft_config, setup, show_progress, num_blocks=0,
                                 one_kv_group=True)
        except Exception as exc:
            message = str(exc)
            if not message.startswith("speculative_config"):
                message = f"speculative_config model {spec.model!r}: {message}"
            raise ValueError(message) from None
        return cls(runner)

    @property
    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block

    def allocate_kv(self, num_blocks: int) -> None:
        self.runner.allocate_kv(num_blocks)
        self._held.clear()

    @torch.inference_mode()
    def propose(self, requests: list[Request], lookahead: dict[str, int],
                tables: dict[str, list[list[int]]], high_watermark: int,
                held_from: dict[str, int] | None = None) -> dict[str, list[int]]:
        """Up to lookahead[id] drafts per request. A catch-up starts no earlier than the
        blocks its table still holds: the places of those given back behind a window are
        other requests' blocks now (its first drafts then see less than the whole past)."""
        chunks = []
        for r in requests:
            table = tables[r.request_id][0]
            start = max(r.num_draft_computed_tokens or self._reusable(r, table),
                        (held_from or {}).get(r.request_id, 0))
            self._forget(r, table, start, lookahead[r.request_id])
            chunks.append(SeqChunk(r.all_token_ids[start:], start, [table], r.num_tokens, 1))
            r.num_draft_computed_tokens = r.num_tokens
            self.num_catch_up_tokens += r.num_tokens - start
        drafts = {r.request_id: [t] for r, t in zip(requests, self._argmax(chunks, high_watermark))}
        for r, chunk in zip(requests, chunks):
            self._remember(r, chunk.block_tables[0], chunk.start)
        active = list(requests)
        while True:
            active = [r for r in active if len(drafts[r.request_id]) < lookahead[r.request_id]]
            if not active:
                return drafts
            chunks = [SeqChunk([drafts[r.request_id][-1]],
                               r.num_tokens - 1 + len(drafts[r.request_id]),
                               [tables[r.request_id][0]], r.num_tokens, 1) for r in active]
            for r, token in zip(active, self._argmax(chunks, high_watermark)):
                drafts[r.request_id].append(token)

    def _reusable(self, r: Request, table: list[int]) -> int:
        """Tokens at the start of `r` whose draft K/V its blocks already hold (at least its
        last token is run: its logits give the first draft)."""
        bs = self.runner.block_size
        limit = min(len(r.block_hashes), len(table), (r.num_tokens - 1) // bs)
        n = 0
        while n < limit and self._held.get(table[n]) == r.block_hashes[n]:
            n += 1
        return n * bs

    def _forget(self, r: Request, table: list[int], start: int, lookahead: int) -> None:
        """The blocks this step's draft passes write into (catch-up from `start`, then the
        drafts after the last token) no longer hold what they held."""
        bs = self.runner.block_size
        last = r.num_tokens - 1 + max(lookahead - 1, 0)
        for block in table[start // bs:last // bs + 1]:
            self._held.pop(block, None)

    def _remember(self, r: Request, table: list[int], start: int) -> None:
        """The full blocks of verified tokens the catch-up from `start` wrote."""
        bs = self.runner.block_size
        for j in range(start // bs, min(r.num_tokens // bs, len(r.block_hashes), len(table))):
            self._held[table[j]] = r.block_hashes[j]

    def _argmax(self, chunks: list[SeqChunk], high_watermark: int) -> list[int]:
        logits = self.runner.forward_chunks(chunks, high_watermark)
        return [] if logits is None else logits.argmax(dim=-1).tolist()
