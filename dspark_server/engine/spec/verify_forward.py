"""The verification forward of a speculative step: every drafting request's block [x0, x1..xℓ],
the plain decodes' one token each, and the prefill chunks, in one target forward; then rejection
sampling of the drafted blocks, all requests at once.

Plain decodes are the requests that do not draft this step (the draft gate explores drafting for
a few of them): their last-token logits rows come back, like a completing prefill chunk's, for
the engine's plain sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dspark_server.engine.batch import SeqChunk
from dspark_server.engine.model_runner import ForwardResult, ModelRunner
from dspark_server.engine.request import Request
from dspark_server.engine.sampling import SamplingTensors, sample_from_logits, shape_probs
from dspark_server.engine.scheduler import ScheduledChunk
from dspark_server.engine.spec.drafting import Drafts
from dspark_server.engine.spec.verify import VerifyOutcome, verify_greedy, verify_padded
from dspark_server.models.row_ops import row_argmax, take_rows


@dataclass(frozen=True)
class VerifiedForward:
    forward: ForwardResult
    outcome: VerifyOutcome  # of the drafting requests
    plain_rows: list[int]  # logits row of each plain decode, in order
    prefill_rows: list[int]  # logits row of each completing prefill chunk's last token, in order


def verify_forward(
    runner: ModelRunner,
    decodes: list[Request],
    plain: list[Request],
    prefills: list[ScheduledChunk],
    drafts: Drafts,
    lens: list[int],
    sampling: SamplingTensors,
    capture_layers: tuple[int, ...],
) -> VerifiedForward:
    """``decodes`` verify their first ``lens`` drafts; ``sampling`` is theirs."""
    chunks = [
        SeqChunk(
            r.table,
            r.num_computed,
            [r.last_token_id] + drafts.tokens[i, :ell].tolist() if ell else [r.last_token_id],
        )
        for i, (r, ell) in enumerate(zip(decodes, lens, strict=True))
    ]
    chunks += [SeqChunk(r.table, r.num_computed, [r.last_token_id]) for r in plain]
    chunks += [SeqChunk(c.request.table, c.start, c.token_ids) for c in prefills]
    tail = [ell + 1 for ell in lens] + [1] * len(plain) + [1 if c.completes else 0 for c in prefills]
    forward = runner.forward(chunks, tail, capture_layers=capture_layers)
    logits = forward.output.logits
    ends_np = np.cumsum(tail, dtype=np.int64)
    starts_np = ends_np - np.asarray(tail, dtype=np.int64)
    ends, starts = ends_np.tolist(), starts_np.tolist()
    n = len(decodes)
    if not any(lens):  # nothing to verify: the plain path's sampler, as is
        last = take_rows(logits, torch.from_numpy(starts_np[:n]))
        gens, keys = [r.generator for r in decodes], [r.noise_key for r in decodes]
        outcome = VerifyOutcome([0] * n, sample_from_logits(last, sampling, gens, keys).tolist())
    else:
        # Every request's ℓ_r + 1 rows, padded to the step's widest block: [R, L + 1].
        width = max(lens) + 1
        index = np.minimum(starts_np[:n, None] + np.arange(width)[None, :], ends_np[:n, None] - 1)
        if sampling.all_greedy:  # accept while the draft equals the target argmax
            # argmax over the drafting requests' rows only (they come first in the batch)
            argmax = row_argmax(logits[: ends[n - 1]]).numpy()[index]
            outcome = verify_greedy(drafts.tokens, torch.from_numpy(argmax), lens)
        else:
            rows = take_rows(logits, torch.from_numpy(index))  # [R, L + 1, V]
            flat = shape_probs(
                rows.reshape(-1, rows.shape[-1]), sampling.repeat_rows(torch.full((n,), width))
            )
            outcome = verify_padded(
                drafts.tokens,
                drafts.probs,
                flat.reshape(rows.shape),
                lens,
                [r.generator for r in decodes],
                [r.noise_key for r in decodes],
            )
    plain_rows = starts[n : n + len(plain)]
    completing = [s for s, c in zip(starts[n + len(plain) :], prefills, strict=True) if c.completes]
    return VerifiedForward(forward, outcome, plain_rows, completing)
