"""Byte-level BPE tokenizer of the demo model, trained with ``tokenizers`` on the corpus train split.

Writes ``tokenizer.json`` and a Hugging Face style ``tokenizer_config.json`` (chat template,
special tokens) that both ``dspark_server.models.tokenizer.Tokenizer`` and
``transformers.AutoTokenizer`` load. Byte-level: any UTF-8 text round-trips.

    python -m dspark_server.training.tokenizer_train --corpus work_data/corpus --out work_data/tokenizer
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dspark_server.training.chat_format import (
    CHAT_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    MASK,
    SPECIAL_TOKENS,
)
from dspark_server.training.corpus import read_jsonl


@dataclass(frozen=True)
class TokenizerConfig:
    corpus_dir: str = "work_data/corpus"
    out_dir: str = "work_data/tokenizer"
    vocab_size: int = 6144  # including the special tokens
    min_frequency: int = 2
    max_token_length: int = 24
    model_max_length: int = 4096


def _texts(corpus_dir: str | Path) -> Iterator[str]:
    for d in read_jsonl(Path(corpus_dir) / "train.jsonl"):
        yield d.text


def new_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer_from_texts(
    texts: Iterator[str] | list[str],
    vocab_size: int = 6144,
    min_frequency: int = 2,
    max_token_length: int = 24,
) -> Tokenizer:
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        max_token_length=max_token_length,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_config_dict(tok: Tokenizer, model_max_length: int = 4096) -> dict:
    added = {}
    for tid, t in sorted(tok.get_added_tokens_decoder().items()):
        added[str(tid)] = {
            "content": t.content,
            "lstrip": t.lstrip,
            "normalized": t.normalized,
            "rstrip": t.rstrip,
            "single_word": t.single_word,
            "special": t.special,
        }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END, MASK],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": ENDOFTEXT,
        "errors": "replace",
        "mask_token": MASK,
        "model_max_length": model_max_length,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, model_max_length: int = 4096) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = tokenizer_config_dict(tok, model_max_length)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    special_map = {
        "eos_token": ENDOFTEXT,
        "pad_token": ENDOFTEXT,
        "mask_token": MASK,
        "additional_special_tokens": [IM_START, IM_END, MASK],
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    missing = [t for t, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"tokenizer lacks special tokens {missing}")
    return ids  # type: ignore[return-value]


def train_tokenizer(cfg: TokenizerConfig = TokenizerConfig()) -> Tokenizer:
    t0 = time.time()
    tok = train_tokenizer_from_texts(
        _texts(cfg.corpus_dir), cfg.vocab_size, cfg.min_frequency, cfg.max_token_length
    )
    save_tokenizer(tok, cfg.out_dir, cfg.model_max_length)
    info = {
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "special_ids": special_token_ids(tok),
        "train_seconds": round(time.time() - t0, 1),
    }
    (Path(cfg.out_dir) / "tokenizer_manifest.json").write_text(json.dumps(info, indent=2) + "\n")
    return tok


def main(argv: list[str] | None = None) -> int:
    d = TokenizerConfig()
    p = argparse.ArgumentParser(description="Train the demo byte-level BPE tokenizer.")
    p.add_argument("--corpus", default=d.corpus_dir)
    p.add_argument("--out", default=d.out_dir)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--min-frequency", type=int, default=d.min_frequency)
    a = p.parse_args(argv)
    tok = train_tokenizer(
        TokenizerConfig(
            corpus_dir=a.corpus, out_dir=a.out, vocab_size=a.vocab_size, min_frequency=a.min_frequency
        )
    )
    print(
        json.dumps(
            {"vocab_size": tok.get_vocab_size(with_added_tokens=True), "special_ids": special_token_ids(tok)}
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
