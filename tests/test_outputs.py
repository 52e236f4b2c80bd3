"""Appending tokens to a request: a speculative round appends several at once, and the request
must end exactly as if they had come one at a time (text, ids, where and why it stopped)."""

from __future__ import annotations

import random

import pytest

from dspark_server.assets import DEMO_TARGET
from dspark_server.engine.outputs import OutputProcessor
from dspark_server.engine.request import Request, SamplingParams
from dspark_server.models.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(str(DEMO_TARGET))


def _run(tok: Tokenizer, params: SamplingParams, stream: list[int], sizes: list[int]) -> Request:
    proc = OutputProcessor(tok, eos_token_ids=(tok.vocab_size - 1,))
    req = Request("r", [1, 2, 3], params, lambda out: None)
    at = 0
    for n in sizes:
        if req.finish_reason is not None or at >= len(stream):
            break
        proc.append(req, stream[at : at + n])
        at += n
    return req


@pytest.mark.parametrize("case", range(40))
def test_tokens_appended_in_rounds_end_as_one_at_a_time(tokenizer: Tokenizer, case: int) -> None:
    rng = random.Random(case)
    eos = tokenizer.vocab_size - 1
    # byte-level tokens among them, so that characters span tokens and text is held back
    stream = [rng.randrange(3, tokenizer.vocab_size - 1) for _ in range(60)]
    for i in rng.sample(range(60), 3):
        stream[i] = rng.randrange(3, 259)
    if case % 3 == 0:
        stream[rng.randrange(5, 50)] = eos
    stop_id = stream[rng.randrange(10, 60)] if case % 4 == 1 else None
    params = SamplingParams(
        max_tokens=rng.randrange(5, 60),
        ignore_eos=case % 5 == 0,
        stop_token_ids=(stop_id,) if stop_id is not None else (),
    )
    # where it must end: at the first stop id (or EOS, unless ignored), else at max_tokens
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else {eos})
    end = next((i + 1 for i, t in enumerate(stream) if t in stops), len(stream))
    want_ids, want_reason = stream[: min(end, params.max_tokens)], "stop"
    if params.max_tokens < end or (params.max_tokens == end and stream[end - 1] not in stops):
        want_reason = "length"
    one = _run(tokenizer, params, stream, [1] * len(stream))
    assert (one.output_ids, one.finish_reason) == (want_ids, want_reason)
    sizes = [rng.randrange(1, 9) for _ in range(len(stream))]
    rounds = _run(tokenizer, params, stream, sizes)
    assert rounds.output_ids == one.output_ids
    assert rounds.output_text == one.output_text
    assert rounds.finish_reason == one.finish_reason is not None
