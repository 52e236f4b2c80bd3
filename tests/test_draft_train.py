"""Drafter training pipeline on tiny models: self-distillation, loss, resume, engine round trip."""

from __future__ import annotations

import json
from dataclasses import replace
from operator import itemgetter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dspark_server.config import EngineConfig, SpeculativeConfig
from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.request import RequestOutput, SamplingParams
from dspark_server.models.attention import DenseCausalAttention
from dspark_server.models.drafter_checkpoint import load_drafter
from dspark_server.models.loader import load_target
from dspark_server.training.chat_format import chat_sample
from dspark_server.training.corpus import Document, write_jsonl
from dspark_server.training.distill import (
    DistillConfig,
    distill,
    load_sequences,
    read_records,
    sampling_choice,
    user_turn,
)
from dspark_server.training.draft_batches import BatchOrder, anchor_generator, make_batch, split_heldout
from dspark_server.training.draft_step import batch_loss, target_pass, train_step
from dspark_server.training.draft_train import (
    DrafterArch,
    DraftTrainConfig,
    build_drafter,
    make_optimizer,
    mask_token_id,
    train_draft,
)
from dspark_server.training.losses import LossConfig, gather_rows, label_positions, sample_anchors

FUNCS = "\n\n".join(
    f'def func_{i}(a, b):\n    """Return the {w} of a and b, checked."""\n'
    f"    value = a {op} b\n    if value is None:\n        raise ValueError('no value')\n    return value\n"
    for i, (w, op) in enumerate(
        [
            ("sum", "+"),
            ("difference", "-"),
            ("product", "*"),
            ("quotient", "/"),
            ("remainder", "%"),
            ("power", "**"),
            ("floor quotient", "//"),
            ("bitwise and", "&"),
            ("bitwise or", "|"),
            ("bitwise xor", "^"),
        ]
    )
)
PROSE = "\n\n".join(
    f"Topic {i}\n========\n\nThe topic number {i} is about speculative decoding "
    f"and drafting tokens that a target verifies in one pass. It has {i} parts."
    for i in range(6)
)

ARCH = DrafterArch(gamma=4, head="markov", layers=1, markov_rank=16)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "train.jsonl"
    write_jsonl([Document("code", "pkg/mod.py", FUNCS), Document("prose", "topics.rst.txt", PROSE)], path)
    return path


@pytest.fixture(scope="module")
def distilled(tiny_model_eos: Path, corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> DistillConfig:
    cfg = DistillConfig(
        target_dir=str(tiny_model_eos),
        corpus=str(corpus),
        out_dir=str(tmp_path_factory.mktemp("distill")),
        num_prompts=8,
        max_tokens=24,
        max_prompt_tokens=400,
        greedy_fraction=0.5,
        concurrency=5,
        seed=1,
        threads=1,
        progress=False,
    )
    distill(cfg)
    return cfg


def _generate_alone(engine: LLMEngine, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    outs: list[RequestOutput] = []
    engine.add_request("solo", prompt_ids, params, outs.append)
    while not (outs and outs[-1].finished):
        engine.step()
    return [t for o in outs for t in o.new_token_ids]


def test_user_turn_extracts_only_the_user_message() -> None:
    assert user_turn(chat_sample("Write `f(x)`.", "def f(x):\n    return x")) == "Write `f(x)`."
    assert user_turn([("plain text", True)]) is None


def test_distill_answers_are_the_engines_greedy_answers_with_answer_loss_mask(
    distilled: DistillConfig,
) -> None:
    cfg = distilled
    out = Path(cfg.out_dir)
    recs = sorted(read_records(out / "records.jsonl"), key=lambda r: r["index"])
    assert [r["index"] for r in recs] == list(range(8))
    temps = {r["temperature"] for r in recs}
    assert temps == {0.0, 1.0}, temps  # seed 1 gives a mix
    assert all((r["temperature"], r["seed"]) == sampling_choice(r["index"], cfg) for r in recs)
    engine = LLMEngine(EngineConfig(model_dir=cfg.target_dir, num_threads=1))
    plan = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()[1:]]
    data = load_sequences(out)
    assert len(data) == 8
    for r, p in zip(recs, plan, strict=True):
        # the prompt is the chat-templated user turn only (the corpus answer is not in it)
        assert r["prompt_ids"] == engine.tokenizer.encode_chat([{"role": "user", "content": p["user"]}])
        assert "return value" not in p["user"]  # the corpus answer is not part of the prompt
        ids, mask = data.get(r["index"])
        np.testing.assert_array_equal(ids, r["prompt_ids"] + r["answer_ids"])
        np.testing.assert_array_equal(mask, [0] * len(r["prompt_ids"]) + [1] * len(r["answer_ids"]))
        assert 1 <= len(r["answer_ids"]) <= cfg.max_tokens
        if r["finish_reason"] == "stop":
            assert r["answer_ids"][-1] in engine.eos_token_ids  # the EOS is a supervised answer token
        if r["temperature"] == 0.0:
            solo = _generate_alone(
                engine, r["prompt_ids"], SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens)
            )
            assert r["answer_ids"] == solo
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["sequences"] == 8 and manifest["answer_tokens"] == int(data.mask.sum())


def test_distill_resumes_without_regenerating(distilled: DistillConfig) -> None:
    out = Path(distilled.out_dir)
    before = (out / "records.jsonl").read_text()
    # a torn last line (crash mid-write) is dropped and that prompt regenerated
    lines = before.splitlines(keepends=True)
    (out / "records.jsonl").write_text("".join(lines[:-1]) + lines[-1][:10])
    m = distill(distilled)
    assert m["this_run"]["new_sequences"] == 1 and m["sequences"] == 8
    m2 = distill(distilled)
    assert m2["this_run"]["new_sequences"] == 0
    key = itemgetter("index")
    assert sorted(read_records(out / "records.jsonl"), key=key) == sorted(
        [json.loads(x) for x in before.splitlines()], key=key
    )


def test_training_steps_reduce_the_loss_on_a_fixed_batch(distilled: DistillConfig) -> None:
    torch.manual_seed(0)
    target = load_target(distilled.target_dir)
    drafter = build_drafter(target, mask_token_id(distilled.target_dir), ARCH, seed=0)
    assert drafter.config.mask_token_id == 3 and drafter.config.target_layer_ids == (0,)
    data = load_sequences(distilled.out_dir)
    batch = make_batch(data, [0, 1, 2, 3], seq_len=256)
    cfg = DraftTrainConfig(target_dir="", data="", out_dir="", lr=3e-3)
    opt = make_optimizer(drafter, cfg)
    assert all(not p.requires_grad for p in target.parameters())

    def fixed_loss() -> float:
        with torch.no_grad():
            return float(batch_loss(drafter, target, batch, 8, anchor_generator(0, 0), LossConfig()).res.loss)

    first = fixed_loss()
    emb_before = target.model.embed_tokens.weight.clone()
    for _ in range(12):
        r, gnorm = train_step(drafter, target, opt, batch, 8, anchor_generator(0, 0), 3e-3, LossConfig())
        assert np.isfinite(gnorm) and r.blocks > 0
    assert fixed_loss() < 0.8 * first
    assert torch.equal(target.model.embed_tokens.weight, emb_before)  # target stays frozen


def test_target_pass_rows_equal_the_full_dense_pass(distilled: DistillConfig) -> None:
    target = load_target(distilled.target_dir)
    drafter = build_drafter(target, 3, ARCH)
    batch = make_batch(load_sequences(distilled.out_dir), [0, 5, 2], seq_len=256)
    anchors, valid = sample_anchors(batch.loss_mask, 7, generator=anchor_generator(0, 1))
    feats, block = target_pass(target, drafter, batch.ids, anchors)
    b, s = batch.ids.shape
    full = target(
        batch.ids.reshape(-1),
        torch.arange(s).repeat(b),
        DenseCausalAttention(b, s),
        capture_layers=drafter.capture_layers,
    )
    torch.testing.assert_close(feats, full.hidden.view(b, s, -1))
    want = gather_rows(full.logits.view(b, s, -1), label_positions(anchors, ARCH.gamma) - 1)
    torch.testing.assert_close(block, want, rtol=1e-5, atol=1e-5)


def test_split_and_batch_order_are_deterministic() -> None:
    train, held = split_heldout(100, 0.05, 64)
    assert len(held) == 5 and not set(train) & set(held) and len(train) + len(held) == 100
    order = BatchOrder(train, 8, seed=3)
    first_epoch = [i for s in range(len(train) // 8) for i in order.batch(s)]
    assert len(set(first_epoch)) == len(first_epoch)  # no repeats within an epoch
    assert BatchOrder(train, 8, seed=3).batch(20) == order.batch(20)


def _train_cfg(distilled: DistillConfig, tmp: Path, name: str, **kw: Any) -> DraftTrainConfig:
    args = dict(
        target_dir=distilled.target_dir,
        data=distilled.out_dir,
        out_dir=str(tmp / name / "out"),
        run_dir=str(tmp / name / "run"),
        arch=ARCH,
        steps=4,
        batch_size=3,
        seq_len=256,
        anchors_per_seq=6,
        lr=2e-3,
        eval_every=2,
        eval_fraction=0.25,
        ckpt_every=2,
        threads=1,
        progress=False,
    )
    return DraftTrainConfig(**{**args, **kw})


def test_resumed_run_continues_from_the_saved_step_and_matches_an_uninterrupted_run(
    distilled: DistillConfig, tmp_path: Path
) -> None:
    full = train_draft(_train_cfg(distilled, tmp_path, "a"))
    assert full["status"] == "completed" and full["steps"] == 4
    cut = _train_cfg(distilled, tmp_path, "b", max_minutes=0.0)
    first = train_draft(cut)  # the budget is spent at once: stops after one step, checkpointed
    assert first["status"] == "time budget" and first["steps"] == 1
    state = json.loads((tmp_path / "b" / "run" / "ckpt" / "state.json").read_text())
    assert state["step"] == 1
    with pytest.raises(FileExistsError):
        train_draft(replace(cut, max_minutes=None))
    second = train_draft(replace(cut, max_minutes=None, resume=True))
    assert second["status"] == "completed" and second["steps"] == 4
    log = [json.loads(x) for x in (tmp_path / "b" / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4]  # continued from step 1, not from 0
    a = load_file(str(tmp_path / "a" / "out" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "out" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    assert full["heldout"]["tau"] >= 1.0 and len(full["heldout"]["accept_per_pos"]) == ARCH.gamma


def test_trained_drafter_loads_and_runs_in_the_engine(distilled: DistillConfig, tmp_path: Path) -> None:
    info = train_draft(_train_cfg(distilled, tmp_path, "c", eval_every=0))
    out = Path(tmp_path / "c" / "out")
    assert (out / "training_info.json").is_file() and info["steps"] == 4
    target = load_target(distilled.target_dir)
    d = load_drafter(out, target)
    assert d.gamma == ARCH.gamma and d.config.head_type == "markov"
    prompt = LLMEngine(EngineConfig(model_dir=distilled.target_dir, num_threads=1)).tokenizer.encode_chat(
        [{"role": "user", "content": "Write a Python function `func_1(a, b)`."}]
    )
    params = SamplingParams(temperature=0.0, max_tokens=20)
    plain = _generate_alone(
        LLMEngine(EngineConfig(model_dir=distilled.target_dir, num_threads=1)), prompt, params
    )
    spec_engine = LLMEngine(
        EngineConfig(
            model_dir=distilled.target_dir,
            draft_dir=str(out),
            num_threads=1,
            spec=SpeculativeConfig(mode="fixed"),
        )
    )
    spec = _generate_alone(spec_engine, prompt, params)
    assert spec == plain and len(spec) >= 1
    assert spec_engine.stats.spec_rounds > 0 and spec_engine.stats.spec_verified_tokens > 0
