"""The training loop both trainers share: evaluation and checkpoint cadence, the log, the
wall-clock budget, Ctrl-C, resuming — on a fake trainer and end to end through train_target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dspark_server.training.loop import (
    EvalReport,
    LoopConfig,
    LoopProgress,
    StepReport,
    run_training_loop,
)


class FakeTrainer:
    def __init__(self, interrupt_at: int | None = None) -> None:
        self.steps: list[int] = []
        self.evals = 0
        self.saved_at: list[int] = []
        self.interrupt_at = interrupt_at
        self.progress = LoopProgress()

    def step(self, index: int) -> StepReport:
        if index == self.interrupt_at:
            raise KeyboardInterrupt
        self.steps.append(index)
        return StepReport({"loss": 1.0 / (index + 1)}, {"loss": "x"}, tokens=10)

    def evaluate(self) -> EvalReport:
        self.evals += 1
        return EvalReport({"loss": 0.5, "at": self.progress.step}, "heldout ok")

    def save(self) -> None:
        self.saved_at.append(self.progress.step)


def _run(t: FakeTrainer, log: Path, **kw: object) -> str:
    cfg = LoopConfig(**{"steps": 7, "eval_every": 3, "ckpt_every": 2, "progress": False, **kw})  # type: ignore[arg-type]
    return run_training_loop(cfg, t.progress, log, t.step, t.evaluate, t.save)


def test_cadence_log_and_counts(tmp_path: Path) -> None:
    t = FakeTrainer()
    assert _run(t, tmp_path / "log.jsonl", eval_at_start=True) == "completed"
    assert t.steps == list(range(7))
    assert t.evals == 1 + 3  # step 0, then steps 3, 6 and the last (7)
    assert t.saved_at == [2, 4, 6, 7]
    lines = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 8))
    assert [r["step"] for r in lines if "heldout" in r] == [3, 6, 7]
    assert lines[2]["heldout"] == {"loss": 0.5, "at": 3} and lines[0]["loss"] == 1.0
    assert t.progress.step == 7 and t.progress.tokens_seen == 70 and t.progress.train_seconds > 0


def test_budget_stops_after_a_step_with_a_checkpoint(tmp_path: Path) -> None:
    t = FakeTrainer()
    assert _run(t, tmp_path / "log.jsonl", max_minutes=0.0) == "time budget"
    assert t.steps == [0] and t.saved_at == [1]


def test_interrupt_saves_a_checkpoint_and_says_so(tmp_path: Path) -> None:
    t = FakeTrainer(interrupt_at=3)
    assert _run(t, tmp_path / "log.jsonl") == "interrupted"
    assert t.progress.step == 3 and t.saved_at == [2, 3]


def test_resume_appends_to_the_log_and_a_fresh_run_replaces_it(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    first = FakeTrainer(interrupt_at=4)
    _run(first, log)
    resumed = FakeTrainer()
    resumed.progress = LoopProgress(step=4)
    assert _run(resumed, log) == "completed"
    assert resumed.steps == [4, 5, 6]
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == list(range(1, 8))
    _run(FakeTrainer(), log, steps=2)
    assert len(log.read_text().splitlines()) == 2


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    from dspark_server.training.tokenizer_train import save_tokenizer, train_tokenizer_from_texts

    code = (
        'def add(a, b):\n    """Add two numbers."""\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n'
    )
    prose = "Python is a programming language. It has modules, classes and functions.\n\n" * 3
    texts = [code, prose] * 10
    tok = train_tokenizer_from_texts(texts, vocab_size=300)
    save_tokenizer(tok, tmp_path / "tokenizer")
    (tmp_path / "corpus").mkdir()
    for split, n in (("train", 8), ("heldout", 2)):
        with (tmp_path / "corpus" / f"{split}.jsonl").open("w") as f:
            for i in range(n):
                kind, text = ("code", code) if i % 2 == 0 else ("prose", prose)
                f.write(json.dumps({"kind": kind, "name": f"{split}/{i}", "text": text}) + "\n")
    return tmp_path


def test_train_target_resumes_through_the_shared_loop(corpus: Path) -> None:
    from dataclasses import replace

    from dspark_server.training.target_data import DataConfig
    from dspark_server.training.target_train import TargetArch, TrainConfig, train_target

    torch.set_num_threads(1)
    data = DataConfig(str(corpus / "corpus"), str(corpus / "tokenizer"), str(corpus / "data"))
    arch = TargetArch(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    base = TrainConfig(
        data=data,
        arch=arch,
        run_dir=str(corpus / "run_a"),
        out_dir=str(corpus / "out_a"),
        steps=6,
        batch_size=2,
        seq_len=32,
        eval_every=3,
        eval_windows=2,
        ckpt_every=2,
        warmup_steps=1,
        threads=1,
        progress=False,
    )
    whole = train_target(base)
    assert whole["status"] == "completed" and whole["steps"] == 6
    cut = replace(base, run_dir=str(corpus / "run_b"), out_dir=str(corpus / "out_b"), max_minutes=0.0)
    first = train_target(cut)
    assert first["status"] == "time budget" and first["steps"] == 1
    second = train_target(replace(cut, max_minutes=None))
    assert second["status"] == "completed" and second["steps"] == 6
    # resumed from the checkpoint of step 1: the same weights as the uninterrupted run
    from safetensors.torch import load_file

    a = load_file(str(corpus / "out_a" / "model.safetensors"))
    b = load_file(str(corpus / "out_b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    log = [json.loads(x) for x in (corpus / "run_b" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 7))
