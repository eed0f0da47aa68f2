"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time.

    add_request -> InputProcessor (tokenize, validate) -> Scheduler.schedule
                -> ModelRunner.execute_model -> Scheduler.update_from_output
                -> OutputProcessor (detokenize, stop strings) -> RequestOutput
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import asdict

import torch

from pkv.core.config.engine import EngineConfig
from pkv.core.engine.disk_tier import finish_kv_work, open_offload_store, step_kv_work
from pkv.core.engine.input_processor import InputLimits, InputProcessor, PreparedRequest
from pkv.core.engine.micro_batches import MicroBatches
from pkv.core.engine.output_processor import OutputProcessor
from pkv.core.engine.outputs import EngineStats, PoolingRequestOutput, RequestOutput
from pkv.core.lora.adapter import LoRAAdapter, LoRARequest
from pkv.core.lora.manager import LoRAManager
from pkv.core.lora.slots import LoRASlotTable
from pkv.core.pooling.params import PoolingParams
from pkv.core.registry import select_guided_backend
from pkv.core.sample.rejection_sampler import VerifyOutput
from pkv.core.sample.sampling_params import SamplingParams
from pkv.core.sched.kv_cache_coordinator import KVCacheCoordinator
from pkv.core.sched.request import Request, RequestStatus, record_failure
from pkv.core.sched.scheduler import Scheduler, SchedulerOutput
from pkv.core.spec_decode.proposer import Proposer, SpecDecodeStats, build_proposer
from pkv.core.worker.model_setup import ModelSetup, parallel_groups
from pkv.core.worker.pipeline_runner import PipelineModelRunner, runner_class
from pkv.core.worker.step_timer import StepTimer
from pkv.core.worker.workers import WorkerGroup

logger = logging.getLogger("pkv.engine")


class LLMEngine:
    """The synchronous engine core that the offline LLM and the server drive."""

    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        self.config = config
        setup = ModelSetup.prepare(config)
        source = setup.source
        self.model_name = source.name
        self.model_config = source.config
        self.task = setup.task  # generate, embed or classify
        self.tokenizer = source.tokenizer
        self.max_model_len = setup.max_model_len
        # What a request that leaves them unset samples with (generation_config auto).
        self.sampling_defaults = (dict(source.sampling_defaults)
                                  if config.generation_config == "auto" else {})
        if self.sampling_defaults:
            logger.info("sampling defaults from the model's generation_config.json: %s",
                        self.sampling_defaults)
        logger.info("attention backend: %s", setup.backend.name)
        self.attention_backend = setup.backend.name
        self.quantization = setup.loader.name if setup.loader else None
        # Fail on a bad guided backend before the weights load.
        guided_cls = select_guided_backend(config.guided_decoding_backend, setup.registry)
        spec = config.speculative
        # A draft model loads (and fails) before the target; its KV shares the pool budget.
        self.proposer: Proposer | None = (
            build_proposer(config, spec, setup.max_model_len, source.config.vocab_size,
                           show_progress) if spec else None)
        self.spec_stats = SpecDecodeStats(spec.num_speculative_tokens if spec else 0)
        self.workers: WorkerGroup | None = None
        if config.world_size > 1:
            self.workers = WorkerGroup.start(asdict(config), setup.device.type)
            weakref.finalize(self, self.workers.shutdown)  # also when the LLM is dropped
        try:
            tp, stage = parallel_groups(config, source.config, 0)
            self.runner = runner_class(stage)(
                config, setup, show_progress, tp, stage=stage,
                extra_block_bytes=self.proposer.kv_bytes_per_block if self.proposer else 0)
        except BaseException:
            self.shutdown()
            raise
        self.max_num_batched_tokens = config.token_budget(self.max_model_len,
                                                          encoder=not self.runner.keeps_kv)
        # The driver's micro-batches in flight, under pipeline parallelism.
        self.micro_batches: MicroBatches | None = None
        if isinstance(self.runner, PipelineModelRunner):
            self.micro_batches = MicroBatches(self.runner, config.pipeline_parallel_size)
            if self.workers is not None:
                self.workers.stop_stages = self.runner.stop_stages
        if self.proposer is not None:
            self.proposer.allocate_kv(self.runner.num_blocks)
        self.guided = guided_cls(self.tokenizer, source.config.vocab_size,
                                 config.structured_outputs_timeout)
        self.kv_offload = (open_offload_store(config, setup, self.runner,
                                              self.max_num_batched_tokens)
                           if config.kv_offload_dir else None)
        # A draft model catches up from up to k + 1 tokens behind the target: its queries
        # see that much further back, so a windowed group keeps that much more.
        lag = (spec.num_speculative_tokens + 1
               if self.proposer is not None and self.proposer.kv_bytes_per_block else 0)
        windows = [None if w is None else w + lag for w in self.runner.kv_groups.windows]
        self.kv_cache = KVCacheCoordinator(self.runner.num_blocks, config.block_size,
                                           config.enable_prefix_caching, windows,
                                           self.kv_offload)
        self.lora = (LoRAManager(self.runner.lora_targets, config.max_lora_rank)
                     if config.enable_lora else None)
        self.scheduler = Scheduler(self.kv_cache, config.max_num_seqs,
                                   self.max_num_batched_tokens, self.max_model_len,
                                   source.config.rope_spec().long_threshold, spec,
                                   LoRASlotTable(config.max_loras) if self.lora else None,
                                   long_rope_recompute=getattr(
                                       self.runner.model, "recomputes_past_long_rope", False))
        self.output_processor = OutputProcessor(self.tokenizer)
        self.num_steps = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        pooler = self.runner.pooler
        limits = InputLimits(source.config.vocab_size, self.max_model_len,
                             self.max_num_batched_tokens, config.block_size,
                             pool_in_chunks=(self.runner.keeps_kv and pooler is not None
                                             and pooler.reads_last_row_only))
        self.processor = InputProcessor(self.tokenizer, limits, self.task, self.runner.pooler,
                                        self.guided, self.lora, self.runner.device)

    @property
    def timer(self) -> StepTimer:
        """The runner's step timer; enable it to profile steps (`pkv bench --profile`)."""
        return self.runner.timer

    def shutdown(self, force: bool = False) -> None:
        """Stop worker ranks (a no-op on one rank); the engine is unusable after. `force`
        kills them without a last word (when a step may still be running)."""
        batches = getattr(self, "micro_batches", None)
        offload = getattr(self, "kv_offload", None)
        if batches is not None and not force:
            for kv in batches.drain():
                finish_kv_work(offload, kv)
        # With `force` a step may be running: the pool is not settled. A dead rank cannot
        # give its parts of the blocks.
        if offload is not None and not force and (self.workers is None or not self.workers.error):
            self.kv_cache.save_cached_blocks()  # for a restart to find them
            offload.complete()  # (the other ranks' parts, while they still run)
        if self.workers is not None:
            self.workers.shutdown(force)
        if offload is not None:
            offload.close()  # writes still staged reach the disk

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt: str | list[int] | tuple[str, str],
                    params: SamplingParams | PoolingParams | None = None,
                    cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None, *,
                    cap_max_tokens: bool = False) -> str:
        """Validate and queue a request (see `prepare_request`); returns its id. Raises
        ValueError on bad input."""
        return self.add_prepared(self.prepare_request(request_id, prompt, params, cache_salt,
                                                      lora_request,
                                                      cap_max_tokens=cap_max_tokens))

    def prepare_request(self, request_id: str | None, prompt: str | list[int] | tuple[str, str],
                        params: SamplingParams | PoolingParams | None = None,
                        cache_salt: str | None = None,
                        lora_request: LoRARequest | None = None, *,
                        cap_max_tokens: bool = False) -> PreparedRequest:
        """Tokenize and validate without touching engine state (safe from another thread;
        see InputProcessor.prepare)."""
        if (isinstance(params, SamplingParams) and params.prompt_logprobs is not None
                and self.config.pipeline_parallel_size > 1):
            raise ValueError("prompt_logprobs is not served under pipeline parallelism")
        return self.processor.prepare(request_id, prompt, params, cache_salt, lora_request,
                                      cap_max_tokens=cap_max_tokens)

    def add_lora(self, name: str, path: str) -> LoRAAdapter:
        """Load an adapter under `name` (requests then name it)."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled on this engine")
        return self.lora.load(name, path)

    def remove_lora(self, name: str) -> None:
        """Forget an adapter by name; requests already queued with it finish with it, and
        its slot ages out (LRU) once they have."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled on this engine")
        self.lora.unload(name)

    def add_prepared(self, prepared: PreparedRequest) -> str:
        """Queue a prepared request (on the thread that steps the engine)."""
        if prepared.request_id in self.output_processor.parents:
            raise ValueError(f"request id {prepared.request_id!r} is already in use")
        self.output_processor.add_request(prepared.request_id, prepared.prompt,
                                          prepared.children)
        for child in prepared.children:
            self.scheduler.add_request(child)
        self.num_prompt_tokens += len(prepared.children[0].prompt_token_ids) * len(
            prepared.children)
        return prepared.request_id

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Stop requests now and free their blocks; returns their final outputs."""
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        outputs = []
        for request_id in ids:
            for child in self.output_processor.children(request_id):
                if child.request_id in self.scheduler.requests:
                    self.scheduler.finish_request(child, RequestStatus.FINISHED_ABORTED)
            output = self.output_processor.abort(request_id)
            if output is not None:
                outputs.append(output)
        return outputs

    def _fail_requests(self, failures: dict[str, Exception],
                       outputs: list[RequestOutput]) -> list[RequestOutput]:
        """End the requests (all samples of each) that failed in this step, freeing their
        blocks; their final outputs carry the error."""
        failed: dict[str, Exception] = {}
        for child_id, exc in failures.items():
            parent = self.output_processor.child_to_parent.get(child_id)
            if parent is not None:
                failed.setdefault(parent[0], exc)
        kept = [o for o in outputs if o.request_id not in failed]
        for parent_id, exc in failed.items():
            logger.error("request %s failed: %r", parent_id, exc)
            for output in self.abort_request(parent_id):
                output.error = f"{type(exc).__name__}: {exc}"
                kept.append(output)
        return kept

    def _fail_unplaceable(self) -> list[RequestOutput]:
        """Fail the first waiting request if an idle engine cannot place it (its blocks
        exceed what the pool can free): waiting would spin forever."""
        s = self.scheduler
        if s.running or not s.waiting:
            return []
        pool = self.kv_cache.pool
        exc = RuntimeError(f"the request does not fit in the KV cache: {pool.num_free_blocks} "
                           f"of {pool.num_blocks} blocks can be freed")
        return self._fail_requests({s.waiting[0].request_id: exc}, [])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Run one iteration: schedule, forward, sample, detokenize. Returns updated outputs."""
        try:
            if self.micro_batches is not None:
                outputs = self._pipelined_step(self.micro_batches)
            else:
                outputs = self._step()
        except BaseException as exc:
            # Scheduling registered the step's full blocks in the prefix cache before their
            # K/V were written (or read from disk into the pool); a later request must not
            # find them (callers may serve on).
            for request in list(self.scheduler.requests.values()):
                self.kv_cache.forget_unwritten(request)
            self.kv_cache.forget_loads()
            if self.workers is not None and not isinstance(exc, Exception):
                self._stop_interrupted_ranks(exc)
            raise
        self.kv_cache.loads_landed()
        return outputs

    def _stop_interrupted_ranks(self, exc: BaseException) -> None:
        """Ctrl-C mid-step: the other ranks may wait in a collective the driver left, and
        no message brings them back in step (a later step, or shutdown's last word, would
        wait forever): they are stopped, and the engine with them."""
        workers = self.workers
        if workers is None:
            return
        workers.error = workers.error or (f"the engine was stopped mid-step "
                                          f"({type(exc).__name__}); its ranks went with it: "
                                          "start a new one")
        workers.shutdown(force=True)

    def _step(self) -> list[RequestOutput | PoolingRequestOutput]:
        if self.workers is not None:
            self.workers.check()  # a dead rank would make the step wait forever
        self.timer.start()
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return [] if sched.preempted else self._fail_unplaceable()
        self.timer.lap("schedule")
        kv = step_kv_work(self.kv_offload, self.kv_cache, self.runner)
        for slot, adapter in sched.lora_loads:
            self.runner.load_lora(slot, adapter.weights)
        tables = {r.request_id: self.kv_cache.block_ids(r.request_id) for r in sched.scheduled}
        # What fails for one request alone (its grammar, its text) ends that request only.
        failures: dict[str, Exception] = {}
        if sched.spec_lookahead:
            self._propose(sched, tables, failures)
            self.timer.lap("propose")
        try:
            sampled_reqs, result, pooled = self.runner.execute_model(
                sched, tables, self.kv_cache.pool.high_watermark, failures, kv)
        except RuntimeError as exc:
            if self.workers is None:
                raise
            raise RuntimeError(self.workers.explain(exc)) from exc
        finish_kv_work(self.kv_offload, kv)
        return self._complete(sched, sampled_reqs, result, pooled, failures)

    def _pipelined_step(self, batches: MicroBatches
                        ) -> list[RequestOutput | PoolingRequestOutput]:
        """A step under pipeline parallelism: launch a micro-batch of requests that no batch
        in flight holds; once P are in flight (or nothing more can start), finish the oldest.
        While stage k runs one micro-batch, stage k + 1 runs the one before it."""
        workers = self.workers
        if workers is None:
            raise RuntimeError("a pipelined step needs the pipeline's worker ranks")
        workers.check()
        self.timer.start()
        live = min(len(self.scheduler.running) + len(self.scheduler.waiting),
                   self.config.max_num_seqs)
        sched = self.scheduler.schedule(batches.request_ids, batches.share(live))
        self.timer.lap("schedule")
        try:
            if sched.scheduled:
                self._launch(sched, batches)
                if not batches.full:
                    return []
            elif not batches:
                return [] if sched.preempted else self._fail_unplaceable()
            done = batches.complete_oldest()
        except RuntimeError as exc:
            batches.clear()
            raise RuntimeError(workers.explain(exc)) from exc
        finish_kv_work(self.kv_offload, done.kv)
        return self._complete(done.sched, done.sampled, done.result, done.pooled, done.failures)

    def _launch(self, sched: SchedulerOutput, batches: MicroBatches) -> None:
        """Start a micro-batch down the pipeline, its drafts proposed first."""
        tables = {r.request_id: self.kv_cache.block_ids(r.request_id) for r in sched.scheduled}
        failures: dict[str, Exception] = {}
        if sched.spec_lookahead:
            self._propose(sched, tables, failures)
            self.timer.lap("propose")
        batches.launch(sched, tables, self.kv_cache.pool.high_watermark, failures,
                       step_kv_work(self.kv_offload, self.kv_cache, self.runner))

    def _complete(self, sched: SchedulerOutput, sampled_reqs: list[Request],
                  result: VerifyOutput, pooled: dict[str, torch.Tensor],
                  failures: dict[str, Exception]) -> list[RequestOutput | PoolingRequestOutput]:
        """Advance the step's requests by what it sampled (or pooled) and build outputs."""
        sampled = {r.request_id: t for r, t in zip(sampled_reqs, result.token_ids)}
        logprobs = {r.request_id: lp for r, lp in zip(sampled_reqs, result.logprobs)}
        before = sum(r.num_output_tokens for r in sampled_reqs)
        if result.prompt_logprobs:  # (before the requests' computed tokens move on)
            self.output_processor.add_prompt_logprobs(result.prompt_logprobs)
        self.scheduler.update_from_output(sched, sampled, failures)
        self.num_generation_tokens += sum(r.num_output_tokens for r in sampled_reqs) - before
        for tokens, num_drafts in zip(result.token_ids, result.num_drafts):
            self.spec_stats.record(num_drafts, len(tokens) - 1)
        outputs, stopped = self.output_processor.process(sampled_reqs, logprobs, failures)
        for request in stopped:  # stop strings end a request in the same step
            if request.request_id not in failures:
                self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
        if pooled:
            outputs += self._finish_pooled(sched, pooled)
        if failures:
            outputs = self._fail_requests(failures, outputs)
        self.num_steps += 1
        self.timer.end_step()
        return outputs

    def _finish_pooled(self, sched: SchedulerOutput, pooled: dict[str, torch.Tensor]
                       ) -> list[PoolingRequestOutput]:
        """End the pooling requests of the step (their whole prompt ran): free their blocks
        and return their vectors."""
        outputs = []
        for request in sched.scheduled:
            vector = pooled.get(request.request_id)
            if vector is not None:
                self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
                # (a copy made outside inference mode: callers may compute with it freely)
                outputs.append(self.output_processor.finish_pooled(request, vector.clone()))
        return outputs

    def _propose(self, sched: SchedulerOutput, tables: dict[str, list[list[int]]],
                 failures: dict[str, Exception]) -> None:
        """Fill the speculating requests' lookahead with drafts. A proposer that fails (a
        draft model's step) fails those requests only; the step goes on without drafts."""
        requests = [r for r in sched.scheduled if r.request_id in sched.spec_lookahead]
        if self.proposer is None:  # lookahead is only given with a speculative config
            return
        try:
            held = {r.request_id: self.kv_cache.held_from(r.request_id) for r in requests}
            drafts = self.proposer.propose(requests, sched.spec_lookahead, tables,
                                           self.kv_cache.pool.high_watermark, held)
        except Exception as exc:
            for request in requests:
                record_failure(failures, request.request_id, exc)
            return
        sched.set_drafts(drafts)

    def get_stats(self) -> EngineStats:
        pool = self.kv_cache.pool
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_blocks_total=pool.num_blocks, num_blocks_used=pool.num_used_blocks,
            num_blocks_free=pool.num_free_blocks, num_cached_blocks=pool.num_cached_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv_cache.prefix_queries,
            prefix_cache_hits=self.kv_cache.prefix_hits, kv_cache_usage=self.kv_cache.usage,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            kv_resident_bytes=self.runner.kv_resident_bytes,
            kv_offload=self.kv_offload.stats if self.kv_offload is not None else None)

    def generate_until_done(self) -> list[RequestOutput]:
        """Step until every request finishes; return the final output of each."""
        finals = []
        while self.has_unfinished_requests():
            finals.extend(o for o in self.step() if o.finished)
        return finals

    @property
    def kv_bytes_per_block(self) -> int:
        """A pool block's bytes: the model's K/V of its tokens and a draft model's."""
        draft = self.proposer.kv_bytes_per_block if self.proposer else 0
        return self.runner.kv_bytes_per_block + draft

    @property
    def kv_cache_bytes(self) -> int:
        return self.runner.num_blocks * self.kv_bytes_per_block
