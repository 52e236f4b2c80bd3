"""Continuous batching: exact greedy output, KV accounting, seeds, cancellation, stops."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import torch

from dspark_server.config import EngineConfig
from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.request import RequestOutput, SamplingParams
from dspark_server.models.attention import DenseCausalAttention
from dspark_server.models.loader import load_target


class Collector:
    def __init__(self) -> None:
        self.outputs: dict[str, list[RequestOutput]] = {}

    def sink(self, rid: str) -> Callable[[RequestOutput], None]:
        return lambda out: self.outputs.setdefault(rid, []).append(out)

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs[rid] for t in o.new_token_ids]

    def text(self, rid: str) -> str:
        return "".join(o.new_text for o in self.outputs[rid])

    def final(self, rid: str) -> RequestOutput:
        return self.outputs[rid][-1]


def run_all(engine: LLMEngine, max_steps: int = 100_000) -> None:
    for _ in range(max_steps):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError("engine did not drain")


def reference_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    model = load_target(model_dir, torch.float64)
    ids = list(prompt)
    for _ in range(n):
        x = torch.tensor(ids)
        out = model(x, torch.arange(len(ids)), DenseCausalAttention(1, len(ids)))
        ids.append(int(out.logits[-1].argmax()))
    return ids[len(prompt) :]


def test_greedy_batched_chunked_equals_full_recompute(tiny_model: Path) -> None:
    cfg = EngineConfig(
        model_dir=str(tiny_model),
        dtype="float64",
        max_batch_tokens=40,
        prefill_chunk=16,
        max_running=8,
        page_size=4,
    )
    engine = LLMEngine(cfg)
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 300) for _ in range(rng.randrange(3, 70))] for _ in range(8)]
    col = Collector()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=12), col.sink(str(i)))
    run_all(engine)
    for i, p in enumerate(prompts):
        assert col.tokens(str(i)) == reference_greedy(tiny_model, p, 12)
        assert col.final(str(i)).finish_reason == "length"


def test_kv_capacity_returns_after_hundreds_of_requests_with_aborts(tiny_model: Path) -> None:
    # Few pages: admission waits and decodes preempt each other (recompute) along the way.
    cfg = EngineConfig(
        model_dir=str(tiny_model),
        page_size=4,
        num_pages=60,
        max_running=16,
        max_batch_tokens=64,
        prefill_chunk=24,
        max_model_len=128,
    )
    engine = LLMEngine(cfg)
    alloc = engine.runner.allocator
    start_free = alloc.free_pages
    rng = random.Random(1)
    col = Collector()
    expected_len: dict[str, int] = {}
    aborted: set[str] = set()
    for i in range(300):
        rid = f"r{i}"
        prompt = [rng.randrange(4, 300) for _ in range(rng.randrange(1, 60))]
        max_tokens = rng.randrange(1, 20)
        engine.add_request(
            rid, prompt, SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens), col.sink(rid)
        )
        expected_len[rid] = max_tokens
        for _ in range(rng.randrange(0, 3)):
            engine.step()
        if rng.random() < 0.2:
            victim = f"r{rng.randrange(0, i + 1)}"
            engine.abort(victim)
            aborted.add(victim)
    run_all(engine)
    assert alloc.free_pages == start_free
    assert not engine.requests and engine.scheduler.num_unfinished == 0
    for rid, n in expected_len.items():
        final = col.final(rid)
        assert final.finished
        if final.finish_reason != "abort":
            assert final.finish_reason == "length" and len(col.tokens(rid)) == n
    assert any(col.final(r).finish_reason == "abort" for r in aborted)


def test_same_seed_same_output_regardless_of_batch(tiny_model: Path) -> None:
    prompt = [10, 20, 30, 40, 50]

    def sample_with(seed: int, companions: int) -> list[int]:
        engine = LLMEngine(EngineConfig(model_dir=str(tiny_model)))
        col = Collector()
        for j in range(companions):
            engine.add_request(
                f"c{j}", [7 + j] * (3 + j), SamplingParams(temperature=1.0, max_tokens=30), col.sink(f"c{j}")
            )
        engine.add_request(
            "x", prompt, SamplingParams(temperature=1.0, top_p=0.9, seed=seed, max_tokens=30), col.sink("x")
        )
        run_all(engine)
        return col.tokens("x")

    a = sample_with(1234, 0)
    assert a == sample_with(1234, 5)
    assert a != sample_with(4321, 0)


def test_cancellation_frees_kv_at_next_step(tiny_model: Path) -> None:
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model), page_size=4))
    alloc = engine.runner.allocator
    start = alloc.free_pages
    col = Collector()
    engine.add_request("a", list(range(4, 40)), SamplingParams(max_tokens=500), col.sink("a"))
    for _ in range(5):
        engine.step()
    assert alloc.free_pages < start
    engine.abort("a")
    engine.step()
    assert alloc.free_pages == start
    assert col.final("a").finished and col.final("a").finish_reason == "abort"
    assert not engine.has_work()


def test_long_prefill_is_chunked_and_does_not_stall_decodes(tiny_model: Path) -> None:
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model), prefill_chunk=32, max_batch_tokens=40))
    col = Collector()
    engine.add_request("short", [5, 6, 7], SamplingParams(temperature=0, max_tokens=50), col.sink("short"))
    engine.step()  # prefill + first token
    engine.add_request(
        "long", list(range(4, 300)) * 2, SamplingParams(temperature=0, max_tokens=2), col.sink("long")
    )
    produced = []
    for _ in range(10):
        before = len(col.tokens("short"))
        engine.step()
        produced.append(len(col.tokens("short")) - before)
    assert produced == [1] * 10  # one token every step while the 592-token prompt is prefilled
    assert "long" not in col.outputs  # still prefilling: 10 steps * <= 39 tokens < 592


def test_stop_string_stop_token_and_eos(tiny_model: Path, tiny_model_eos: Path) -> None:
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model)))
    col = Collector()
    prompt = [11, 12, 13, 14]
    engine.add_request(
        "free", prompt, SamplingParams(temperature=1.0, seed=7, max_tokens=40), col.sink("free")
    )
    run_all(engine)
    text, tokens = col.text("free"), col.tokens("free")
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip()
    engine.add_request(
        "s", prompt, SamplingParams(temperature=1.0, seed=7, max_tokens=40, stop=(stop,)), col.sink("s")
    )
    engine.add_request(
        "t",
        prompt,
        SamplingParams(temperature=1.0, seed=7, max_tokens=40, stop_token_ids=(tokens[5],)),
        col.sink("t"),
    )
    run_all(engine)
    assert col.text("s") == text[: text.index(stop)]
    assert col.final("s").finish_reason == "stop"
    assert col.tokens("t") == tokens[: tokens.index(tokens[5]) + 1]
    assert col.final("t").finish_reason == "stop"
    # With EOS ids in the config, greedy generation that hits EOS stops with "stop".
    eng2 = LLMEngine(EngineConfig(model_dir=str(tiny_model_eos)))
    eos = set(eng2.eos_token_ids)
    assert eos
    c = Collector()
    for seed in range(40):
        eng2.add_request(
            f"e{seed}",
            [9, 8, 7],
            SamplingParams(temperature=2.0, seed=seed, max_tokens=60),
            c.sink(f"e{seed}"),
        )
    run_all(eng2)
    finishes = [c.final(f"e{seed}").finish_reason for seed in range(40)]
    for seed, reason in enumerate(finishes):
        toks = c.tokens(f"e{seed}")
        if reason == "stop":
            assert toks[-1] in eos and not eos & set(toks[:-1])
        else:
            assert reason == "length" and len(toks) == 60
    assert "stop" in finishes


def test_prompt_too_long_is_rejected_with_both_numbers(tiny_model: Path) -> None:
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model), max_model_len=64))
    try:
        engine.validate(list(range(4, 54)), SamplingParams(max_tokens=20))
    except ValueError as exc:
        assert "64" in str(exc) and "70" in str(exc)
    else:
        raise AssertionError("expected a rejection")
