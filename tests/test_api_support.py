"""Helpers shared by the API / metrics tests (real `dspark serve` processes): a server whose log
goes to a file (a busy server would fill an unread pipe and stall), Prometheus scraping, polling.
This module holds no tests."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from conftest import free_port
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class LoggedServer:
    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="dspark-serve-", suffix=".log")[1])
        self._log = self.log_path.open("w")
        cmd = [sys.executable, "-m", "dspark_server.cli", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/ready", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server did not become ready:\n{self.log()}")

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        text = self.log_path.read_text(errors="replace")
        self.log_path.unlink(missing_ok=True)
        return text


def start(args: list[str], env: dict[str, str] | None = None) -> LoggedServer:
    server = LoggedServer(args, env)
    try:
        server.wait_ready()
    except BaseException:
        print(server.stop())
        raise
    return server


def scrape(base_url: str, headers: dict[str, str] | None = None) -> Samples:
    text = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10).text
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def family_total(samples: Samples, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll until predicate() holds; returns the seconds it took."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - t0


def wait_idle(base_url: str, timeout: float = 15.0) -> Samples:
    """Wait until the engine holds no request; returns the scrape that showed it."""
    last: Samples = {}

    def idle() -> bool:
        nonlocal last
        last = scrape(base_url)
        return (
            value(last, "dspark_num_requests_admitted") == 0
            and value(last, "dspark_num_requests_running") == 0
            and value(last, "dspark_num_requests_waiting") == 0
        )

    wait_for(idle, timeout, "the engine to become idle")
    return last
