"""What this machine is, read once from /proc/cpuinfo: the CPU's name and its feature flags; and
how many CPUs this process may use.

Cached tables and kernels are keyed by the machine they were measured or built on; every reader
of /proc/cpuinfo goes through here.
"""

from __future__ import annotations

import math
import os
import platform
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    """The first processor's ``key: value`` lines (empty where /proc/cpuinfo is unreadable)."""
    out: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break  # the first processor's block ends here
            key, _, value = line.partition(":")
            out.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return out


def cpu_model() -> str:
    """The CPU's model name, else what ``platform`` knows."""
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def cpu_flags() -> str:
    """The CPU's feature flags line (e.g. "... avx512f avx512_bf16 ..."), else the processor name."""
    return _cpuinfo().get("flags") or platform.processor()


def available_cpus() -> int:
    """The CPUs this process may compute on: $OMP_NUM_THREADS where set (the Kubernetes manifests
    set it to the pod's CPU request), else those it may run on, capped by the container's CPU
    quota (cgroup v2 ``cpu.max``) where there is one."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max" and int(period) > 0:
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cpus


ALL_CPUS_FROM_BYTES = 64 << 20  # target weights from which the engine computes on every CPU


def checkpoint_bytes(model_dir: str | None) -> int:
    """The bytes of a model directory's safetensors files (0 without one)."""
    if model_dir is None:
        return 0
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def engine_threads(model_dir: str | None = None) -> int:
    """The engine process's default compute threads: ``machine.available_cpus()`` less one for the
    HTTP process, or all of them for a target of ``ALL_CPUS_FROM_BYTES`` of weights or more. On
    two cores the demo pair (16 MB) served 2-12% fewer tokens/s on both (bench_serving, c = 1 and
    16, plain and dspark): its threads spin on the core the HTTP process needs. A model whose
    forward reads its weights from memory is bound by that instead: the K=8 twin (755 MB) served
    28 tokens/s plain at one request on one thread, 48 on two."""
    cpus = available_cpus()
    if checkpoint_bytes(model_dir) >= ALL_CPUS_FROM_BYTES:
        return cpus
    return max(1, cpus - 1)
