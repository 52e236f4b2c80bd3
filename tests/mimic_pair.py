"""A tiny target and a drafter that resembles it only partly (acceptance near one half).

A random tiny drafter almost never agrees with a random tiny target (acceptance ~0.15: the
emitted tokens are then nearly all corrections, and a broken acceptance rule barely shows). This
drafter's Markov head proposes "repeat the previous token" with a fixed strength, the tendency the
tied-embedding target has too, over tempered random base logits; so per-position acceptance is
0.4–0.6 depending on the sampling settings. Its confidence head reads mostly the previous token,
strongly, so a planner fed the wrong token would change which drafts it verifies.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dspark_server.testing.tiny import build_tiny_drafter, build_tiny_model

VOCAB = 8
GAMMA = 3
REPEAT_STRENGTH = 2.0  # Markov bias of proposing x_{k-1} again
BASE_LOGIT_SCALE = 0.3  # tempers the backbone's (random) base logits
# Raw confidence logit added per previous token: confident after even tokens, doubtful after odd.
CONFIDENCE_BY_PREV = (2.5, -1.5, 2.5, -1.5, 2.5, -1.5, 2.5, -1.5)


def build_mimic_pair(root: Path, target_seed: int = 11, draft_seed: int = 12) -> tuple[Path, Path]:
    target = build_tiny_model(
        root / "target", layers=2, with_eos=False, seed=target_seed, vocab_size=VOCAB, init_std=0.2
    )
    draft = build_tiny_drafter(target, root / "draft", gamma=GAMMA, seed=draft_seed)
    path = draft / "model.safetensors"
    tensors = load_file(str(path))
    rank = tensors["markov_head.markov_w1.weight"].shape[1]
    eye = torch.zeros(VOCAB, rank)
    eye[:, :VOCAB] = torch.eye(VOCAB)
    tensors["markov_head.markov_w1.weight"] = eye.clone()
    tensors["markov_head.markov_w2.weight"] = eye * REPEAT_STRENGTH
    tensors["norm.weight"] = tensors["norm.weight"] * BASE_LOGIT_SCALE
    conf = tensors["confidence_head.proj.weight"].clone()  # [1, H + r]: [h_k; W1[x_{k-1}]]
    hidden = conf.shape[1] - rank
    conf[:, :hidden] *= 0.1
    conf[0, hidden : hidden + VOCAB] = torch.tensor(CONFIDENCE_BY_PREV)
    tensors["confidence_head.proj.weight"] = conf
    save_file(tensors, str(path), metadata={"format": "pt"})
    return target, draft
