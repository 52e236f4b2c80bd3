"""Exact output distributions of plain (non-speculative) sampling from a tiny target.

The reference the speculative engine is tested against: every continuation of a prompt up to
``length`` tokens is enumerated (small vocabularies, or top-k, keep this cheap), each prefix's
next-token distribution computed from the target's logits with a shaping written here from the
definitions — not the engine's ``sampling.shape_probs``, so a shaping bug cannot hide in both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dspark_server.engine.request import SamplingParams
from dspark_server.models.attention import DenseCausalAttention
from dspark_server.models.loader import load_target
from dspark_server.models.target import TargetModel

Outcome = tuple[int, ...]
# A top-p cut-off this close to a cumulative mass could fall on the other side in float32.
TOP_P_MARGIN = 1e-4


def reference_probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """[N, V] float64 distributions plain sampling draws from under ``sp``."""
    logits = logits.double()
    if sp.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).double()
    z = logits / sp.temperature
    if sp.top_k > 0 and sp.top_k < z.shape[-1]:
        kth = z.topk(sp.top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)
    if sp.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens
        near = ((before - sp.top_p).abs() < TOP_P_MARGIN) & (sorted_p > 0)
        assert not bool(near.any()), "top_p falls on a cumulative mass: pick another top_p"
        keep_sorted = before < sp.top_p
        keep_sorted[:, 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


@dataclass(frozen=True)
class ExactTarget:
    """A target loaded once (float64) for exact enumeration."""

    model: TargetModel

    @classmethod
    def load(cls, model_dir: str | Path) -> ExactTarget:
        return cls(load_target(model_dir, torch.float64).eval())

    @torch.no_grad()
    def next_logits(self, sequences: list[list[int]]) -> torch.Tensor:
        """Last-position logits [N, V] of N equally long sequences, one batched forward."""
        n, length = len(sequences), len(sequences[0])
        ids = torch.tensor(sequences).reshape(-1)
        positions = torch.arange(length).repeat(n)
        rows = torch.arange(n) * length + length - 1
        out = self.model(ids, positions, DenseCausalAttention(n, length), logits_rows=rows)
        return out.logits.double()

    def distribution(
        self, prompt: list[int], sp: SamplingParams, length: int, eos_ids: tuple[int, ...] = ()
    ) -> dict[Outcome, float]:
        """P(first ``length`` emitted tokens) under plain sampling; a sequence ends early at a stop
        id (``sp.stop_token_ids`` or ``eos_ids`` unless ``sp.ignore_eos``), which it includes."""
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_ids))
        done: dict[Outcome, float] = {}
        frontier: dict[Outcome, float] = {(): 1.0}
        for _ in range(length):
            prefixes = list(frontier)
            probs = reference_probs(self.next_logits([prompt + list(p) for p in prefixes]), sp)
            nxt: dict[Outcome, float] = {}
            for prefix, row in zip(prefixes, probs, strict=True):
                for tok in torch.nonzero(row > 0).flatten().tolist():
                    outcome, mass = prefix + (tok,), frontier[prefix] * float(row[tok])
                    (done if tok in stops else nxt)[outcome] = mass
            frontier = nxt
        done.update(frontier)
        return done
