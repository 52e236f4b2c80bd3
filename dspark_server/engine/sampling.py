"""Temperature / top-k / top-p shaping and seeded sampling.

The one place where sampling settings touch a distribution: the target's p and the drafter's q are
both shaped here, so they cannot drift apart (lossless verification depends on it). Greedy rows
(temperature 0) become one-hot distributions at the argmax, which makes rejection sampling reduce
to "accept while the draft equals the target argmax".

Requests with an explicit ``seed`` sample by the Gumbel-max trick with noise keyed by
(seed, output position): token t is argmax(log p_t + G(seed, t)). The noise does not depend on
the batch, the step or how many tokens a speculative round verified, so a seeded request emits
the same tokens in every speculation mode and at every load (``engine/noise.py``).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dspark_server.engine.noise import NoiseKey, keyed_argmax_rows, row_keys
from dspark_server.engine.request import GREEDY_BELOW, SamplingParams
from dspark_server.engine.uniforms import draw_one, draw_uniforms
from dspark_server.models.kernel_library import load_library
from dspark_server.models.row_ops import row_argmax


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling settings of a batch of rows."""

    temperature: torch.Tensor  # [N] float, 0 = greedy
    top_p: torch.Tensor  # [N] float in (0, 1]
    top_k: torch.Tensor  # [N] long, <= 0 = disabled
    # which shaping steps any row needs (known from the parameters: no tensor op, no sync)
    any_greedy: bool = True
    all_greedy: bool = False
    any_top_k: bool = True
    any_top_p: bool = True

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams]) -> SamplingTensors:
        greedy = [p.temperature < GREEDY_BELOW for p in params]
        # through NumPy: torch.tensor from a short list costs ~4 us, this a third of that
        return cls(
            temperature=torch.from_numpy(np.array([p.temperature for p in params], dtype=np.float32)),
            top_p=torch.from_numpy(np.array([p.top_p for p in params], dtype=np.float32)),
            top_k=torch.from_numpy(np.array([p.top_k for p in params], dtype=np.int64)),
            any_greedy=any(greedy),
            all_greedy=all(greedy),
            any_top_k=any(p.top_k > 0 and not g for p, g in zip(params, greedy, strict=True)),
            any_top_p=any(p.top_p < 1.0 and not g for p, g in zip(params, greedy, strict=True)),
        )

    def repeat_rows(self, counts: torch.Tensor) -> SamplingTensors:
        """Row i repeated counts[i] times (one request's settings for several positions)."""
        return SamplingTensors(
            self.temperature.repeat_interleave(counts),
            self.top_p.repeat_interleave(counts),
            self.top_k.repeat_interleave(counts),
            self.any_greedy,
            self.all_greedy,
            self.any_top_k,
            self.any_top_p,
        )

    @property
    def greedy(self) -> torch.Tensor:
        return self.temperature < GREEDY_BELOW


class SamplingCache:
    """The last batch's ``SamplingTensors``, reused while its rows' parameters are the very same
    objects (a request's ``SamplingParams`` never change): a decoding set stays the same for
    many steps, and building the tensors took ~3% of a plain step at one request on the demo
    pair (a py-spy record)."""

    def __init__(self) -> None:
        self._params: list[SamplingParams] = []
        self._tensors: SamplingTensors | None = None

    def get(self, params: list[SamplingParams]) -> SamplingTensors:
        last, tensors = self._params, self._tensors
        if tensors is not None and len(last) == len(params) and all(map(operator.is_, last, params)):
            return tensors
        self._params, self._tensors = params, SamplingTensors.from_params(params)
        return self._tensors


def shape_probs(logits: torch.Tensor, s: SamplingTensors) -> torch.Tensor:
    """Distributions [N, V] that sampling draws from, after temperature, top-k and top-p."""
    logits = logits.float()
    if not s.any_greedy and not s.any_top_k and not s.any_top_p:  # temperature only: the common case
        return torch.softmax(logits / s.temperature[:, None], dim=-1)
    greedy = s.greedy
    out = torch.empty_like(logits)
    if greedy.any():
        g_logits = logits[greedy]
        onehot = torch.zeros_like(g_logits)
        onehot.scatter_(1, row_argmax(g_logits)[:, None], 1.0)
        out[greedy] = onehot
    rest = ~greedy
    if rest.any():
        scaled = logits[rest] / s.temperature[rest, None]
        scaled = _mask_top_k(scaled, s.top_k[rest])
        probs = torch.softmax(scaled, dim=-1)
        out[rest] = _mask_top_p(probs, s.top_p[rest])
    return out


def _mask_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    k = torch.where(top_k > 0, top_k.clamp(max=logits.shape[-1]), logits.shape[-1])
    if bool((k >= logits.shape[-1]).all()):
        return logits
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def _mask_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Rows with top_p < 1 keep their smallest prefix reaching top_p; the others are left as they
    are (bit for bit: a row is shaped alike whatever the batch around it)."""
    need = top_p < 1.0
    if not bool(need.any()):
        return probs
    sub = probs[need]
    sorted_p, order = sub.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    drop_sorted = mass_before >= top_p[need][:, None]  # keeps the smallest prefix reaching top_p
    drop_sorted[:, 0] = False  # and always the most likely token, whatever top_p rounds to
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    kept = sub.masked_fill(drop, 0.0)
    out = probs.clone()
    out[need] = kept / kept.sum(dim=-1, keepdim=True)
    return out


def sample(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator],
    keys: Sequence[NoiseKey | None] | None = None,
    uniforms: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row of probs [N, V]: seeded rows (a key) by keyed Gumbel-max, the others by
    one inverse-CDF draw with a uniform from their request's own generator (``uniforms`` [N]:
    drawn beforehand, e.g. one call per request for a whole draft block)."""
    if uniforms is None:
        uniforms = draw_uniforms(generators, 1)[:, 0]
    out = inverse_cdf(probs, uniforms)
    keyed = row_keys(keys or (), 1)
    if keyed is not None:
        rows = np.flatnonzero(keyed[0])
        out[rows] = keyed_argmax_rows(probs[rows], keyed[1][rows, 0])
    return out


def _sample_temperature(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    generators: Sequence[torch.Generator],
    keys: Sequence[NoiseKey | None] | None,
) -> torch.Tensor | None:
    """``sample(shape_probs(...), keys=keys)`` for rows that shape by temperature alone, as one
    kernel call (kernels/sample_rows.cpp: the same inverse-CDF draw with the same uniforms, and the
    same keyed draw for seeded rows); None where the kernel library is not available."""
    lib = load_library()
    if lib is None or logits.dtype != torch.float32 or logits.dim() != 2:
        return None
    x = logits.contiguous()
    temps = temperature.float().contiguous()
    uniforms = draw_one(generators)
    out = torch.empty(x.shape[0], dtype=torch.long)
    keyed = row_keys(keys or (), 1)
    flags, table = (None, None) if keyed is None else (keyed[0], np.ascontiguousarray(keyed[1][:, 0]))
    rc = lib.dspark_sample_temperature(
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        temps.data_ptr(),
        uniforms.ctypes.data,
        None if flags is None else flags.ctypes.data,
        None if table is None else table.ctypes.data,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"temperature sampling kernel failed with code {rc}")
    return out


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One draw per row of unnormalised weights [N, V] from uniforms [N] in [0, 1): the first
    index whose cumulative weight exceeds u · total (never a zero-weight index; one-hot rows give
    their hot index whatever u is)."""
    cdf = weights.double().cumsum(dim=1)
    target = (uniforms.double() * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, target, right=True)[:, 0]
    return idx.clamp_(max=weights.shape[1] - 1)


def sample_from_logits(
    logits: torch.Tensor,
    s: SamplingTensors,
    generators: Sequence[torch.Generator],
    keys: Sequence[NoiseKey | None] | None = None,
) -> torch.Tensor:
    if s.all_greedy:
        return row_argmax(logits)
    if not (s.any_greedy or s.any_top_k or s.any_top_p):
        fast = _sample_temperature(logits, s.temperature, generators, keys)
        if fast is not None:
            return fast
    tokens = sample(shape_probs(logits, s), generators, keys)
    if s.any_greedy:
        greedy = s.greedy
        tokens[greedy] = row_argmax(logits[greedy])
    return tokens
