"""The bundled demo pair: greedy speculative output equals plain decoding, and drafts get accepted.

Run in float64 so that the comparison is about the algorithm, not about which BLAS kernel a batch
shape picks: in float32 a verification forward over 8 tokens and a decode over 1 can round a
near-tie differently, as in every engine.
"""

from __future__ import annotations

import pytest
from test_engine import Collector, run_all

from dspark_server.assets import default_draft, default_target
from dspark_server.config import EngineConfig, SpeculativeConfig
from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.request import SamplingParams
from dspark_server.offline import read_prompts

PROMPTS = [
    "Write a Python function `read_config(path)` that reads an INI file.",
    "Implement the Python class `LRUCache` with get and put methods.",
    "Tell me about the history of the `os.path` module.",
    "Write a function that returns the n-th Fibonacci number.",
]


def _run(mode: str, concurrency: int, max_tokens: int) -> tuple[Collector, LLMEngine]:
    draft = default_draft()
    engine = LLMEngine(
        EngineConfig(
            model_dir=default_target(),
            draft_dir=draft if mode != "off" else None,
            dtype="float64",
            max_running=concurrency,
            spec=SpeculativeConfig(mode=mode),
        )
    )  # type: ignore[arg-type]
    col = Collector()
    for i in range(concurrency):
        text = PROMPTS[i % len(PROMPTS)] + f" #{i}"
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": text}])
        engine.add_request(
            str(i),
            ids,
            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
            col.sink(str(i)),
        )
    run_all(engine)
    return col, engine


@pytest.mark.parametrize("concurrency", [1, 8, 32])
def test_demo_pair_greedy_equality(concurrency: int) -> None:
    assert default_draft() is not None, "the demo drafter is missing from the package"
    ref, _ = _run("off", concurrency, 256)
    for mode in ("fixed", "threshold", "dspark"):
        col, engine = _run(mode, concurrency, 256)
        for i in range(concurrency):
            assert col.tokens(str(i)) == ref.tokens(str(i)), f"{mode}: request {i} differs"
        assert engine.stats.spec_accepted_tokens > 0


def test_demo_prompts_file_format_is_read() -> None:
    # the evaluation prompt format (first user turn) drives `dspark generate`
    import json
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write(json.dumps({"turns": ["a", "b"]}) + "\n\n" + json.dumps({"turns": ["c"]}) + "\n")
    assert read_prompts(f.name) == ["a", "c"]
