"""Prompt-lookup drafts: where a request's text repeats itself, the continuation of the latest
earlier occurrence of its current suffix (n-gram matching, as vLLM's and SGLang's ngram
speculators and llama.cpp's lookup decoding do) is proposed instead of the drafter's block.

A small model decoding greedily falls into loops (on HumanEval the demo pair repeats a line such
as ``self.0 = 0`` for a hundred tokens in about one prompt in seven), and there its drafter
accepts about one token per step while the loop predicts the next seven. The proposal is a
deterministic function of the request's tokens so far, so verifying it is lossless as any draft
is: for a sampled row its q is one-hot, accepted with probability p(x) (verify.py); a greedy row
accepts while it equals the target's argmax.

Which source drafts for a request is decided before drafting, from its past only: a moving
average per request of the drafts each source had accepted — the source's own rounds, and for
the lookup also the rounds it only watched (the length of its proposal's common prefix with the
tokens the step emitted, a lower bound of what it would have kept). The drafter then runs only
for the requests it drafts for, and not at all in a step where every request repeats itself.
The planner prices a lookup row by the lookup's own acceptance per block position, counted over
its verified rounds (``confidences``), never by the drafter's confidence head, and the drafter's
calibration never sees these rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dspark_server.engine.request import Request, Status


@dataclass
class _History:
    request: Request
    index: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> its latest end
    indexed: int = 0  # n-grams ending before position indexed - 1 are in the index
    drafter: float = float("nan")  # drafts accepted per drafting round, moving average
    lookup: float = float("nan")  # the same for the lookup's proposals (used or watched)


class PromptLookup:
    def __init__(self, gamma: int, min_n: int = 2, max_n: int = 4, smoothing: float = 0.3) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.gamma, self.min_n, self.max_n, self.smoothing = gamma, min_n, max_n, smoothing
        self._histories: dict[str, _History] = {}
        # per block position k: verified lookup drafts, and those accepted (a Beta(1, 1) prior)
        self._tried = torch.ones(gamma, dtype=torch.float64)
        self._accepted = torch.full((gamma,), 0.5, dtype=torch.float64)
        self._calls = 0

    def propose(self, request: Request) -> list[int]:
        """Up to γ tokens continuing the latest earlier occurrence of the request's longest
        suffix of ``min_n``..``max_n`` tokens (a repetition shorter than γ repeats), or []."""
        h = self._history(request)
        prompt, output = request.prompt_ids, request.output_ids
        n_prompt = len(prompt)
        total = n_prompt + len(output)

        def at(i: int) -> int:
            return prompt[i] if i < n_prompt else output[i - n_prompt]

        def gram(end: int, n: int) -> tuple[int, ...]:  # tokens end - n + 1 .. end, by slicing
            a, b = end - n + 1, end + 1
            if a >= n_prompt:
                return tuple(output[a - n_prompt : b - n_prompt])
            if b <= n_prompt:
                return tuple(prompt[a:b])
            return tuple(prompt[a:]) + tuple(output[: b - n_prompt])

        for end in range(max(h.indexed - 1, 0), total - 1):  # every n-gram but the suffix's
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                h.index[gram(end, n)] = end
        h.indexed = total
        for n in range(min(self.max_n, total), self.min_n - 1, -1):
            start = h.index.get(gram(total - 1, n))
            if start is None:
                continue
            period = total - 1 - start  # the continuation repeats with this period
            return [at(start + 1 + k % period) for k in range(self.gamma)]
        return []

    def prefers(self, request: Request) -> bool:
        """Whether the lookup drafts for this request (when it has a proposal): its proposals have
        kept more than the drafter's blocks."""
        h = self._histories.get(request.request_id)
        if h is None or h.lookup != h.lookup:  # no proposal watched yet (NaN)
            return False
        return h.drafter != h.drafter or h.lookup > h.drafter

    def confidences(self, lengths: Sequence[int]) -> torch.Tensor:
        """[R, γ]: the lookup's acceptance rate at each block position, 0 past a proposal."""
        rate = (self._accepted / self._tried).float()
        out = rate.expand(len(lengths), self.gamma).clone()
        out[torch.arange(self.gamma)[None, :] >= torch.tensor(list(lengths))[:, None]] = 0.0
        return out

    def record(
        self,
        request: Request,
        used_lookup: bool,
        proposal: Sequence[int],
        emitted: Sequence[int],
        verified: int,
    ) -> None:
        """After a step: which source drafted, the lookup's proposal (or []), the tokens emitted
        (accepted drafts + the target's token) and the drafts verified."""
        h = self._history(request)
        accepted = len(emitted) - 1
        if used_lookup:
            tried = min(verified, self.gamma)
            self._tried[: min(accepted + 1, tried)] += 1.0
            self._accepted[:accepted] += 1.0
            h.lookup = _moved(h.lookup, accepted, self.smoothing)
            return
        h.drafter = _moved(h.drafter, accepted, self.smoothing)
        if proposal:
            match = 0
            while match < min(len(proposal), len(emitted)) and proposal[match] == emitted[match]:
                match += 1
            h.lookup = _moved(h.lookup, match, self.smoothing)

    def _history(self, request: Request) -> _History:
        self._calls += 1
        if self._calls % 256 == 0:  # requests that left take their histories along
            self._histories = {
                k: h for k, h in self._histories.items() if h.request.status is not Status.FINISHED
            }
        h = self._histories.get(request.request_id)
        if h is None or h.request is not request:
            h = self._histories[request.request_id] = _History(request)
        return h


def _moved(mean: float, x: float, smoothing: float) -> float:
    return float(x) if mean != mean else (1 - smoothing) * mean + smoothing * x
