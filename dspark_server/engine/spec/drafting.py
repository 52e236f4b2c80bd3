"""Drafting: one backbone pass, then the sequential head sampled left to right.

x_k ~ q_k = shape(U_k + B_k(x_{k-1}, state)) with each request's own sampling settings
(``sampling.shape_probs``, the function that shapes the target's p too). The confidence for
position k is computed from the backbone state at k and x_{k-1} only — never from x_k — which
is what lets the planner admit positions without looking at the tokens it admits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspark_server.engine.noise import NoiseKey, row_keys
from dspark_server.engine.sampling import SamplingTensors, sample, shape_probs
from dspark_server.engine.uniforms import draw_uniforms
from dspark_server.models.drafter import DraftBlock, DSparkDrafter
from dspark_server.models.row_ops import row_argmax


@dataclass(frozen=True)
class Drafts:
    tokens: torch.Tensor  # [R, γ]
    probs: torch.Tensor | None  # [R, γ, V] q each draft was sampled from (None: all greedy)
    confidence_logits: torch.Tensor | None  # [R, γ] raw, before STS


def sample_drafts(
    drafter: DSparkDrafter,
    gamma: int,
    block: DraftBlock,
    anchors: torch.Tensor,
    sampling: SamplingTensors,
    generators: Sequence[torch.Generator],
    keys: Sequence[NoiseKey | None],
) -> Drafts:
    """Left to right over the γ positions of every request's block; seeded rows (a key) draw
    x_k by keyed Gumbel-max at output position key + k, the noise their target draw will use."""
    greedy = sampling.all_greedy
    if greedy:
        fast = drafter.greedy_tokens(block.logits[:, :gamma], anchors)
        if fast is not None:
            return _from_kernel(drafter, block, anchors, fast, None)
    # one draw per request for the whole block: x_k uses column k
    uniforms = None if greedy else draw_uniforms(generators, gamma)
    temperature_only = not (sampling.any_greedy or sampling.any_top_k or sampling.any_top_p)
    if uniforms is not None and temperature_only:
        keyed = row_keys(keys, gamma)
        sampled = drafter.sampled_tokens(
            block.logits[:, :gamma], anchors, sampling.temperature, uniforms, keyed
        )
        if sampled is not None:
            return _from_kernel(drafter, block, anchors, *sampled)
    state = drafter.init_head_state(block.hidden[:, 0])
    prev = anchors
    tokens, probs, prevs = [], [], []
    for k in range(gamma):
        step_logits, state = drafter.step_logits(block.logits[:, k], prev, block.hidden[:, k], state)
        prevs.append(prev)
        if greedy:
            prev = row_argmax(step_logits)
        else:
            qk = shape_probs(step_logits, sampling)
            assert uniforms is not None
            shifted = [key.shifted(k) if key is not None else None for key in keys]
            prev = sample(qk, generators, shifted, uniforms[:, k])
            probs.append(qk)
        tokens.append(prev)
    conf = drafter.confidence_logits(block.hidden[:, :gamma], torch.stack(prevs, dim=1))
    return Drafts(torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if probs else None, conf)


def _from_kernel(
    drafter: DSparkDrafter,
    block: DraftBlock,
    anchors: torch.Tensor,
    tokens: torch.Tensor,
    probs: torch.Tensor | None,
) -> Drafts:
    """A block the Markov head drafted in one kernel call, with its confidence logits (which
    read x_{k-1}: the anchor, then the block's own tokens)."""
    before = torch.cat([anchors.long()[:, None], tokens[:, :-1]], dim=1)
    return Drafts(tokens, probs, drafter.confidence_logits(block.hidden[:, : tokens.shape[1]], before))


def merge_drafts(
    num_rows: int,
    drafter_rows: Sequence[int],
    drafted: Drafts | None,
    lookup_rows: Sequence[int],
    proposals: Sequence[Sequence[int]],
    gamma: int,
    vocab: int,
    need_probs: bool,
    confidence: bool,
) -> Drafts:
    """One step's drafts, rows in request order: the drafter's block for ``drafter_rows``
    (``drafted``), the prompt-lookup proposals (γ tokens each) for ``lookup_rows``, whose q is
    one-hot at the proposed token (``need_probs``: some row samples, so verification needs every
    row's q; ``confidence``: the drafter has a confidence head). The lookup rows' confidence
    logits are 0: the planner prices them by the lookup's
    own acceptance (lookup.py)."""
    tokens = torch.zeros(num_rows, gamma, dtype=torch.long)
    probs = torch.zeros(num_rows, gamma, vocab) if need_probs else None
    conf = torch.zeros(num_rows, gamma) if confidence else None
    ds = torch.tensor(list(drafter_rows), dtype=torch.long)
    if drafted is not None and len(drafter_rows):
        tokens[ds] = drafted.tokens[:, :gamma].long()
        if probs is not None:
            if drafted.probs is not None:
                probs[ds] = drafted.probs[:, :gamma].float()
            else:  # every drafter row was greedy: its q is one-hot at its draft
                probs[ds] = _one_hot(tokens[ds], vocab)
        if conf is not None and drafted.confidence_logits is not None:
            conf[ds] = drafted.confidence_logits[:, :gamma].float()
    if len(lookup_rows):
        lk = torch.tensor(list(lookup_rows), dtype=torch.long)
        tokens[lk] = torch.tensor([list(p[:gamma]) for p in proposals], dtype=torch.long)
        if probs is not None:
            probs[lk] = _one_hot(tokens[lk], vocab)
    return Drafts(tokens, probs, conf)


def _one_hot(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, γ] token ids -> [R, γ, V] float32 distributions one-hot at them."""
    return torch.zeros(*tokens.shape, vocab).scatter_(2, tokens[..., None], 1.0)
