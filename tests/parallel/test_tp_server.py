"""`pkv serve` with tensor parallelism (and a pipeline stage): workers spawned by pkv, and
ranks started by torchrun (rank 0 serves HTTP). A dead rank turns /health to 503; nothing
outlives the server. Adapters, named at start or loaded at runtime, run on every rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from pkv import LLM, LoRARequest, SamplingParams
from pkv.cli.serve_process import wait_healthy
from pkv.tests.helpers import make_lora_adapter
from pkv.tests.parallel.test_tensor_parallel import _gone
from pkv.tests.server.conftest import free_port, start_server, stop_server

PROMPT = [5, 17, 99, 3, 250]


def _expected_text(model: Path) -> str:
    """The greedy completion on one rank, in-process."""
    llm = LLM(str(model), kv_cache_memory="16MiB", max_model_len=256, show_progress=False)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    return out[0].outputs[0].text


def _complete(base_url: str) -> list[int]:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "logprobs": 0}
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _worker_pids(root: int) -> list[int]:
    return [p.pid for p in psutil.Process(root).children(recursive=True)
            if "pkv.core.worker.tp_worker" in " ".join(p.cmdline())]


@pytest.mark.parametrize("split", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_server_answers_and_turns_unhealthy_when_a_rank_dies(
        tmp_path: Path, tiny_llama_dir: Path, split: str) -> None:
    """A tensor-parallel shard or a pipeline stage alike."""
    expected = _expected_text(tiny_llama_dir)
    server = start_server(str(tmp_path), str(tiny_llama_dir), split, "2",
                          "--served-model-name", "m", "--max-model-len", "256",
                          "--kv-cache-memory", "16MiB", api_key=None)
    try:
        assert _complete(server.base_url)["text"] == expected
        [pid] = _worker_pids(server.process.pid)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(f"{server.base_url}/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/health stayed 200 with a dead rank"
            time.sleep(0.2)
        r = httpx.post(f"{server.base_url}/v1/completions",
                       json={"model": "m", "prompt": "hi", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and "worker rank 1" in r.json()["error"]["message"]
    finally:
        stop_server(server)


def test_adapters_served_under_tp_equal_one_rank(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """One adapter from --lora-modules and one loaded at runtime, one slot between them,
    through the openai client: one rank's greedy text for each, and for the base model."""
    make_lora_adapter(tiny_llama_dir, tmp_path / "a", 8, ["q_proj", "v_proj", "down_proj"], 3)
    make_lora_adapter(tiny_llama_dir, tmp_path / "b", 4, ["o_proj", "gate_proj"], 4)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    one = LLM(str(tiny_llama_dir), kv_cache_memory="16MiB", max_model_len=256,
              enable_lora=True, max_lora_rank=8, show_progress=False)
    try:
        expected = {name: one.generate([PROMPT], params, lora_request=LoRARequest(
            name, i + 1, str(tmp_path / name)))[0].outputs[0].text
            for i, name in enumerate("ab")}
        expected["m"] = one.generate([PROMPT], params)[0].outputs[0].text
    finally:
        one.shutdown()
    assert len(set(expected.values())) == 3  # each adapter changes the text
    server = start_server(str(tmp_path), str(tiny_llama_dir), "--tensor-parallel-size", "2",
                          "--served-model-name", "m", "--max-model-len", "256",
                          "--kv-cache-memory", "16MiB", "--enable-lora", "--max-loras", "1",
                          "--max-lora-rank", "8", "--lora-modules", f"a={tmp_path / 'a'}",
                          "--enable-runtime-lora", "--lora-dir", str(tmp_path), api_key=None)
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none",
                               max_retries=0, timeout=60)

        def text(model: str) -> str:
            out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                            temperature=0, extra_body={"ignore_eos": True})
            return out.choices[0].text

        assert text("a") == expected["a"]
        loaded = httpx.post(f"{server.base_url}/v1/load_lora_adapter",
                            json={"lora_name": "b", "lora_path": str(tmp_path / "b")})
        assert loaded.status_code == 200, loaded.text
        assert [text(m) for m in ("b", "m", "a")] == [expected[m] for m in ("b", "m", "a")]
    finally:
        stop_server(server)


def test_torchrun_ranks_serve_together_and_stop_together(tmp_path: Path,
                                                         tiny_llama_dir: Path) -> None:
    port = free_port()
    log = open(tmp_path / "torchrun.log", "w")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "pkv.cli.main",
           "serve", str(tiny_llama_dir), "--tensor-parallel-size", "2", "--port", str(port),
           "--kv-cache-memory", "16MiB", "--max-model-len", "256", "--served-model-name", "m",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_healthy(base, proc, 120), (tmp_path / "torchrun.log").read_text()
        ranks = psutil.Process(proc.pid).children()
        assert len(ranks) == 2
        choice = _complete(base)
        assert len(choice["logprobs"]["tokens"]) == 8
        assert choice["text"] == _expected_text(tiny_llama_dir)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert _gone([r.pid for r in ranks], 10)
    finally:
        proc.kill()
