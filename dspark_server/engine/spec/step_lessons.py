"""What a finished step teaches the draft gate and the step-overhead estimate (dspark mode)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

from dspark_server.engine.spec.draft_gate import DraftGate
from dspark_server.engine.spec.step_overhead import StepOverhead


class DraftingLesson(NamedTuple):
    """What a drafting step teaches, in plain values (it may wait to be filed: it holds no
    request and no tensor). ``tokens``: each drafting request's expected tokens (or kept);
    ``kept``: the tokens each did keep, when ``tokens`` are expectations."""

    request_ids: list[str]
    regimes: list[float]
    tokens: Sequence[float]
    forward_seconds: float
    batch_tokens: int
    prefill_tokens: int
    draft_seconds: float
    step_seconds: float
    switch_seconds: float = 0.0
    num_requests: int | None = None
    kept: Sequence[int] | None = None
    prompt_writes_seconds: float = 0.0  # of the catch-up, the prompts' rows


def teach(gate: DraftGate | None, overhead: StepOverhead | None, lesson: DraftingLesson) -> None:
    """A drafting step's decoding share of time, its tokens per request (``tokens``: expected or
    kept), the draft pass's time and the catch-up (``switch_seconds``)."""
    if not lesson.request_ids:
        return
    step_s, forward_s = decode_share(
        lesson.forward_seconds,
        lesson.batch_tokens,
        lesson.prefill_tokens,
        lesson.step_seconds,
        None if gate is None else gate.forward_seconds,
    )
    n, num_requests = len(lesson.request_ids), lesson.num_requests
    if gate is not None:
        gate.record(
            lesson.request_ids,
            True,
            lesson.tokens,
            step_s,
            lesson.switch_seconds,
            lesson.regimes,
            num_requests,
            lesson.kept,
            lesson.prompt_writes_seconds,
        )
    if overhead is not None and (num_requests is None or num_requests == n):
        overhead.record(n, step_s, forward_s, lesson.draft_seconds)


def teach_plain(
    gate: DraftGate | None,
    overhead: StepOverhead | None,
    num_decodes: int,
    forward_seconds: float,
    batch_tokens: int,
    prefill_tokens: int,
    step_seconds: float,
) -> None:
    """A plain step's decoding share of time (one token per request, no draft pass)."""
    curve = None if gate is None else gate.forward_seconds
    step_s, forward_s = decode_share(forward_seconds, batch_tokens, prefill_tokens, step_seconds, curve)
    if gate is not None:
        gate.record_plain(num_decodes, step_s)
    if overhead is not None:
        overhead.record(num_decodes, step_s, forward_s, 0.0)


def teach_plain_run(
    gate: DraftGate | None,
    overhead: StepOverhead | None,
    num_decodes: int,
    forward_seconds: Sequence[float],
    step_seconds: Sequence[float],
) -> None:
    """Decode-only plain steps of ``num_decodes`` requests, in the order they ran: what
    ``teach_plain`` files for each, in one call per estimator."""
    if gate is not None:
        gate.record_plain_many(num_decodes, step_seconds)
    if overhead is not None:
        overhead.record_many(num_decodes, step_seconds, forward_seconds)


def decode_share(
    forward_seconds: float,
    batch_tokens: int,
    prefill_tokens: int,
    step_seconds: float,
    curve: Callable[[int], float] | None = None,
) -> tuple[float, float]:
    """(the step's, its forward's) seconds less the prefill chunks' share of the forward.

    Under steady traffic almost every step also carries a prefill chunk: leave out its share of
    the forward rather than the whole step, so the estimates keep learning instead of freezing
    on the rare prefill-free steps. The decodes' share is what a forward of their tokens alone
    costs over one of the whole batch (``curve``: the target forward's time at B batch tokens,
    the SPS table's), at least their share of the tokens (the share without a curve). Split by
    token count alone, a forward bound by reading the weights left its decodes almost nothing:
    served on the K=8 twin at 16 requests, the plain steps of 8-15 requests learnt 4-8 ms
    from steps that shared the forward with a prompt chunk, against ~22 ms for one without,
    and the gate chose plain steps whenever the load dipped to 15.

    Nor do the decodes take more than a forward of their tokens alone costs on the curve (or
    their share of the tokens, if more): a forward slower than the curve says for the whole batch
    was slowed by the chunk (its attention over a long prompt), not by them. Shared in proportion,
    one prefill-heavy step at 9-15 requests on the K=8 twin (~60 ms) left their plain step
    priced at 34 ms against 25-28 measured without a chunk, and drafting, chosen against it,
    filed no plain step to correct it for thousands of steps."""
    if prefill_tokens <= 0:
        return step_seconds, forward_seconds
    batch = max(1, batch_tokens)
    tokens_share = max(0.0, (batch - prefill_tokens) / batch)
    decodes_s = forward_seconds * tokens_share
    if curve is not None and batch > prefill_tokens:
        try:
            alone, whole = curve(batch - prefill_tokens), curve(batch)
        except (ValueError, ZeroDivisionError):
            alone, whole = math.nan, math.nan
        if math.isfinite(alone) and math.isfinite(whole) and whole > 0:
            share = min(1.0, max(tokens_share, alone / whole))
            decodes_s = max(decodes_s, min(forward_seconds * share, alone))
    prefill_s = forward_seconds - decodes_s
    return step_seconds - prefill_s, forward_seconds - prefill_s
