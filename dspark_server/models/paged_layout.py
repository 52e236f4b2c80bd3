"""Where each sequence's queries and keys are, for attention that reads the KV pool in place."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence


@dataclass(frozen=True)
class PagedLayout:
    """A batch of R sequences over a packed [T, ...] query tensor and a slot-addressed pool.

    Sequence r's query rows are ``q_start[r] .. q_start[r] + q_len[r]`` of the packed batch; its key
    position j lives in pool slot ``slots[r, j]`` (padding entries point at slot 0, page 0, which
    is never handed out); query row t sees key positions ``0 .. kv_limit[t] - 1``. All int64.
    ``q_lens`` / ``kv_lens`` repeat q_len and the key counts as Python ints for the PyTorch path.
    """

    q_start: torch.Tensor  # [R]
    q_len: torch.Tensor  # [R]
    slots: torch.Tensor  # [R, Kmax]
    kv_limit: torch.Tensor  # [T]
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @classmethod
    def causal(cls, q_lens: Sequence[int], kv_slots: Sequence[torch.Tensor]) -> PagedLayout:
        """Sequences whose ``q_lens[r]`` new tokens are the last of their ``len(kv_slots[r])`` keys,
        packed in order: query i of sequence r sits at position ``len - q_len + i`` and sees the
        keys up to and including its own (decodes, verification blocks, prefill chunks)."""
        slots = pad_sequence([s.long() for s in kv_slots], batch_first=True)
        return cls.causal_padded(q_lens, [len(s) for s in kv_slots], slots)

    @classmethod
    def causal_padded(cls, q_lens: Sequence[int], kv_lens: Sequence[int], slots: torch.Tensor) -> PagedLayout:
        """``causal`` with the key slots already a padded [R, Kmax] matrix (padding: slot 0)."""
        q_len = torch.tensor(list(q_lens), dtype=torch.long)
        q_start = torch.cumsum(q_len, 0) - q_len
        seq = torch.repeat_interleave(torch.arange(len(q_lens)), q_len)
        first_limit = torch.tensor(list(kv_lens), dtype=torch.long) - q_len + 1
        limit = first_limit[seq] + torch.arange(int(q_len.sum())) - q_start[seq]
        return cls(q_start, q_len, slots.long().contiguous(), limit, tuple(q_lens), tuple(kv_lens))

    @classmethod
    def blocks(cls, slots: torch.Tensor, lens: torch.Tensor, block: int) -> PagedLayout:
        """R blocks of ``block`` queries each (rows r*block ..), every query of block r seeing the
        ``lens[r]`` keys at ``slots[r, :lens[r]]`` (the drafter's context, before its anchor)."""
        r = slots.shape[0]
        counts = lens.long().numpy()  # NumPy: these few vectors cost ~1 µs each, not ~5-10
        return cls(
            q_start=torch.from_numpy(np.arange(r, dtype=np.int64) * block),
            q_len=torch.from_numpy(np.full(r, block, dtype=np.int64)),
            slots=slots.long().contiguous(),
            kv_limit=torch.from_numpy(np.repeat(counts, block)),
            q_lens=(block,) * r,
            kv_lens=tuple(counts.tolist()),
        )

    def seq_slots(self, r: int) -> torch.Tensor:
        return self.slots[r, : self.kv_lens[r]]
