"""A `pkv serve` child process on a free loopback port, for benchmarks that need a server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


class ServerStartError(ValueError):
    """The server exited or never became healthy (usually options it refused); a user
    error, reported in one line with the server's own last words."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, process: subprocess.Popen, timeout: float) -> bool:
    """Poll `base`/health until it answers 200 (True), or the process exits or `timeout`
    seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    return False


def stop_process(process: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM (a server drains and exits 0), then SIGKILL if it has not exited in time."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def start_pkv_serve(args: list[str], api_key: str, timeout: float = 300,
                    env: dict[str, str] | None = None) -> Iterator[tuple[str, int]]:
    """Yield (base URL, pid) of a healthy server; stop it on exit. Its log goes to a temp
    file, quoted in the error if it never becomes healthy. `env` adds to its environment."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="pkv-serve-", suffix=".log", delete=False)
    env = {**os.environ, **(env or {}), "PKV_API_KEY": api_key, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([sys.executable, "-m", "pkv.cli.main", "serve", "--port", str(port),
                                "--log-level", "warning", *args],
                               stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        if not wait_healthy(base, process, timeout):
            log.seek(0)
            last = log.read().strip().splitlines()[-1:] or ["no output"]
            raise ServerStartError(f"pkv serve did not become healthy: {last[0]}")
        yield base, process.pid
    finally:
        stop_process(process)
        log.close()
        os.unlink(log.name)
