"""What a finished step teaches the draft gate and the step-overhead estimate (dspark mode)."""

from __future__ import annotations

from collections.abc import Sequence

from dspark_server.engine.model_runner import ForwardResult
from dspark_server.engine.request import Request
from dspark_server.engine.spec.draft_gate import DraftGate
from dspark_server.engine.spec.step_overhead import StepOverhead


def teach(
    gate: DraftGate | None,
    overhead: StepOverhead | None,
    decodes: Sequence[Request],
    tokens: Sequence[float],
    forward: ForwardResult,
    prefill_tokens: int,
    draft_seconds: float,
    step_seconds: float,
    switch_seconds: float = 0.0,
    num_requests: int | None = None,
    kept: Sequence[int] | None = None,
) -> None:
    """A drafting step's decoding share of time, its tokens per request (``tokens``: expected or
    kept), the draft pass's time and the catch-up (``switch_seconds``)."""
    if not decodes:
        return
    step_s, forward_s = decode_share(forward.seconds, forward.batch.num_tokens, prefill_tokens, step_seconds)
    if gate is not None:
        ids, regimes = [r.request_id for r in decodes], [r.params.temperature for r in decodes]
        gate.record(ids, True, tokens, step_s, switch_seconds, regimes, num_requests, kept)
    if overhead is not None and (num_requests is None or num_requests == len(decodes)):
        overhead.record(len(decodes), step_s, forward_s, draft_seconds)


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
    step_s, forward_s = decode_share(forward_seconds, batch_tokens, prefill_tokens, step_seconds)
    if gate is not None:
        gate.record_plain(num_decodes, step_s)
    if overhead is not None:
        overhead.record(num_decodes, step_s, forward_s, 0.0)


def decode_share(
    forward_seconds: float, batch_tokens: int, prefill_tokens: int, step_seconds: float
) -> tuple[float, float]:
    """(the step's, its forward's) seconds less the prefill chunks' share of the forward."""
    # Under steady traffic almost every step also carries a prefill chunk: leave out its share
    # of the forward (by token count) rather than the whole step, so the estimates keep learning
    # instead of freezing on the rare prefill-free steps.
    prefill_s = forward_seconds * prefill_tokens / max(1, batch_tokens)
    return step_seconds - prefill_s, forward_seconds - prefill_s
