"""Peer comparison at concurrency 1: our engine vs what a CPU user would otherwise run on the
same checkpoint — Hugging Face ``transformers`` ``generate()``.

    dspark bench --suite peers --prompts humaneval.jsonl --limit 20 --max-tokens 128 \\
        [--model DIR --draft DIR --profile SPS.json] --modes off,dspark --out runs/bench/peers

Systems (all in this process, same torch threads, same prompt token ids from the target's chat
template, greedy, EOS honoured unless ``--ignore-eos``):
  * ``hf_generate``: plain ``model.generate`` with its KV cache;
  * ``hf_assisted``: assisted generation with an assistant made by truncating the target to its
    first ``--assistant-layers`` decoder layers (same embeddings, final norm and LM head; the
    only small model sharing the tokenizer that can be made without training);
  * ``hf_prompt_lookup``: prompt-lookup decoding (n-gram drafts copied from the prompt, no
    assistant model), transformers' other built-in speculative path;
  * ``ours_MODE`` for every ``--modes`` entry: our engine through its own API, one request at
    a time.
Systems run each prompt in turn (interleaved), ``--rounds`` times; tokens/s = generated token
ids / wall seconds (prefill included) summed over prompts. Ratios are ours / theirs.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from dspark_server.bench.common import (
    BenchError,
    SuiteConfig,
    load_prompt_sets,
    machine_info,
    pyplot,
    save_figure,
    write_result,
)
from dspark_server.bench.render import peers_markdown
from dspark_server.config import SpecMode


def _truncated_assistant(model_dir: str, layers: int) -> Any:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    if not 1 <= layers < cfg.num_hidden_layers:
        raise BenchError(f"--assistant-layers must be in 1..{cfg.num_hidden_layers - 1}, got {layers}")
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layers]
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the dropped layers' weights are "unexpected"
    try:
        return AutoModelForCausalLM.from_pretrained(model_dir, config=cfg, dtype=torch.float32).eval()
    finally:
        transformers.logging.set_verbosity(verbosity)


class HFSystem:
    def __init__(
        self,
        name: str,
        description: str,
        model: Any,
        max_tokens: int,
        ignore_eos: bool,
        **generate_kwargs: Any,
    ) -> None:
        self.name, self.description = name, description
        self.model = model
        self.kwargs = dict(max_new_tokens=max_tokens, do_sample=False, **generate_kwargs)
        if ignore_eos:
            self.kwargs["eos_token_id"] = None
            model.generation_config.eos_token_id = None
        pad = model.generation_config.pad_token_id
        self.kwargs["pad_token_id"] = pad if pad is not None else 0

    @torch.inference_mode()
    def run(self, ids: list[int]) -> tuple[list[int], float]:
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        out = self.model.generate(x, attention_mask=torch.ones_like(x), **self.kwargs)
        seconds = time.perf_counter() - t0
        return out[0, len(ids) :].tolist(), seconds


class OurSystem:
    def __init__(self, mode: str, engine: Any, max_tokens: int, ignore_eos: bool) -> None:
        from dspark_server.engine.request import SamplingParams

        self.name = f"ours_{mode}"
        self.description = f"dspark-server engine, --spec-mode {mode}"
        self.engine = engine
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        self._n = 0

    def run(self, ids: list[int]) -> tuple[list[int], float]:
        tokens: list[int] = []
        finished: list[Any] = []

        def sink(out: Any) -> None:
            tokens.extend(out.new_token_ids)
            if out.finished:
                finished.append(out)

        self._n += 1
        t0 = time.perf_counter()
        self.engine.add_request(f"peer-{self._n}", ids, self.params, sink)
        while not finished:
            self.engine.step()
        seconds = time.perf_counter() - t0
        if finished[0].error:
            raise BenchError(f"{self.name} failed: {finished[0].error}")
        return tokens, seconds


@dataclass(frozen=True)
class PeersConfig:
    suite: SuiteConfig
    modes: tuple[SpecMode, ...] = ("off", "dspark")
    assisted: bool = True  # transformers assisted generation with a truncated assistant
    assistant_layers: int = 1


def _our_systems(cfg: PeersConfig) -> list[OurSystem]:
    """One engine per --modes entry, driven through its own API one request at a time."""
    from dspark_server.engine.engine import LLMEngine

    a, base = cfg.suite, cfg.suite.engine
    systems = []
    for mode in cfg.modes:
        if mode != "off" and base.draft_dir is None:
            raise BenchError(f"mode {mode} needs a drafter (--draft DIR)")
        spec = replace(base.spec, mode=mode)
        draft = base.draft_dir if mode != "off" else None
        engine = LLMEngine(replace(base, spec=spec, draft_dir=draft, max_running=4))
        systems.append(OurSystem(mode, engine, a.max_tokens, a.ignore_eos))
    if not systems:
        raise BenchError("--modes names no mode")
    return systems


def _hf_systems(cfg: PeersConfig, notes: list[str]) -> list[HFSystem]:
    """transformers generate(): plain, assisted (truncated assistant), prompt lookup."""
    import transformers
    from transformers import AutoModelForCausalLM

    a, model_dir = cfg.suite, cfg.suite.engine.model_dir
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    plain = "transformers generate(), greedy, KV cache"
    hf = [HFSystem("hf_generate", plain, target, a.max_tokens, a.ignore_eos)]
    if cfg.assisted:
        try:
            assistant = _truncated_assistant(model_dir, cfg.assistant_layers)
            layers = cfg.assistant_layers
            what = f"transformers assisted generation, assistant = target truncated to {layers} layer(s)"
            hf.append(
                HFSystem("hf_assisted", what, target, a.max_tokens, a.ignore_eos, assistant_model=assistant)
            )
        except (BenchError, ValueError, OSError) as exc:
            notes.append(f"no assisted generation: {exc}")
    lookup = "transformers prompt-lookup decoding (10-token n-gram drafts)"
    hf.append(
        HFSystem("hf_prompt_lookup", lookup, target, a.max_tokens, a.ignore_eos, prompt_lookup_num_tokens=10)
    )
    return hf


def _time_systems(
    systems: list[Any], prompts: list[list[int]], rounds: int, progress: bool
) -> tuple[dict[str, dict[str, float]], dict[str, list[list[int]]]]:
    """Every system on every prompt in turn (order rotated per round): token and second totals,
    and the first round's outputs."""
    from tqdm import tqdm

    for s in systems:  # warm-up: first-call allocations, lazy inits
        s.run(prompts[0][:32])
    totals = {s.name: {"tokens": 0, "seconds": 0.0} for s in systems}
    outputs: dict[str, list[list[int]]] = {s.name: [] for s in systems}
    total = rounds * len(prompts) * len(systems)
    with tqdm(total=total, desc="peers", unit="gen", disable=not progress, file=sys.stderr) as bar:
        for rnd in range(rounds):
            order = systems[rnd % len(systems) :] + systems[: rnd % len(systems)]
            for ids in prompts:
                for s in order:
                    toks, secs = s.run(ids)
                    totals[s.name]["tokens"] += len(toks)
                    totals[s.name]["seconds"] += secs
                    if rnd == 0:
                        outputs[s.name].append(toks)
                    bar.update(1)
    return totals, outputs


def run_peers(cfg: PeersConfig) -> dict[str, Any]:
    a, base = cfg.suite, cfg.suite.engine
    if base.num_threads:
        torch.set_num_threads(base.num_threads)
    sets = load_prompt_sets(a.prompt_files, a.limit)
    ours = _our_systems(cfg)
    notes: list[str] = []
    hf = _hf_systems(cfg, notes)
    systems: list[Any] = [*hf, *ours]
    tokenizer = ours[0].engine.tokenizer
    prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for ps in sets for p in ps.prompts]
    totals, outputs = _time_systems(systems, prompts, a.rounds, a.progress)
    rows = [
        {
            "system": s.name,
            "description": s.description,
            "tokens": totals[s.name]["tokens"],
            "seconds": totals[s.name]["seconds"],
            "tokens_per_s": totals[s.name]["tokens"] / totals[s.name]["seconds"],
        }
        for s in systems
    ]
    tps = {r["system"]: r["tokens_per_s"] for r in rows}
    ratios = {f"{o.name} / {h.name}": tps[o.name] / tps[h.name] for o in ours for h in hf}
    ref = outputs["hf_generate"]
    agreement = {
        s.name: sum(x == y for x, y in zip(outputs[s.name], ref, strict=True)) / len(ref)
        for s in systems
        if s.name != "hf_generate"
    }
    notes.append(
        "share of prompts whose greedy output equals hf_generate's token for token: "
        + ", ".join(f"{k} {v:.0%}" for k, v in agreement.items())
        + " (float32 rounding can flip near-ties; speculation itself is lossless)"
    )
    result = {
        "kind": "peers",
        "machine": machine_info(),
        "config": {
            "command": a.command,
            "model": base.model_dir,
            "draft": base.draft_dir,
            "prompt_sets": {ps.name: ps.path for ps in sets},
            "num_prompts": len(prompts),
            "max_tokens": a.max_tokens,
            "rounds": a.rounds,
            "ignore_eos": a.ignore_eos,
            "assistant_layers": cfg.assistant_layers,
        },
        "systems": rows,
        "ratios": ratios,
        "output_agreement_with_hf_generate": agreement,
        "notes": notes,
    }
    write_result(result, Path(a.out), "peers", peers_markdown, _plot, a.plots)
    return result


def _plot(result: dict[str, Any], path: Path) -> None:
    rows = result["systems"]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(1.5 + 1.2 * len(rows), 3.6))
    colors = ["tab:gray" if r["system"].startswith("hf") else "tab:red" for r in rows]
    ax.bar([r["system"] for r in rows], [r["tokens_per_s"] for r in rows], color=colors)
    for i, r in enumerate(rows):
        if math.isfinite(r["tokens_per_s"]):
            ax.text(i, r["tokens_per_s"], f"{r['tokens_per_s']:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("tokens/s (concurrency 1)")
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    ax.grid(alpha=0.3, axis="y")
    save_figure(fig, path)
