"""One step's flattened batch: each scheduled sequence's chunk of tokens (SeqChunk) made into
the model's inputs (input ids, positions, attention metadata: slot_mapping, block_tables,
query_start_loc, seq_lens) and the rows whose logits are computed; a pooling request's rows
and token types."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pkv.core.layers.attention_backend import AttentionMetadata
from pkv.core.sample.prompt_logprobs import prompt_rows
from pkv.core.sched.request import Request
from pkv.core.sched.scheduler import SchedulerOutput


@dataclass(slots=True)
class SeqChunk:
    """One sequence's share of a step: `token_ids` at positions `start`.. over its blocks."""

    token_ids: list[int]
    start: int
    block_tables: list[list[int]]  # one per KV group
    total_len: int  # the whole sequence's length, computed or not (LongRoPE picks by it)
    num_logits: int  # how many of its last rows need logits
    num_prompt_logits: int = 0  # how many of its first rows give prompt logprobs


def step_chunks(sched: SchedulerOutput, block_tables: dict[str, list[list[int]]]
                ) -> tuple[list[SeqChunk], list[Request]]:
    """Each scheduled request's tokens this step (its drafts after them), and the requests
    that sample, in order."""
    chunks, sampling = [], []
    for request in sched.scheduled:
        drafts = sched.spec_token_ids.get(request.request_id, [])
        n = sched.num_scheduled_tokens[request.request_id] - len(drafts)
        start = request.num_computed_tokens
        samples = sched.samples(request) and request.pooling is None
        asks = request.pooling is None and request.sampling_params.prompt_logprobs is not None
        chunks.append(SeqChunk(request.all_token_ids[start:start + n] + drafts, start,
                               block_tables[request.request_id],
                               request.num_tokens + len(drafts),
                               len(drafts) + 1 if samples else 0,
                               prompt_rows(start, n, request.num_prompt_tokens) if asks else 0))
        if samples:
            sampling.append(request)
    return chunks, sampling


def flatten_batch(chunks: list[SeqChunk], block_size: int, device: torch.device,
                  layer_groups: list[int] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """One step's flattened batch: input ids, positions, attention metadata and the rows
    whose logits are computed (each chunk's prompt-logprobs rows, then its sampling rows:
    increasing). Single-token chunks that come first count as decodes. With
    several KV groups, each gets its own slots and block tables (`meta.groups`), and
    `layer_groups` says which group each layer reads.

    Built as Python lists and made into two tensors (int64, int32) that every field views:
    the step's weights have just streamed through the caches, so each numpy or torch call
    here runs cold (~4x its warm time), and at batch 1 the twenty-odd calls this took
    before were 3-5% of a 4-bit decode step (0.12-0.23 of ~4.3 ms)."""
    bs = block_size
    num_groups = len(chunks[0].block_tables)
    widths = [max(len(c.block_tables[g]) for c in chunks) for g in range(num_groups)]
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[list[int]] = [[] for _ in range(num_groups)]
    logits_idx: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = [[] for _ in range(num_groups)]
    seq_ids: list[int] = []
    num_decode_tokens = 0
    for i, chunk in enumerate(chunks):
        n = len(chunk.token_ids)
        end = chunk.start + n
        input_ids += chunk.token_ids
        positions += range(chunk.start, end)
        for g, table in enumerate(chunk.block_tables):
            slots[g] += [table[p // bs] * bs + p % bs for p in range(chunk.start, end)]
            tables[g] += table
            tables[g] += [0] * (widths[g] - len(table))
        seq_ids += [i] * n
        query_start_loc.append(query_start_loc[-1] + n)
        seq_lens.append(end)
        if n == 1 and num_decode_tokens == i:
            num_decode_tokens += 1
        logits_idx += range(query_start_loc[-2], query_start_loc[-2] + chunk.num_prompt_logits)
        logits_idx += range(query_start_loc[-1] - chunk.num_logits, query_start_loc[-1])
    num_tokens, num_seqs = len(input_ids), len(chunks)
    kv_lens = [p + 1 for p in positions]
    total_lens = [c.total_len for c in chunks]
    longs = torch.tensor(input_ids + positions + logits_idx + sum(slots, []), dtype=torch.long)
    ints = torch.tensor(query_start_loc + seq_lens + seq_ids + kv_lens + total_lens
                        + sum(tables, []), dtype=torch.int32)
    ids_t, positions_t, logits_t, *slots_t = longs.to(device).split(
        [num_tokens, num_tokens, len(logits_idx)] + [num_tokens] * num_groups)
    qsl_t, seq_lens_t, seq_ids_t, kv_lens_t, total_t, *tables_t = ints.to(device).split(
        [num_seqs + 1, num_seqs, num_tokens, num_tokens, num_seqs]
        + [num_seqs * w for w in widths])
    meta = AttentionMetadata(
        slot_mapping=slots_t[0], query_start_loc=qsl_t, seq_lens=seq_lens_t,
        block_tables=tables_t[0].view(num_seqs, widths[0]), num_decode_tokens=num_decode_tokens,
        seq_ids=seq_ids_t, kv_lens=kv_lens_t, query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens, total_lens=total_t)
    if num_groups > 1:
        meta.groups = tuple(replace(meta, slot_mapping=slots_t[g],
                                    block_tables=tables_t[g].view(num_seqs, widths[g]))
                            for g in range(num_groups))
        meta.layer_groups = tuple(layer_groups or ())
    return ids_t, positions_t, meta, logits_t


def pool_spans(meta: AttentionMetadata,
               pooling: list[tuple[Request, int]]) -> list[tuple[int, int]]:
    """The step's rows (first, count) of each pooling request: its whole prompt, or the
    last chunk of one pooled in chunks (a decoder pooling its last token)."""
    starts = meta.query_start_loc_cpu
    return [(starts[i], starts[i + 1] - starts[i]) for _, i in pooling]


def token_types(requests: list[Request], device: torch.device) -> torch.Tensor | None:
    """The step's token type ids (a cross-encoder's pair segments; 0 elsewhere), or None
    when every one is 0. An encoder's requests run whole, so their types line up with rows."""
    if all(r.token_type_ids is None for r in requests):
        return None
    types: list[int] = []
    for r in requests:
        types += r.token_type_ids or [0] * r.num_tokens
    return torch.tensor(types, dtype=torch.long, device=device)


def split_logits(logits: torch.Tensor, chunks: list[SeqChunk]
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The step's logits (flatten_batch's rows) as the prompt-logprobs rows and the sampling
    rows (None when none samples), each chunk after chunk."""
    prompt: list[int] = []
    sample: list[int] = []
    row = 0
    for chunk in chunks:
        prompt += range(row, row + chunk.num_prompt_logits)
        row += chunk.num_prompt_logits
        sample += range(row, row + chunk.num_logits)
        row += chunk.num_logits
    at = torch.tensor(prompt + sample, device=logits.device)
    rows = logits.index_select(0, at)
    return rows[:len(prompt)], rows[len(prompt):] if sample else None
