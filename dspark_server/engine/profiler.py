"""SPS profiling: target verification steps per second vs batch tokens, on this machine.

A probe of B batch tokens runs verification-shaped forwards: ceil(B / (γ+1)) sequences, each
adding up to γ+1 tokens on top of a cached context (384 tokens by default: served requests carry
long histories, and attention over them is part of a step's cost), the shape a speculative step
has.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dspark_server.engine.batch import SeqChunk
from dspark_server.engine.kv_cache import PageTable
from dspark_server.engine.model_runner import ModelRunner
from dspark_server.machine import cpu_model
from dspark_server.models.kernel_library import source_digest
from dspark_server.planner import SpsCostTable, build_sps_table, monotone_envelope, probe_batch_sizes

log = logging.getLogger(__name__)


PROFILE_CONTEXT = 384  # cached tokens behind each probed sequence, where the model allows it


def profile_context(max_model_len: int) -> int:
    """The probes' context for an engine of this ``max_model_len`` (a probe adds its block on top)."""
    return min(PROFILE_CONTEXT, max(1, max_model_len // 2))


def profile_sps(
    runner: ModelRunner,
    max_batch_tokens: int,
    block: int = 8,
    context: int = PROFILE_CONTEXT,
    repeats: int = 5,
    warmup: int = 2,
    time_budget_s: float | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> SpsCostTable:
    """Median step time per probe -> ``SpsCostTable`` (monotone envelope: see ``monotone_envelope``).
    Stops adding probes past the time budget."""
    probes = probe_batch_sizes(max_batch_tokens)
    alloc = runner.allocator
    vocab = runner.target.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    samples: dict[int, list[float]] = {}
    t_start = time.perf_counter()
    for i, b in enumerate(probes):
        sizes = [block] * (b // block) + ([b % block] if b % block else [])
        tables = [PageTable() for _ in sizes]
        try:
            for t, n in zip(tables, sizes, strict=True):
                if not alloc.reserve(t, context + n):
                    raise RuntimeError("KV cache too small to profile this batch size")
                t.length = context
            chunks = [
                SeqChunk(t, context, torch.randint(0, vocab, (n,), generator=gen).tolist())
                for t, n in zip(tables, sizes, strict=True)
            ]
            times = []
            for rep in range(warmup + repeats):
                result = runner.forward(chunks, sizes)
                for t in tables:
                    t.length = context
                if rep >= warmup:
                    times.append(result.seconds)
            samples[b] = times
        except RuntimeError as exc:
            log.warning("SPS profiling stopped at %d batch tokens: %s", b, exc)
            break
        finally:
            for t in tables:
                alloc.release(t)
        if progress:
            progress(i + 1, len(probes))
        if time_budget_s is not None and time.perf_counter() - t_start > time_budget_s:
            log.warning("SPS profiling hit its %.0f s budget at %d batch tokens", time_budget_s, b)
            break
    return monotone_envelope(build_sps_table(samples, max_batch_tokens=max(samples)))


def machine_description() -> dict[str, str | int]:
    cpu = cpu_model()
    return {
        "cpu": cpu,
        "cores": os.cpu_count() or 1,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "kernels": source_digest(),  # the kernels a table was measured with
    }


def profile_key(model_dir: str, dtype: str) -> str:
    """Identifies (model architecture, dtype, machine) so a cached table is reused only there."""
    cfg = (Path(model_dir) / "config.json").read_text()
    raw = json.dumps([cfg, dtype, machine_description()], sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark")) / "sps"
