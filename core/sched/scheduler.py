"""Scheduler: iteration-level continuous batching under a token budget, with preemption.

Each step: running requests first (a decode token each, or the next prefill chunk), then
waiting requests while the token budget, `max_num_seqs` and free blocks allow. When blocks run
out, the most recently admitted running request is preempted by recompute: its blocks are
freed and it goes back to the front of the queue, to be prefilled again (prompt + outputs).

LongRoPE models (Phi-3) compute a sequence with one of two RoPE tables, by its length; when a
sequence outgrows the short table's range it is recomputed from scratch with the long one,
as transformers does, and its blocks are hashed apart from short-table blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pkv.core.config.speculative import SpeculativeConfig
from pkv.core.lora.slots import LoRASlotTable
from pkv.core.sched.kv_cache_manager import KVCacheManager
from pkv.core.sched.request import Request, RequestStatus, record_failure

# Salt of the blocks of sequences past LongRoPE's threshold (computed with the long table).
LONG_ROPE_SALT = b"\0longrope"


@dataclass(slots=True)
class SchedulerOutput:
    """The requests of one step, decodes (one new token) first, and their token counts.

    A decode may speculate: it has KV slots for up to `spec_lookahead` more tokens, which the
    engine fills with drafts (`set_drafts`) for the model to verify in the same step."""

    scheduled: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    spec_lookahead: dict[str, int] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    lora_loads: list[tuple[int, Any]] = field(default_factory=list)  # (slot, LoRAAdapter)

    def samples(self, request: Request) -> bool:
        """Whether this step reaches the end of the request's tokens (and so samples)."""
        n = self.num_scheduled_tokens[request.request_id]
        drafts = len(self.spec_token_ids.get(request.request_id, ()))
        return request.num_computed_tokens + n == request.num_tokens + drafts

    def set_drafts(self, drafts: dict[str, list[int]]) -> None:
        """Schedule each request's drafts (at most its lookahead) after its token."""
        for request_id, tokens in drafts.items():
            tokens = tokens[:self.spec_lookahead.get(request_id, 0)]
            if tokens:
                self.spec_token_ids[request_id] = tokens
                self.num_scheduled_tokens[request_id] += len(tokens)
        self.order()

    def order(self) -> None:
        """Decodes (one token) first, each group by LoRA slot, so a step's rows with one
        adapter are contiguous runs."""
        self.scheduled.sort(key=lambda r: (self.num_scheduled_tokens[r.request_id] != 1,
                                           r.lora_slot))


class Scheduler:
    """Decides which requests run each step and how many of their tokens."""

    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int,
                 long_rope_threshold: int | None = None,
                 speculative: SpeculativeConfig | None = None,
                 lora_slots: LoRASlotTable | None = None,
                 long_rope_recompute: bool = False) -> None:
        """`long_rope_threshold`: a LongRoPE model's (prompts past it take the long table,
        their blocks salted apart); `long_rope_recompute`: a sequence crossing it while
        decoding is recomputed with the long table (Phi-3's, as transformers does; other
        families go on with their cache)."""
        self.kv_cache = kv_cache
        self.speculative = speculative
        self.lora_slots = lora_slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.long_rope_threshold = long_rope_threshold
        self.long_rope_recompute = long_rope_recompute
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._step_seqs = max_num_seqs  # requests the step being scheduled may take
        self.num_prefill_tokens = 0  # prompt tokens computed (cache hits excluded)

    def add_request(self, request: Request) -> None:
        if self.long_rope_threshold is not None and request.num_tokens > self.long_rope_threshold:
            request.resalt(LONG_ROPE_SALT)
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, in_flight: frozenset[str] | set[str] = frozenset(),
                 max_seqs: int | None = None) -> SchedulerOutput:
        """The next step's requests. `in_flight`: ids of requests in a pipeline micro-batch
        not yet sampled; they are neither scheduled again nor preempted until it is.
        `max_seqs`: at most this many requests this step (a micro-batch's share)."""
        out = SchedulerOutput()
        self._step_seqs = max_seqs or self.max_num_seqs
        budget = self._schedule_running(out, self.max_num_batched_tokens, in_flight)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.order()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int,
                          in_flight: frozenset[str] | set[str]) -> int:
        speculate = (self.speculative is not None
                     and self.speculative.speculates_with(len(self.running)))
        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled) < self._step_seqs:
            request = self.running[i]
            if request.request_id in in_flight:
                i += 1
                continue
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            decoding = request.num_tokens - request.num_computed_tokens == 1
            lookahead = self._lookahead(request, budget - n) if speculate and decoding else 0
            while not self.kv_cache.allocate_slots(request, n + lookahead):
                victim = self._victim(i, in_flight)
                if victim is None:  # only requests in flight could give blocks back
                    return budget
                self.running.remove(victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    return budget
            out.scheduled.append(request)
            out.num_scheduled_tokens[request.request_id] = n
            if lookahead:
                out.spec_lookahead[request.request_id] = lookahead
            budget -= n + lookahead
            i += 1
        return budget

    def _victim(self, first: int, in_flight: frozenset[str] | set[str]) -> Request | None:
        """The most recently admitted running request from index `first` on (those before it
        are scheduled this step) that no micro-batch in flight holds."""
        for request in reversed(self.running[first:]):
            if request.request_id not in in_flight:
                return request
        return None

    def _lookahead(self, request: Request, budget: int) -> int:
        """How many drafts a decoding request may verify this step: the configured number,
        within the token budget, its max_tokens and max_model_len; none under a grammar (its
        mask is known for the next token only)."""
        if request.guided is not None or self.speculative is None:
            return 0
        room = min(self.speculative.num_speculative_tokens, budget,
                   self.max_model_len - request.num_tokens)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return max(0, room)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        # Requests whose adapter waits for a LoRA slot step aside for the ones behind them
        # (the base model's, a resident adapter's), keeping their place in the queue.
        skipped: list[Request] = []
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and len(out.scheduled) < self._step_seqs):
            request = self.waiting[0]
            newly = self._acquire_lora(request, out)
            if newly is None:  # every slot is pinned by running requests of other adapters
                skipped.append(self.waiting.popleft())
                continue
            if request.pooling is not None and not request.pool_in_chunks:
                if request.num_tokens > budget:
                    self._unacquire_lora(request, out, newly)
                    break  # whole, in a later step (it fits a step: the engine checked)
                computed, num_cached = None, 0  # (the pooler reads every row)
            elif request.sampling_params.prompt_logprobs is not None:
                computed, num_cached = None, 0  # every prompt row's logits: no cache hits
            else:  # (a decoder pooling its last token reads only that row)
                computed, num_cached = self.kv_cache.get_computed_blocks(request)
            n = min(request.num_tokens - num_cached, budget)
            if not self.kv_cache.allocate_slots(request, n, computed):
                self._unacquire_lora(request, out, newly)
                break
            self.waiting.popleft()
            if computed is not None:
                self.kv_cache.record_prefix_hit(request, num_cached)
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(request)
            out.num_scheduled_tokens[request.request_id] = n
            budget -= n
        self.waiting.extendleft(reversed(skipped))

    def _acquire_lora(self, request: Request, out: SchedulerOutput) -> bool | None:
        """Pin the request's adapter into a slot: whether its weights load this step, or
        None when no slot is free of other adapters' running requests."""
        if request.lora is None:
            return False
        if self.lora_slots is None:
            raise ValueError("a LoRA request reached a scheduler without LoRA slots")
        got = self.lora_slots.acquire(request.lora.uid)
        if got is None:
            return None
        request.lora_slot, newly = got
        if newly:  # the runner copies its weights in before this step's forward
            out.lora_loads.append((request.lora_slot, request.lora))
        return newly

    def _unacquire_lora(self, request: Request, out: SchedulerOutput, newly: bool) -> None:
        """Undo `_acquire_lora` for a request that does not start this step. A slot taken
        for it (`newly`) is given back with its load: a step that never runs (nothing else
        scheduled) would drop the load and leave the adapter "resident" in a slot holding
        another adapter's weights."""
        self._release_lora(request)
        if newly and request.lora is not None and self.lora_slots is not None:
            out.lora_loads.pop()  # (the last: this request's, appended by _acquire_lora)
            self.lora_slots.unassign(request.lora.uid)

    def _release_lora(self, request: Request) -> None:
        if request.lora is not None and self.lora_slots is not None:
            self.lora_slots.release(request.lora.uid)
        request.lora_slot = -1

    def _preempt(self, request: Request) -> None:
        self._restart(request)
        request.num_preemptions += 1
        self.num_preemptions += 1

    def _restart(self, request: Request) -> None:
        """Free a running request's blocks; it is prefilled again first (prompt + outputs)."""
        self.kv_cache.free(request)
        self._release_lora(request)
        request.num_computed_tokens = 0
        request.num_draft_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]],
                           failures: dict[str, Exception] | None = None) -> list[Request]:
        """Advance the scheduled requests by the step's tokens (one each, or a speculating
        request's accepted drafts and one more); return those that finished. A request whose
        own state fails to advance (its grammar) goes into `failures`."""
        finished = []
        for request in out.scheduled:
            if request.status.finished:
                continue  # aborted while its pipeline micro-batch was in flight
            tokens = sampled.get(request.request_id)
            n = out.num_scheduled_tokens[request.request_id]
            drafts = len(out.spec_token_ids.get(request.request_id, ()))
            if tokens is not None:
                n -= drafts - (len(tokens) - 1)  # rejected drafts: their K/V are recomputed
            done = request.num_computed_tokens
            self.num_prefill_tokens += max(0, min(done + n, request.num_prompt_tokens) - done)
            request.num_computed_tokens += n
            if tokens is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            status = self._append(request, tokens, failures)
            if status is not None:
                self.finish_request(request, status)
                finished.append(request)
            elif self._crossed_long_rope(request, len(tokens)):
                self.running.remove(request)  # recomputed with the long table
                self._restart(request)
                request.resalt(LONG_ROPE_SALT)
        return finished

    def _append(self, request: Request, tokens: list[int],
                failures: dict[str, Exception] | None) -> RequestStatus | None:
        """Append tokens until one stops the request (the rest are dropped). A thinking
        budget may put its own token in place of the sampled one: the tokens after it (drafts
        that followed the sampled one) are dropped, and its K/V is computed next step."""
        for token in tokens:
            forced = request.thinking.forced() if request.thinking is not None else None
            replaced = forced is not None and forced != token
            token = forced if forced is not None else token
            try:
                request.append_output_token(token)
            except Exception as exc:
                record_failure(failures, request.request_id, exc)
                return None
            if request.thinking is not None:
                request.thinking.observe(token)
            status = self._check_stop(request, token)
            if status is not None:
                return status
            if replaced:
                last = request.num_tokens - 1
                request.num_computed_tokens = min(request.num_computed_tokens, last)
                request.num_draft_computed_tokens = min(request.num_draft_computed_tokens, last)
                return None
        return None

    def _crossed_long_rope(self, request: Request, num_new: int) -> bool:
        threshold = self.long_rope_threshold
        if threshold is None or not self.long_rope_recompute:
            return False
        last = request.num_tokens - 1
        return last - num_new < threshold <= last

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        # Under a grammar, an EOS before min_tokens is the grammar's end (the runner lifts
        # min_tokens' ban when nothing else fits): nothing may follow it.
        ended = request.guided is not None or request.num_output_tokens >= params.min_tokens
        if ended and not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.min_tokens and token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """End a request (finished, stopped by a string, or aborted) and free its blocks now."""
        if request.status.finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._release_lora(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.kv_cache.free(request)
        self.requests.pop(request.request_id, None)
