from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dspark_server.testing.tiny import build_tiny_model

# Tiny test models are latency-bound: one thread avoids OpenMP spin-waits when the CI machine's
# two cores are shared with server subprocesses.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Exactness (logits vs transformers, greedy equality across modes) is asserted in float32: the
# default weight dtype "auto" would serve bf16 weights on a CPU with AVX512-BF16. The bf16 path
# has its own tests (test_bf16_weights.py), which ask for it explicitly.
os.environ["DSPARK_WEIGHT_DTYPE"] = "float32"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random tiny Qwen3 target without EOS ids: generations run exactly to max_tokens."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", with_eos=False)


@pytest.fixture(scope="session")
def tiny_model_eos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_eos") / "model", seed=3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def start_server() -> Iterator:
    from test_api_support import LoggedServer  # a server whose log goes to a file, not a pipe

    servers: list[LoggedServer] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> LoggedServer:
        s = LoggedServer(args, env)
        servers.append(s)
        s.wait_ready()
        return s

    yield start
    for s in servers:
        s.stop()
