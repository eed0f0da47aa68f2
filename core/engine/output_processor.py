"""OutputProcessor: detokenizes new tokens, applies stop strings, builds RequestOutputs.

A request with `n > 1` runs as n engine Requests (one per sample); their outputs are gathered
back into one RequestOutput here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pkv.core.engine.outputs import (CompletionOutput, Logprob, PoolingOutput,
                                     PoolingRequestOutput, RequestOutput)
from pkv.core.sample.prompt_logprobs import LogprobEntry
from pkv.core.sample.sampling_params import SamplingParams
from pkv.core.sched.request import Request, RequestStatus, record_failure
from pkv.core.tokenizer.detokenizer import IncrementalDetokenizer
from pkv.core.tokenizer.tokenizer import Tokenizer


@dataclass
class _Sample:
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    text: str = ""
    num_seen_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Stop strings count where they end past this much text: that of the first min_tokens
    # tokens (vLLM's rule: none ends the output before it has min_tokens tokens), then all
    # the text already searched (the text only grows: each token's search is its tail's).
    stop_from: int = 0


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    """Keeps the text side of every live request."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _ParentState] = {}
        self.child_to_parent: dict[str, tuple[str, int]] = {}

    def add_request(self, request_id: str, prompt: str | None, children: list[Request]) -> None:
        params = children[0].sampling_params
        state = _ParentState(request_id, prompt, children[0].prompt_token_ids, params,
                             prompt_logprobs=None if params.prompt_logprobs is None else [None])
        for i, child in enumerate(children):
            detok = IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids,
                                           params.skip_special_tokens)
            state.samples.append(_Sample(child, detok, [] if params.logprobs is not None else None))
            self.child_to_parent[child.request_id] = (request_id, i)
        self.parents[request_id] = state

    def children(self, request_id: str) -> list[Request]:
        state = self.parents.get(request_id)
        return [s.request for s in state.samples] if state else []

    def add_prompt_logprobs(self, entries: dict[str, list[LogprobEntry]]) -> None:
        """A step's prompt-logprobs entries, by engine request: the first sample's, for the
        prompt tokens not yet recorded (a preempted request computes its prompt again)."""
        for request_id, found in entries.items():
            parent_id, index = self.child_to_parent.get(request_id, ("", -1))
            state = self.parents.get(parent_id)
            if index != 0 or state is None or state.prompt_logprobs is None:
                continue
            request = state.samples[0].request
            first = request.num_computed_tokens + 1  # the prompt token its first row predicts
            for token, entry in zip(state.prompt_token_ids[first:], found):
                if first == len(state.prompt_logprobs):
                    state.prompt_logprobs.append(self._logprob_dict(token, entry))
                first += 1

    def process(self, updated: list[Request],
                logprobs: dict[str, list[tuple[list[int], list[float], float, int]] | None],
                failures: dict[str, Exception] | None = None
                ) -> tuple[list[RequestOutput], list[Request]]:
        """Take the step's updated requests; return outputs and requests a stop string ended.
        A request whose text fails to advance goes into `failures` (and gets no output)."""
        touched: dict[str, _ParentState] = {}
        stopped: list[Request] = []
        for request in updated:
            parent_id, index = self.child_to_parent[request.request_id]
            state = self.parents[parent_id]
            sample = state.samples[index]
            try:
                if self._advance(sample, state.params, logprobs.get(request.request_id)):
                    stopped.append(request)
            except Exception as exc:
                record_failure(failures, request.request_id, exc)
                continue
            touched[parent_id] = state
        outputs = [self._make_output(state) for state in touched.values()]
        for state in touched.values():
            if state.finished:
                self._forget(state)
        return outputs, stopped

    def _advance(self, sample: _Sample, params: SamplingParams,
                 logprobs: list[tuple[list[int], list[float], float, int]] | None) -> bool:
        """Detokenize the sample's new tokens (several where drafts were accepted); True if
        a stop string ended it: tokens after the one that completed it are dropped."""
        request = sample.request
        new_tokens = request.output_token_ids[sample.num_seen_tokens:]
        # The stop token (a stop_token_ids entry, the end of sequence) that ended the request
        # keeps its id but not its text, as vLLM's.
        stop_token = (len(new_tokens) - 1 if request.status == RequestStatus.FINISHED_STOPPED
                      and not params.include_stop_str_in_output else -1)
        stopped_by_string = False
        for i, token in enumerate(new_tokens):
            if sample.finish_reason is not None:
                break
            sample.num_seen_tokens += 1
            if logprobs is not None and sample.logprobs is not None and i < len(logprobs):
                sample.logprobs.append(self._logprob_dict(token, logprobs[i]))
            if i == stop_token:
                break
            sample.detokenizer.add_token(token)
            if sample.num_seen_tokens <= params.min_tokens:
                sample.stop_from = len(sample.detokenizer.output_text)
                continue
            stop = self._find_stop(sample.detokenizer.output_text, params, sample.stop_from)
            sample.stop_from = len(sample.detokenizer.output_text)
            if stop is not None:
                end = stop[0] + (len(stop[1]) if params.include_stop_str_in_output else 0)
                sample.text = sample.detokenizer.output_text[:end]
                sample.finish_reason, sample.stop_reason = "stop", stop[1]
                stopped_by_string = True
        if sample.finish_reason is None:
            sample.text = self._visible_text(sample.detokenizer.output_text, params)
            if request.status.finished:
                sample.text = sample.detokenizer.output_text
                sample.finish_reason = request.finish_reason
                sample.stop_reason = request.stop_reason
        return stopped_by_string

    @staticmethod
    def _find_stop(text: str, params: SamplingParams, start: int) -> tuple[int, str] | None:
        """The first stop string in `text` that ends past `start`, and where it begins."""
        hits = [(text.find(s, max(0, start - len(s) + 1)), s) for s in params.stop_strings]
        hits = [hit for hit in hits if hit[0] >= 0]
        return min(hits) if hits else None

    @staticmethod
    def _visible_text(text: str, params: SamplingParams) -> str:
        # Hold back a tail that could still grow into a stop string, so streamed text is final
        # (none where the stop string stays in the text).
        hold = 0 if params.include_stop_str_in_output else \
            max((len(s) - 1 for s in params.stop_strings), default=0)
        return text[:max(0, len(text) - hold)]

    def _logprob_dict(self, token: int, lp: tuple[list[int], list[float], float, int]
                      ) -> dict[int, Logprob]:
        top_ids, top_vals, chosen, rank = lp

        def decode(t: int) -> str:
            return self.tokenizer.decode([t], skip_special_tokens=False)

        out = {token: Logprob(chosen, rank, decode(token))}
        for r, (tid, val) in enumerate(zip(top_ids, top_vals), start=1):
            out.setdefault(tid, Logprob(val, r, decode(tid)))
        return out

    def _make_output(self, state: _ParentState) -> RequestOutput:
        outputs = [CompletionOutput(i, s.text, list(s.request.output_token_ids[:s.num_seen_tokens]),
                                    s.finish_reason, list(s.logprobs) if s.logprobs is not None
                                    else None, s.stop_reason)
                   for i, s in enumerate(state.samples)]
        cached = max(0, min(s.request.num_cached_tokens for s in state.samples))
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outputs,
                             state.finished, num_cached_tokens=cached,
                             prompt_logprobs=None if state.prompt_logprobs is None
                             else list(state.prompt_logprobs))

    def finish_pooled(self, request: Request, data: torch.Tensor) -> PoolingRequestOutput:
        """The final output of a pooling request, which its vector ends."""
        parent_id, _ = self.child_to_parent[request.request_id]
        state = self.parents[parent_id]
        self._forget(state)
        return PoolingRequestOutput(parent_id, state.prompt, state.prompt_token_ids,
                                    PoolingOutput(data),
                                    num_cached_tokens=max(0, request.num_cached_tokens))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Mark every unfinished sample aborted; return the final output."""
        state = self.parents.get(request_id)
        if state is None:
            return None
        for sample in state.samples:
            if sample.finish_reason is None:
                sample.finish_reason = "abort"
        output = self._make_output(state)
        self._forget(state)
        return output

    def _forget(self, state: _ParentState) -> None:
        self.parents.pop(state.request_id, None)
        for sample in state.samples:
            self.child_to_parent.pop(sample.request.request_id, None)
