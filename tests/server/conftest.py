"""A real `pkv serve` process on a free loopback port, started once per module."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from pkv.cli.http import get_metrics
from pkv.cli.serve_process import free_port, stop_process, wait_healthy

API_KEY = "test-key-123"


@dataclass
class RunningServer:
    process: subprocess.Popen
    base_url: str
    api_key: str | None
    log_path: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        return get_metrics(self.base_url, self.headers)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()


def start_server(tmp_dir: str, *args: str, api_key: str | None = API_KEY,
                 timeout: float = 120.0) -> RunningServer:
    port = free_port()
    log_path = os.path.join(tmp_dir, f"server-{port}.log")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PKV_API_KEY", None)
    if api_key:
        env["PKV_API_KEY"] = api_key
    cmd = [sys.executable, "-m", "pkv.cli.main", "serve", "--port", str(port),
           "--max-model-len", "1024", "--kv-cache-memory", "256MiB", "--log-level", "warning",
           *args]
    log = open(log_path, "w")
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = RunningServer(process, f"http://127.0.0.1:{port}", api_key, log_path)
    if wait_healthy(server.base_url, process, timeout):
        return server
    if process.poll() is not None:
        raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()}")
    process.kill()
    raise RuntimeError(f"server did not become healthy:\n{server.log()}")


def stop_server(server: RunningServer) -> None:
    stop_process(server.process)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(str(tmp_path_factory.mktemp("server")), "--max-num-seqs", "64",
                           "--body-timeout", "2")
    yield running
    stop_server(running)


@pytest.fixture(scope="session")
def client(server: RunningServer):  # noqa: ANN201 - openai.OpenAI
    import openai

    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key,
                         max_retries=0, timeout=120)
