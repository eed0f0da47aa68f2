"""Engine faults: one request's own failure ends that request only; failing steps, a crashed
loop and a wedged step each fail what is in flight and (the last two at once, steps after
three in a row) turn the engine unhealthy. Faults are injected into a real engine."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from pkv.core.config.engine import EngineConfig
from pkv.core.engine.async_engine import (MAX_CONSECUTIVE_STEP_FAILURES, AsyncLLM, EngineDeadError,
                                          EngineStepError)
from pkv.core.engine.llm_engine import LLMEngine
from pkv.core.sample.sampling_params import SamplingParams

PROMPTS = {"a": [5, 6, 7, 8], "victim": [9, 10, 11], "c": [300, 301, 302, 303, 304]}
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


class _Exploding:
    """Stands in for one request's grammar state or detokenizer: every call raises."""

    def __getattr__(self, name: str):  # noqa: ANN204
        def explode(*args: object, **kwargs: object) -> None:
            raise RuntimeError(f"injected fault in {name}")
        return explode


@pytest.fixture
def engine(tiny_llama_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory="8MiB"),
                     show_progress=False)


def _solo(engine: LLMEngine, prompt: list[int]) -> list[int]:
    engine.add_request("solo", prompt, GREEDY)
    return engine.generate_until_done()[-1].outputs[0].token_ids


def _inject(engine: LLMEngine, where: str) -> None:
    state = engine.output_processor.parents["victim"]
    request = state.samples[0].request
    if where == "grammar":  # its allowed-token mask and its advance both fail
        request.guided = _Exploding()
    else:
        state.samples[0].detokenizer = _Exploding()


@pytest.mark.parametrize("where", ["grammar", "detokenizer"])
def test_one_request_failing_ends_only_that_request(engine: LLMEngine, where: str):
    solo = {rid: _solo(engine, p) for rid, p in PROMPTS.items() if rid != "victim"}
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    engine.step()  # the victim's first step runs clean; then its state breaks
    _inject(engine, where)
    finals = {o.request_id: o for o in engine.generate_until_done() if o.finished}
    assert "injected fault" in (finals["victim"].error or "")
    for rid, tokens in solo.items():
        assert finals[rid].error is None and finals[rid].outputs[0].token_ids == tokens
    stats = engine.get_stats()
    assert stats.num_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
    assert _solo(engine, PROMPTS["a"]) == solo["a"]  # and the engine serves on


def test_a_failed_step_leaves_no_unwritten_block_in_the_prefix_cache(engine: LLMEngine):
    prompt = list(range(10, 50))  # two full blocks, registered when the step is scheduled

    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected fault: out of memory")

    engine.add_request("a", prompt, GREEDY)
    engine.runner.execute_model = out_of_memory
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            engine.step()
    finally:
        del engine.runner.execute_model
    engine.abort_request("a")
    assert engine.kv_cache.pool.num_cached_blocks == 0
    # The same prompt is computed, not read from the blocks the failed step never wrote.
    first = _solo(engine, prompt)
    engine.kv_cache.pool.reset_prefix_cache()
    assert _solo(engine, prompt) == first
    assert engine.get_stats().num_blocks_used == 0


def _async(engine: LLMEngine, **kwargs: float) -> AsyncLLM:
    llm = AsyncLLM(engine, **kwargs)
    llm.start()
    return llm


async def _tokens(llm: AsyncLLM, rid: str, prompt: list[int], max_tokens: int = 10) -> list[int]:
    prepared = await llm.prepare(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                             ignore_eos=True))
    last = None
    async for output in llm.generate(prepared):
        # (the first output seen, whatever its tokens: a loaded machine's stream may bring
        # several steps' at once)
        if rid == "victim" and last is None:
            await llm.call_in_engine(lambda e: _inject(e, "detokenizer"))
        last = output
    return last.outputs[0].token_ids


def test_async_request_failure_reaches_only_its_stream(engine: LLMEngine):
    llm = _async(engine)
    reported: list = []
    llm.on_request_finished = reported.append  # (what /metrics counts)
    try:
        async def main() -> list:
            return await asyncio.gather(_tokens(llm, "a", PROMPTS["a"], 30),
                                        _tokens(llm, "victim", PROMPTS["victim"], 30),
                                        return_exceptions=True)
        ok, failed = asyncio.run(main())
        assert isinstance(failed, EngineStepError) and "injected fault" in str(failed)
        assert isinstance(ok, list) and len(ok) == 30 and llm.is_alive
        # the failure is counted as one, beside the request that finished
        assert sorted(t.finish_reasons[0] for t in reported) == ["error", "length"]
    finally:
        llm.shutdown()


def test_a_request_queued_when_a_step_fails_gets_the_error_and_never_runs(engine: LLMEngine):
    llm = _async(engine)
    submitted = threading.Event()

    def fail_once_submitted(_: LLMEngine) -> None:  # on the engine thread, ahead of the "add"
        submitted.wait(10)
        llm._fail_in_flight(EngineStepError("internal error during generation"))

    try:
        async def main() -> bool:
            prepared = await llm.prepare("late", [1, 2, 3], GREEDY)
            failing = asyncio.ensure_future(llm.call_in_engine(fail_once_submitted))
            await asyncio.sleep(0.1)  # the call is queued first
            [stream] = llm.submit([prepared])
            submitted.set()
            await failing
            with pytest.raises(EngineStepError):
                async for _ in stream.outputs():
                    pass
            return await llm.call_in_engine(lambda e: e.has_unfinished_requests())

        assert asyncio.run(main()) is False  # the "add" read after the failure was dropped
    finally:
        llm.shutdown()


def test_steps_failing_in_a_row_kill_the_engine(engine: LLMEngine):
    def broken_step() -> list:
        raise RuntimeError("device lost")

    engine.step = broken_step
    llm = _async(engine)
    try:
        async def main() -> None:
            for i in range(MAX_CONSECUTIVE_STEP_FAILURES):
                assert llm.is_alive, i
                with pytest.raises(EngineStepError, match="device lost"):
                    await _tokens(llm, f"r{i}", [1, 2, 3])
            for _ in range(100):
                if not llm.is_alive:
                    break
                await asyncio.sleep(0.02)
            with pytest.raises(EngineDeadError, match="failed in a row"):
                llm.check_admission()

        asyncio.run(main())
    finally:
        llm.shutdown()


def test_a_crashed_loop_fails_in_flight_requests(engine: LLMEngine):
    llm = _async(engine)
    real = engine.has_unfinished_requests
    try:
        async def main() -> None:
            prepared = await llm.prepare("r", [1, 2, 3], SamplingParams(max_tokens=500,
                                                                        ignore_eos=True))
            with pytest.raises(EngineDeadError, match="engine loop crashed: injected fault"):
                async for _ in llm.generate(prepared):
                    engine.has_unfinished_requests = _Exploding().loop_broke  # the loop dies
        asyncio.run(main())
        assert not llm.is_alive
    finally:
        engine.has_unfinished_requests = real
        llm.shutdown()


def test_watchdog_declares_a_wedged_step(engine: LLMEngine):
    real = engine.step

    def wedged() -> list:
        time.sleep(4)  # e.g. a deadlocked collective
        return real()

    llm = _async(engine, step_timeout=0.5)
    try:
        async def stats_call() -> None:  # (/admin/cache's way in) queued behind the step
            await asyncio.sleep(0.2)
            with pytest.raises(EngineDeadError, match="wedged"):
                await llm.call_in_engine(lambda e: e.get_stats())

        async def main() -> float:
            prepared = await llm.prepare("r", [1, 2, 3], SamplingParams(max_tokens=50,
                                                                        ignore_eos=True))
            start = time.monotonic()
            engine.step = wedged
            asked = asyncio.create_task(stats_call())
            with pytest.raises(EngineDeadError, match="wedged"):
                async for _ in llm.generate(prepared):
                    pass
            await asked  # answered by the watchdog too, not left waiting forever
            return time.monotonic() - start

        assert asyncio.run(main()) < 3.5  # failed by the watchdog, not by the step's end
        assert not llm.is_alive and "wedged" in (llm.dead_reason or "")
    finally:
        llm.shutdown(timeout=6)
