"""`pkv serve` over two "machines" on one host: two torchrun node agents on loopback, one
pipeline stage each (rank 0 serves HTTP). The answer equals one rank's; SIGKILL of the driver
leaves no process behind. A pipeline that pkv spawns drains on SIGTERM and its stage goes with
it (a dead stage: tests/parallel/test_tp_server.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil

from pkv.cli.serve_process import wait_healthy
from pkv.tests.parallel.test_tensor_parallel import _gone
from pkv.tests.parallel.test_tp_server import _complete, _expected_text, _worker_pids
from pkv.tests.server.conftest import free_port, start_server, stop_server


def _node(rank: int, master_port: int, http_port: int, model: Path, log: Path
          ) -> subprocess.Popen:
    """One "machine": a torchrun agent for node `rank` of two, one process each."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
           "--nproc-per-node", "1", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
           "--master-port", str(master_port), "-m", "pkv.cli.main", "serve", str(model),
           "--pipeline-parallel-size", "2", "--port", str(http_port),
           "--kv-cache-memory", "16MiB", "--max-model-len", "256", "--served-model-name", "m",
           "--log-level", "warning"]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_two_nodes_serve_a_request_and_die_with_the_driver(tmp_path: Path,
                                                           tiny_llama_dir: Path) -> None:
    master, port = free_port(), free_port()
    nodes = [_node(rank, master, port, tiny_llama_dir, tmp_path / f"node{rank}.log")
             for rank in (0, 1)]
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_healthy(base, nodes[0], 120), (tmp_path / "node0.log").read_text()
        ranks = [child for node in nodes for child in psutil.Process(node.pid).children()]
        assert len(ranks) == 2
        assert _complete(base)["text"] == _expected_text(tiny_llama_dir)
        driver = psutil.Process(nodes[0].pid).children()[0]
        driver.kill()  # SIGKILL: no shutdown of its own; the rest must notice and go
        every = [n.pid for n in nodes] + [r.pid for r in ranks]
        assert _gone(every, 60), [(tmp_path / f"node{r}.log").read_text() for r in (0, 1)]
    finally:  # the agents' ranks too: a failed start must leave no server behind
        for node in nodes:
            try:
                ranks = psutil.Process(node.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                ranks = []
            for rank in ranks:
                with contextlib.suppress(psutil.NoSuchProcess):
                    rank.kill()
            node.kill()


def test_sigterm_drains_a_pipeline_and_its_stage_goes_with_it(tmp_path: Path,
                                                              tiny_llama_dir: Path) -> None:
    server = start_server(str(tmp_path), str(tiny_llama_dir), "--pipeline-parallel-size", "2",
                          "--served-model-name", "m", "--max-model-len", "256",
                          "--kv-cache-memory", "16MiB", "--shutdown-timeout", "30",
                          api_key=None)
    try:
        [stage] = _worker_pids(server.process.pid)
        body = {"model": "m", "prompt": [5, 17, 99], "max_tokens": 64, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                          timeout=60) as running:
            lines = running.iter_lines()
            next(lines)
            server.process.send_signal(signal.SIGTERM)
            rest = list(lines)
        finish = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in rest
                  if x.startswith("data: {")][-1]
        assert finish == "length"  # the request in flight ran to its end
        assert server.process.wait(40) == 0
        assert _gone([stage], 10)
    finally:
        stop_server(server)
