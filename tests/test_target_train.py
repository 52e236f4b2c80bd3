"""Target training pieces on a tiny model: loss goes down, exports load, checkpoints resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dspark_server.config import ModelConfig
from dspark_server.models.loader import load_target
from dspark_server.training.chat_format import ENDOFTEXT, IM_END, chat_sample, plain_sample
from dspark_server.training.target_data import DataConfig, TokenStream, tokenize_samples
from dspark_server.training.target_train import (
    TargetArch,
    TrainConfig,
    build_model,
    export_model,
    forward_logits,
    greedy_generate,
    load_checkpoint,
    lr_at,
    make_optimizer,
    masked_loss,
    save_checkpoint,
    train_step,
)
from dspark_server.training.tokenizer_train import save_tokenizer, train_tokenizer_from_texts

TEXTS = ["def add(a, b):\n    return a + b\n", "Python is a programming language.\n"] * 30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("tok")
    tok = train_tokenizer_from_texts(TEXTS, vocab_size=300)
    save_tokenizer(tok, d)
    arch = TargetArch(
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    return tok, d, arch


def _batch(tok):
    samples = [chat_sample("Write add.", "def add(a, b):\n    return a + b"), plain_sample(TEXTS[1])] * 4
    ids, mask = tokenize_samples(samples, tok)
    ids_t = torch.from_numpy(ids.astype(np.int64))[: 4 * 17].view(4, 17)
    mask_t = torch.from_numpy(mask.astype(bool))[: 4 * 17].view(4, 17)
    return ids_t[:, :-1], ids_t[:, 1:], mask_t[:, 1:]


def test_tokenize_samples_masks_only_answers(tiny):
    tok = tiny[0]
    ids, mask = tokenize_samples([chat_sample("Hi", "Hello"), plain_sample("abc")], tok)
    text_trained = tok.decode(
        [int(i) for i, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False
    )
    assert text_trained == "Hello" + IM_END + "abc" + ENDOFTEXT
    assert tok.decode([int(i) for i in ids], skip_special_tokens=False).startswith("<|im_start|>user\nHi")


def test_train_step_reduces_loss_and_export_roundtrips(tiny, tmp_path):
    tok, tok_dir, arch = tiny
    model, hf, gen = build_model(arch, tok, seed=0)
    assert hf["architectures"] == ["Qwen3ForCausalLM"] and hf["tie_word_embeddings"] is True
    assert hf["eos_token_id"] == [tok.token_to_id(IM_END), tok.token_to_id(ENDOFTEXT)]
    opt = make_optimizer(model, 1e-2, 0.0)
    x, y, m = _batch(tok)
    with torch.no_grad():
        before = float(masked_loss(forward_logits(model, x), y, m))
    for _ in range(8):
        train_step(model, opt, x, y, m, lr=1e-2)
    with torch.no_grad():
        after = float(masked_loss(forward_logits(model, x), y, m))
    assert after < before - 0.5

    model.eval()
    out = tmp_path / "target"
    export_model(model, out, tok_dir, hf, gen)
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (out / name).is_file()
    cfg = ModelConfig.from_dir(out)
    assert cfg.architecture == "qwen3" and cfg.eos_token_ids == tuple(hf["eos_token_id"])
    loaded = load_target(out)
    with torch.no_grad():
        assert torch.equal(forward_logits(model, x), forward_logits(loaded, x))
    prompt = x[0, :5].tolist()
    assert greedy_generate(model, prompt, 6) == greedy_generate(loaded, prompt, 6)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == hf["eos_token_id"]


def test_checkpoint_resume_is_exact(tiny, tmp_path):
    tok, _, arch = tiny
    x, y, m = _batch(tok)
    model, _, _ = build_model(arch, tok, seed=1)
    opt = make_optimizer(model, 1e-2, 0.1)
    for _ in range(3):
        train_step(model, opt, x, y, m, lr=1e-2)
    save_checkpoint(tmp_path / "ckpt", model, opt, {"step": 3})
    loss_a, _ = train_step(model, opt, x, y, m, lr=1e-2)

    model2, _, _ = build_model(arch, tok, seed=2)
    opt2 = make_optimizer(model2, 1e-2, 0.1)
    assert load_checkpoint(tmp_path / "ckpt", model2, opt2)["step"] == 3
    model2.train()
    loss_b, _ = train_step(model2, opt2, x, y, m, lr=1e-2)
    assert loss_a == pytest.approx(loss_b, abs=1e-6)
    for (n, p), (_, q) in zip(model.named_parameters(), model2.named_parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), n


def test_lr_schedule_and_data_windows(tmp_path):
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1, data=DataConfig())
    assert lr_at(0, cfg) == pytest.approx(1e-4) and lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(100, cfg) == pytest.approx(1e-4)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 100))
    np.save(tmp_path / "train_ids.npy", np.arange(1000, dtype=np.uint16))
    np.save(tmp_path / "train_mask.npy", np.ones(1000, dtype=np.uint8))
    ts = TokenStream(tmp_path, "train")
    x, y, _ = ts.random_batch(4, 16, seed=0, step=5)
    x2, _, _ = ts.random_batch(4, 16, seed=0, step=5)
    assert torch.equal(x, x2) and torch.equal(y[:, :-1], x[:, 1:])
