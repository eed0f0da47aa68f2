"""AsyncLLM: concurrent streams from one engine thread, aborts, and a failing step."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from pkv.core.config.engine import EngineConfig
from pkv.core.engine.async_engine import AsyncLLM, EngineStepError
from pkv.core.engine.engine_thread import EngineThread
from pkv.core.engine.llm_engine import LLMEngine
from pkv.core.sample.sampling_params import SamplingParams


@pytest.fixture()
def async_llm(tiny_llama_dir: Path):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory="8MiB"),
                       show_progress=False)
    llm = AsyncLLM(engine)
    llm.start()
    yield llm
    llm.shutdown()


async def _run(llm: AsyncLLM, rid: str, prompt: list[int], max_tokens: int) -> list[int]:
    prepared = await llm.prepare(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                             ignore_eos=True))
    last = None
    async for output in llm.generate(prepared):
        last = output
    return last.outputs[0].token_ids


def test_concurrent_requests_match_sequential(async_llm: AsyncLLM):
    prompts = [[100 + i + j for j in range(5 + 3 * i)] for i in range(6)]

    async def main() -> tuple[list[list[int]], list[list[int]]]:
        together = await asyncio.gather(*(_run(async_llm, f"c{i}", p, 12)
                                          for i, p in enumerate(prompts)))
        alone = [await _run(async_llm, f"s{i}", p, 12) for i, p in enumerate(prompts)]
        return together, alone

    together, alone = asyncio.run(main())
    assert together == alone and all(len(t) == 12 for t in together)


def test_a_reader_that_falls_behind_holds_only_the_newest_output(async_llm: AsyncLLM):
    # A client not reading its stream: every step's output (each a copy of all so far) was
    # queued for it, quadratic in the output's length; the newest holds everything.
    prompt = [100 + j for j in range(6)]

    async def main() -> tuple[list[int], list[object]]:
        alone = await _run(async_llm, "alone", prompt, 40)
        prepared = await async_llm.prepare("slow", prompt, SamplingParams(
            temperature=0, max_tokens=40, ignore_eos=True))
        [stream] = async_llm.submit([prepared])
        while async_llm.engine.has_unfinished_requests() or not stream._stream.latest:
            await asyncio.sleep(0.05)  # the engine runs it to the end, nobody reading
        read = [output async for output in stream.outputs()]
        return alone, read

    alone, read = asyncio.run(main())
    assert len(read) == 1 and read[0].finished  # one output kept, the final one
    assert read[0].outputs[0].token_ids == alone


def test_freed_memory_goes_back_only_after_an_idle_while(async_llm: AsyncLLM,
                                                       monkeypatch: pytest.MonkeyPatch):
    # Requests closer together than the idle time keep the heap's pages (no page faults on
    # the next step); once idle that long, the engine hands them back.
    from pkv.core.engine import async_engine

    idle = 3.0
    monkeypatch.setattr(async_engine, "IDLE_RELEASE_SECONDS", idle)
    released: list[float] = []
    real = async_engine.release_free_memory
    monkeypatch.setattr(async_engine, "release_free_memory",
                        lambda: (released.append(time.monotonic()), real()))

    async def main() -> float:
        await _run(async_llm, "first", [1, 2, 3], 4)
        await asyncio.sleep(0.5)  # well inside the idle time
        await _run(async_llm, "second", [4, 5, 6], 4)
        return time.monotonic()

    second_done = asyncio.run(main())
    deadline = second_done + idle + 5
    while not released and time.monotonic() < deadline:
        time.sleep(0.05)
    assert released, "freed memory never went back"
    assert released[0] >= second_done + idle - 0.2  # none between the two requests


def test_leaving_a_stream_aborts_and_frees(async_llm: AsyncLLM):
    async def main() -> None:
        prepared = await async_llm.prepare("gone", [5, 6, 7], SamplingParams(
            max_tokens=200, ignore_eos=True))
        seen = 0
        async for _ in async_llm.generate(prepared):
            seen += 1
            if seen == 3:
                break
        for _ in range(100):
            if async_llm.engine.get_stats().num_blocks_used == 0:
                break
            await asyncio.sleep(0.05)

    asyncio.run(main())
    stats = async_llm.engine.get_stats()
    assert stats.num_blocks_used == 0 and stats.num_running == 0


def test_failing_step_fails_in_flight_requests_and_serving_goes_on(async_llm: AsyncLLM):
    runner = async_llm.engine.runner
    real = runner.execute_model
    calls = {"n": 0}

    def flaky(*args, **kwargs):  # fault injection: the third step raises
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")
        return real(*args, **kwargs)

    runner.execute_model = flaky

    async def main() -> list[int]:
        with pytest.raises(EngineStepError, match="injected fault"):
            await _run(async_llm, "victim", [1, 2, 3], 10)
        return await _run(async_llm, "after", [1, 2, 3], 4)

    assert len(asyncio.run(main())) == 4
    assert async_llm.is_alive
    assert async_llm.engine.get_stats().num_blocks_used == 0


def test_broken_engine_state_turns_unhealthy_and_refuses(async_llm: AsyncLLM):
    from pkv.core.engine.async_engine import EngineDeadError

    engine = async_llm.engine

    def broken_step():  # fault injection: the step fails and so does cleaning up after it
        raise RuntimeError("device lost")

    def broken_abort(*args, **kwargs):
        raise RuntimeError("state corrupted")

    engine.step = broken_step
    engine.abort_request = broken_abort

    async def main() -> None:
        with pytest.raises(EngineStepError):
            await _run(async_llm, "doomed", [1, 2, 3], 4)
        for _ in range(100):
            if not async_llm.is_alive:
                break
            await asyncio.sleep(0.02)
        with pytest.raises(EngineDeadError, match="state corrupted"):
            async_llm.check_admission()

    asyncio.run(main())
    assert not async_llm.is_alive


def test_the_engine_is_stepped_on_the_thread_that_built_it(tiny_llama_dir: Path):
    # pkv serve builds the engine on its EngineThread (engine_thread.py: OpenMP's pools)
    thread = EngineThread()
    builder = thread.call(threading.get_ident)
    assert builder != threading.get_ident()
    with pytest.raises(ValueError, match="bad"):  # an error in a call is the caller's
        thread.call(lambda: int("bad"))
    engine = thread.call(lambda: LLMEngine(EngineConfig(
        model=str(tiny_llama_dir), kv_cache_memory="8MiB"), show_progress=False))
    llm = AsyncLLM(engine, thread=thread)
    assert not llm.is_alive  # not started yet
    llm.start()
    try:
        stepped = []
        real = engine.step
        engine.step = lambda: (stepped.append(threading.get_ident()), real())[1]
        asyncio.run(_run(llm, "r", [1, 2, 3], 3))
        assert set(stepped) == {builder}
        assert asyncio.run(llm.call_in_engine(lambda _: threading.get_ident())) == builder
    finally:
        llm.shutdown()
    assert not llm.is_alive and thread.call(threading.get_ident) == builder  # outlives its loop
    broken = EngineThread()
    broken.start_loop(lambda: 1 / 0)  # a loop that raises ends; its thread stays
    broken.join_loop(5)
    assert not broken.looping and broken.call(lambda: 7) == 7

