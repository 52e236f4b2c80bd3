"""The demo target's training data: corpus documents -> chat / plain samples -> one uint16 token
stream per split with a loss mask (cached as .npy), read back as random or fixed packed windows."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from dspark_server.training.chat_format import SampleConfig, Segment, build_samples
from dspark_server.training.corpus import read_jsonl


def tokenize_samples(samples: list[list[Segment]], tok: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate samples into one token stream; mask[i] says whether token i is a loss target."""
    flat = [text for s in samples for text, _ in s]
    flags = [trained for s in samples for _, trained in s]
    encs = tok.encode_batch(flat, add_special_tokens=False)
    lens = np.fromiter((len(e.ids) for e in encs), dtype=np.int64, count=len(encs))
    ids = np.fromiter((i for e in encs for i in e.ids), dtype=np.int64, count=int(lens.sum()))
    mask = np.repeat(np.asarray(flags, dtype=np.uint8), lens)
    if ids.max(initial=0) >= 1 << 16:
        raise ValueError("vocabulary too large for the uint16 token stream")
    return ids.astype(np.uint16), mask


@dataclass(frozen=True)
class DataConfig:
    corpus_dir: str = "work_data/corpus"
    tokenizer_dir: str = "work_data/tokenizer"
    out_dir: str = "work_data/target_data"
    seed: int = 0
    samples: SampleConfig = field(default_factory=SampleConfig)


def prepare_data(cfg: DataConfig = DataConfig(), force: bool = False) -> dict[str, Any]:
    """Write ``{train,heldout}_{ids,mask}.npy`` and ``data_manifest.json``; cached unless ``force``."""
    out = Path(cfg.out_dir)
    manifest_path = out / "data_manifest.json"
    if manifest_path.is_file() and not force:
        return json.loads(manifest_path.read_text())
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(Path(cfg.tokenizer_dir) / "tokenizer.json"))
    manifest: dict[str, Any] = {"config": asdict(cfg)}
    for split in ("train", "heldout"):
        t0 = time.time()
        docs = read_jsonl(Path(cfg.corpus_dir) / f"{split}.jsonl")
        samples = build_samples(docs, seed=cfg.seed, cfg=cfg.samples)
        ids, mask = tokenize_samples(samples, tok)
        np.save(out / f"{split}_ids.npy", ids)
        np.save(out / f"{split}_mask.npy", mask)
        n_chat = sum(1 for s in samples if not s[0][1])
        manifest[split] = {
            "documents": len(docs),
            "samples": len(samples),
            "chat_samples": n_chat,
            "plain_samples": len(samples) - n_chat,
            "tokens": int(ids.size),
            "trained_tokens": int(mask.sum()),
            "bytes": sum(len(t.encode("utf-8")) for s in samples for t, _ in s),
            "seconds": round(time.time() - t0, 1),
        }
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


class TokenStream:
    """Random packed windows of a token stream (with loss mask) for one split."""

    def __init__(self, data_dir: str | Path, split: str) -> None:
        d = Path(data_dir)
        self.ids = torch.from_numpy(np.load(d / f"{split}_ids.npy").astype(np.int64))
        self.mask = torch.from_numpy(np.load(d / f"{split}_mask.npy").astype(np.bool_))

    def windows(self, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        idx = torch.from_numpy(starts)[:, None] + torch.arange(seq_len + 1)[None, :]
        ids = self.ids[idx]
        return ids[:, :-1], ids[:, 1:], self.mask[idx][:, 1:]

    def random_batch(self, batch: int, seq_len: int, seed: int, step: int):
        rng = np.random.default_rng([seed, step])
        starts = rng.integers(0, self.ids.numel() - seq_len - 1, size=batch)
        return self.windows(starts, seq_len)

    def fixed_batches(self, n_windows: int, batch: int, seq_len: int):
        span = self.ids.numel() - seq_len - 1
        n = max(1, min(n_windows, span // seq_len))
        starts = np.linspace(0, span, n).astype(np.int64)
        return [self.windows(starts[i : i + batch], seq_len) for i in range(0, n, batch)]
