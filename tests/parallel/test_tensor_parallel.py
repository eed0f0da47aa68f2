"""Tensor parallelism over gloo on CPU: the same greedy tokens as one rank, half the weights
per rank, and workers that never outlive their driver."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pkv import LLM, SamplingParams
from pkv.tests.conftest import PROMPTS
from pkv.tests.gguf_writer import write_gguf
from pkv.tests.helpers import build_tiny_model

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _greedy(llm: LLM, prompts: list) -> list[list[int]]:  # noqa: ANN001
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def _gone(pids: list[int], within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.2)
    return False


def test_tp2_equals_tp1_on_the_bundled_model(smol_llm: LLM) -> None:
    tp = LLM(tensor_parallel_size=2, kv_cache_memory="128MiB", max_model_len=512,
             show_progress=False)
    try:
        assert _greedy(tp, PROMPTS) == _greedy(smol_llm, PROMPTS)
        per_rank = tp.llm_engine.runner.rank_weight_bytes
        whole = smol_llm.llm_engine.runner.weight_bytes
        assert len(per_rank) == 2
        assert all(0.4 * whole < b < 0.6 * whole for b in per_rank), (per_rank, whole)
        pids = tp.llm_engine.workers.pids
    finally:
        tp.shutdown()
    assert _gone(pids, 5)


def test_tp2_equals_tp1_on_tiny_qwen2(tiny_qwen2_dir: Path) -> None:
    prompts = [[1, 2, 3, 4], list(range(200, 260)), [7] * 9]
    one = LLM(str(tiny_qwen2_dir), kv_cache_memory="16MiB", max_model_len=256,
              show_progress=False)
    expected = _greedy(one, prompts)
    two = LLM(str(tiny_qwen2_dir), tensor_parallel_size=2, kv_cache_memory="16MiB",
              max_model_len=256, show_progress=False)
    try:
        assert _greedy(two, prompts) == expected
    finally:
        two.shutdown()


def test_tp2_equals_tp1_on_a_q4_k_m_gguf(tmp_path: Path, smol_hf_dir: Path,
                                         smol_gguf: Path) -> None:
    # A Q4_K_M-style file: its Q4_K layers in the 4-bit tiles with Q4_K's own scale codes (d
    # and dmin per 256 inputs), split by output rows (gate / up) and by 256-input super-blocks
    # (o_proj: 512 inputs, 256 a rank); its Q6_K parts in their blocks.
    model_dir = build_tiny_model(tmp_path / "hf", smol_hf_dir, "llama", hidden_size=512,
                                 intermediate_size=1024, head_dim=64, num_attention_heads=8,
                                 num_key_value_heads=4, tie_word_embeddings=False)
    gguf = str(write_gguf(model_dir, tmp_path / "q4km.gguf", "Q4_K_M", smol_gguf))
    prompts = [[1, 2, 3, 4], list(range(200, 260)), [7] * 9]
    runs = {}
    for size in (1, 2):
        llm = LLM(gguf, tensor_parallel_size=size, kv_cache_memory="16MiB", max_model_len=256,
                  show_progress=False)
        try:
            assert "Q4_K as 4-bit tiles" in llm.llm_engine.runner.weight_bytes_by_type
            runs[size] = _greedy(llm, prompts)
        finally:
            llm.shutdown()
    assert runs[2] == runs[1]


def test_splits_that_cannot_work_are_clear_errors(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=3 exceeds the model's 2 KV heads"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=3, show_progress=False)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=0, show_progress=False)


@pytest.mark.parametrize("split", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_a_dead_worker_fails_the_engine_instead_of_hanging(tiny_llama_dir: Path,
                                                           split: str) -> None:
    """A shard or a pipeline stage alike."""
    llm = LLM(str(tiny_llama_dir), **{split: 2}, kv_cache_memory="16MiB", max_model_len=128,
              show_progress=False)
    try:
        [pid] = llm.llm_engine.workers.pids
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="worker rank 1 .* exited with code -9"):
            for _ in range(50):  # the monitor notices within a fraction of a second
                llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
                time.sleep(0.1)
        assert time.monotonic() - start < 10
    finally:
        llm.shutdown()


DRIVER = """
import sys, time
from pkv import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, kv_cache_memory="16MiB", max_model_len=128,
          show_progress=False)
print(*llm.llm_engine.workers.pids, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_workers_die_with_their_driver(tiny_llama_dir: Path, sig: signal.Signals) -> None:
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tiny_llama_dir)],
                              stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert pids and all(psutil.pid_exists(p) for p in pids)
        driver.send_signal(sig)
        driver.wait(timeout=10)
        assert _gone(pids, 5), "a worker outlived its driver"
    finally:
        driver.kill()


def test_an_engine_built_on_a_thread_keeps_its_ranks_and_a_second_is_refused(
        tiny_llama_dir: Path) -> None:
    # (the kernel's PDEATHSIG fired when the building thread ended, killing rank 1)
    import threading

    built: list[LLM] = []
    kw = dict(tensor_parallel_size=2, kv_cache_memory="16MiB", max_model_len=256,
              show_progress=False)
    thread = threading.Thread(target=lambda: built.append(LLM(str(tiny_llama_dir), **kw)))
    thread.start()
    thread.join()
    (tp,) = built
    try:
        time.sleep(1.0)
        assert len(_greedy(tp, [[1, 2, 3, 4]])[0]) == GREEDY.max_tokens
        before = set(psutil.Process().children(recursive=True))
        with pytest.raises(ValueError, match="another multi-rank engine runs in this process"):
            LLM(str(tiny_llama_dir), **kw)
        assert set(psutil.Process().children(recursive=True)) <= before  # none left behind
    finally:
        tp.shutdown()


def test_ctrl_c_mid_step_stops_the_ranks_and_says_so(tiny_llama_dir: Path) -> None:
    # The other ranks may be waiting in a collective the driver left: no later step (nor
    # shutdown's last word) could reach them, so they go with the interrupted step.
    tp = LLM(str(tiny_llama_dir), tensor_parallel_size=2, kv_cache_memory="16MiB",
             max_model_len=256, show_progress=False)
    pids = tp.llm_engine.workers.pids
    runner = tp.llm_engine.runner

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    runner.execute_model = interrupted
    with pytest.raises(KeyboardInterrupt):
        tp.generate([[1, 2, 3, 4]], GREEDY)
    del runner.execute_model
    assert _gone(pids, 10), "a rank outlived the interrupted step"
    with pytest.raises(RuntimeError, match="stopped mid-step \\(KeyboardInterrupt\\)"):
        tp.generate([[1, 2, 3, 4]], GREEDY)
    started = time.monotonic()
    tp.shutdown()
    assert time.monotonic() - started < 5


def test_ranks_on_gpus_agree_on_backends_that_take_both_devices() -> None:
    # Workers read `auto` from the config and chose gloo where the driver chose NCCL; NCCL
    # alone refuses the CPU tensors of the pool-size count.
    from pkv.core.worker.workers import dist_backend

    assert dist_backend("cuda") == "cpu:gloo,cuda:nccl"
    assert dist_backend("cpu") == "gloo"


def test_ranks_pkv_starts_take_their_rank_not_an_inherited_local_rank(monkeypatch) -> None:
    # An outer launcher's LOCAL_RANK=0, inherited by every rank pkv spawns, would put them
    # all on GPU 0; under torchrun its LOCAL_RANK is the rank's own.
    from pkv.core.worker.workers import local_rank

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert [local_rank(r) for r in range(3)] == [0, 1, 2]
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert local_rank(5) == 1
