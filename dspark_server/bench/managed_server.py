"""`dspark serve` processes the benchmark starts itself, each on a free loopback port with its log
in a file."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from dspark_server.bench.common import (
    BenchError,
)

log = logging.getLogger(__name__)

SERVER_START_TIMEOUT_S = 300.0  # a dspark-mode server may profile SPS at start-up (<= 25 s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server command on a free loopback port, its log in a file: started by the subclass
    (``_start``), ready when ``ready_path`` answers 200, stopped with SIGTERM (then SIGKILL)."""

    ready_path = "/ready"

    def __init__(self, mode: str, label: str, log_dir: Path) -> None:
        self.mode = mode
        self.label = label  # what error messages call it
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"server-{mode}.log"
        self._log = self.log_path.open("a")

    def _start(self, cmd: list[str]) -> None:
        self._log.write(f"$ {' '.join(cmd)}\n")
        self._log.flush()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def log_tail(self, n: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self, timeout: float = SERVER_START_TIMEOUT_S) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code, tail = self.proc.returncode, self.log_tail()
                raise BenchError(f"{self.label} exited with code {code}; log {self.log_path}:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}{self.ready_path}", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.2)
        raise BenchError(
            f"{self.label} not ready after {timeout:.0f} s; log {self.log_path}:\n{self.log_tail()}"
        )

    def rss_bytes(self) -> int | None:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


class ManagedServer(ServerProcess):
    """`dspark serve --spec-mode MODE ...` on a loopback port, its log in a file."""

    def __init__(self, mode: str, server_args: Sequence[str], log_dir: Path) -> None:
        super().__init__(mode, f"`dspark serve --spec-mode {mode}`", log_dir)
        args = list(server_args)
        if mode == "off":  # the drafter would only be loaded to be ignored
            args = _drop_flag(args, "--draft")
        cmd = [sys.executable, "-m", "dspark_server.cli", "serve", "--host", "127.0.0.1"]
        self._start([*cmd, "--port", str(self.port), "--spec-mode", mode, *args])


def _drop_flag(args: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = True
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return out


def available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
