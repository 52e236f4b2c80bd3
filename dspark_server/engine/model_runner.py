"""Owns the target model, its KV pool and the page allocator; runs one packed forward."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import numpy as np
import torch

from dspark_server.config import EngineConfig
from dspark_server.engine.batch import PackedBatch, SeqChunk, pack
from dspark_server.engine.kv_cache import PageAllocator
from dspark_server.models.attention import KVPool
from dspark_server.models.kernel_library import load_library
from dspark_server.models.loader import load_target, resolve_dtype
from dspark_server.models.target import TargetModel, TargetOutput

log = logging.getLogger(__name__)

_P = ParamSpec("_P")
_R = TypeVar("_R")


def inference_mode(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``fn`` in ``torch.inference_mode`` unless autograd is already off: the engine's loops
    enter it once for their life (loop.py, process.py), and entering it again for every step and
    forward cost a few per cent of a plain step at one request; other callers get it per call."""

    @functools.wraps(fn)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if torch.is_grad_enabled():
            with torch.inference_mode():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return run


@dataclass(frozen=True)
class ForwardResult:
    batch: PackedBatch
    output: TargetOutput
    seconds: float


class ModelRunner:
    def __init__(self, cfg: EngineConfig, target: TargetModel | None = None) -> None:
        self.cfg = cfg
        self.dtype = resolve_dtype(cfg.dtype)
        self.target = target if target is not None else load_target(cfg.model_dir, self.dtype)
        self.allocator = PageAllocator(cfg.resolved_num_pages(), cfg.page_size, cfg.prefix_cache)
        weight_dtype = cfg.resolved_weight_dtype()
        if weight_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"weight_dtype must be auto, float32 or bfloat16, got {weight_dtype!r}")
        self.weight_dtype = resolve_dtype(weight_dtype)  # the fused forwards' GEMM weights
        log.info("weights served as %s (--weight-dtype %s)", weight_dtype, cfg.weight_dtype)
        lib = load_library() if cfg.layer_kernels else None
        self.target.use_kernels(lib, fused=cfg.fused_forward, weight_dtype=self.weight_dtype)
        kv = cfg.resolved_kv_cache_dtype()
        if kv not in ("float32", "bfloat16", cfg.dtype):
            raise ValueError(f"kv_cache_dtype must be auto, float32, bfloat16 or --dtype, got {kv!r}")
        self.pool = self._new_pool(resolve_dtype(kv))
        if not self.target.serves_pool(self.pool):  # a bf16 cache under float32: fused forward only
            if cfg.kv_cache_dtype != "auto":
                raise ValueError(f"a {kv} KV cache needs the fused forward (--kv-cache-dtype {kv})")
            self.pool = self._new_pool(self.dtype)
        log.info("KV cache in %s (--kv-cache-dtype %s)", self.pool.k.dtype, cfg.kv_cache_dtype)

    def _new_pool(self, dtype: torch.dtype) -> KVPool:
        mc = self.target.config
        return KVPool(
            mc.num_hidden_layers,
            self.allocator.num_slots,
            mc.num_key_value_heads,
            mc.head_dim,
            dtype,
            impl=self.cfg.attention_impl,
        )

    @inference_mode
    def forward(
        self, chunks: list[SeqChunk], logits_tail: list[int], capture_layers: tuple[int, ...] = ()
    ) -> ForwardResult:
        """Run the target over the chunks and mark their tokens as cached.

        ``logits_tail[i]``: how many of chunk i's last rows need logits (0, 1 for a sampled next
        token, all of them for verification); logits come back in chunk order.
        """
        t0 = time.perf_counter()
        batch = pack(chunks, self.allocator)
        logits_rows = tail_rows(batch.offsets, batch.lengths, logits_tail)
        narrow = torch.get_num_threads()
        wide = self._wide_threads(narrow, batch.num_tokens, len(chunks))
        if wide:
            torch.set_num_threads(wide)
        try:
            out = self.target(
                batch.input_ids,
                batch.positions,
                batch.attention(self.pool),
                logits_rows=logits_rows,
                capture_layers=capture_layers,
            )
        finally:
            if wide:
                torch.set_num_threads(narrow)
        for c in chunks:
            c.table.length = c.start + len(c.token_ids)
        return ForwardResult(batch, out, time.perf_counter() - t0)

    def _wide_threads(self, narrow: int, num_tokens: int, num_requests: int) -> int | None:
        """Threads for a forward this wide, when they differ from the engine's ``narrow`` (None:
        as is)."""
        cfg = self.cfg
        wide = cfg.wide_step_threads
        if not wide or wide == narrow or num_tokens < cfg.wide_step_tokens:
            return None
        return wide if num_requests <= cfg.wide_step_requests else None


def tail_rows(offsets: Sequence[int], lengths: Sequence[int], tails: Sequence[int]) -> torch.Tensor:
    """Packed rows of each chunk's last ``tails[i]`` tokens, in chunk order."""
    if all(k == 1 for k in tails):  # plain steps: every chunk's last row
        return torch.from_numpy(np.add(offsets, lengths, dtype=np.int64) - 1)
    rows: list[int] = []
    for off, n, k in zip(offsets, lengths, tails, strict=True):
        rows.extend(range(off + n - k, off + n))
    return torch.from_numpy(np.asarray(rows, dtype=np.int64))
