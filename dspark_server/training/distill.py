"""Self-distillation data for the DSpark drafter: corpus prompts answered by the target itself.

The drafter learns to predict what the *target* says, so its training sequences are the target's
own answers (the paper regenerates answers with each target). Pipeline:

1. prompts: chat samples of the corpus TRAINING split (``chat_format.build_samples``), of which
   only the user turn is kept (the corpus answer is discarded); deduplicated, in the seeded order
   of ``build_samples``, limited to ``max_prompt_tokens`` tokens once templated. The evaluation
   prompts of ``../shared/prompts`` are never read.
2. a per-prompt plan (``prompts.jsonl``): prompt ids, temperature (0 for a ``greedy_fraction``
   share, else ``temperature``) and sampling seed, all deterministic in ``seed``.
3. generation with the real engine (``LLMEngine``, continuous batching, ``concurrency`` requests in
   flight), one JSON line per finished answer appended to ``records.jsonl``; a rerun skips the
   prompts already answered (resumable; a torn last line is dropped).
4. ``pack``: ``ids.npy`` (int32, all sequences concatenated), ``mask.npy`` (uint8, 1 on answer
   tokens, including the EOS the target emitted), ``offsets.npy`` (int64 [N + 1]),
   ``index.npy`` / ``temperature.npy`` and ``manifest.json``.

    python -m dspark_server.training.distill --target dspark_server/assets/demo/target \\
        --corpus work_data/corpus/train.jsonl --out work_data/draft_data --num-prompts 4000

``load_sequences`` reads a packed directory, a directory with only ``records.jsonl``, or a JSONL
file of records (``prompt_ids`` + ``answer_ids``, or ``token_ids`` + ``loss_mask``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dspark_server.training.chat_format import IM_END, IM_START, build_samples, render_chat

log = logging.getLogger(__name__)

PLAN_FILE = "prompts.jsonl"
RECORDS_FILE = "records.jsonl"
MANIFEST_FILE = "manifest.json"
_USER_PREFIX = f"{IM_START}user\n"
_USER_SUFFIX = f"{IM_END}\n{IM_START}assistant\n"


@dataclass(frozen=True)
class DistillConfig:
    target_dir: str
    corpus: str = "work_data/corpus/train.jsonl"  # corpus TRAINING split (documents JSONL)
    out_dir: str = "work_data/draft_data"
    num_prompts: int = 4000
    max_tokens: int = 160  # answer budget per prompt
    max_prompt_tokens: int = 160  # longer templated prompts are skipped
    greedy_fraction: float = 0.5  # share of prompts answered at temperature 0
    temperature: float = 1.0  # temperature of the other prompts
    concurrency: int = 48
    seed: int = 0
    threads: int | None = None
    progress: bool = True
    max_minutes: float | None = None  # stop (keeping finished answers) after this much wall time

    def plan_key(self) -> dict[str, Any]:
        """Everything the prompt plan depends on (a resumed run must agree on it)."""
        return {
            "corpus": str(Path(self.corpus).resolve()),
            "seed": self.seed,
            "max_tokens": self.max_tokens,
            "max_prompt_tokens": self.max_prompt_tokens,
            "greedy_fraction": self.greedy_fraction,
            "temperature": self.temperature,
        }


@dataclass(frozen=True)
class PromptPlan:
    index: int
    user: str
    prompt_ids: tuple[int, ...]
    temperature: float
    seed: int


# ------------------------------------------------------------------------------------ prompts


def user_turn(sample: list[tuple[str, bool]]) -> str | None:
    """The user message of a ``chat_format.chat_sample`` (None for plain continuation samples)."""
    if not sample or sample[0][1]:
        return None
    prompt = sample[0][0]
    if not (prompt.startswith(_USER_PREFIX) and prompt.endswith(_USER_SUFFIX)):
        return None
    user = prompt[len(_USER_PREFIX) : -len(_USER_SUFFIX)]
    if render_chat([{"role": "user", "content": user}], add_generation_prompt=True) != prompt:
        return None  # not a single user turn
    return user


def corpus_prompts(corpus: str | Path, seed: int = 0) -> list[str]:
    """Unique user turns of the corpus's chat samples, in ``build_samples``' seeded order."""
    from dspark_server.training.corpus import read_jsonl

    docs = read_jsonl(corpus)
    seen: set[str] = set()
    out: list[str] = []
    for sample in build_samples(docs, seed=seed):
        user = user_turn(sample)
        if user and user not in seen:
            seen.add(user)
            out.append(user)
    return out


def sampling_choice(index: int, cfg: DistillConfig) -> tuple[float, int]:
    """(temperature, seed) of prompt ``index``: deterministic in ``cfg.seed`` and the index."""
    u = np.random.default_rng([cfg.seed, index]).random()
    temp = 0.0 if u < cfg.greedy_fraction else cfg.temperature
    return temp, cfg.seed * 1_000_003 + index


EncodeChat = Callable[[list[dict[str, Any]]], list[int]]


def build_plan(
    cfg: DistillConfig, encode_chat: EncodeChat, prompts: list[str] | None = None
) -> list[PromptPlan]:
    """The first ``num_prompts`` corpus prompts that fit ``max_prompt_tokens``.

    ``encode_chat(messages) -> ids`` is the serving tokenizer's ``encode_chat`` so the ids are
    exactly what the engine would see for a ``/v1/chat/completions`` request.
    """
    prompts = corpus_prompts(cfg.corpus, cfg.seed) if prompts is None else prompts
    plan: list[PromptPlan] = []
    for user in prompts:
        if len(plan) >= cfg.num_prompts:
            break
        ids = tuple(encode_chat([{"role": "user", "content": user}]))
        if not ids or len(ids) > cfg.max_prompt_tokens:
            continue
        temp, seed = sampling_choice(len(plan), cfg)
        plan.append(PromptPlan(len(plan), user, ids, temp, seed))
    return plan


def _write_plan(path: Path, cfg: DistillConfig, plan: list[PromptPlan]) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(json.dumps({"plan_key": cfg.plan_key(), "count": len(plan)}) + "\n")
        for p in plan:
            f.write(
                json.dumps(
                    {
                        "index": p.index,
                        "user": p.user,
                        "prompt_ids": list(p.prompt_ids),
                        "temperature": p.temperature,
                        "seed": p.seed,
                    },
                    ensure_ascii=False,
                )
                + "\n"
            )
    tmp.replace(path)


def _read_plan(path: Path) -> tuple[dict[str, Any], list[PromptPlan]]:
    with path.open(encoding="utf-8") as f:
        head = json.loads(f.readline())
        plan = [
            PromptPlan(r["index"], r["user"], tuple(r["prompt_ids"]), float(r["temperature"]), int(r["seed"]))
            for r in map(json.loads, f)
        ]
    return head, plan


def load_or_build_plan(cfg: DistillConfig, encode_chat: EncodeChat) -> list[PromptPlan]:
    """Reuse ``prompts.jsonl`` when it was made with the same settings and is long enough; else
    rebuild it (deterministic, so a longer plan starts with the shorter one)."""
    path = Path(cfg.out_dir) / PLAN_FILE
    if path.is_file():
        head, plan = _read_plan(path)
        if head.get("plan_key") == cfg.plan_key() and len(plan) >= cfg.num_prompts:
            return plan[: cfg.num_prompts]
        if head.get("plan_key") != cfg.plan_key():
            raise ValueError(
                f"{path} was made with other settings ({head.get('plan_key')}); use another "
                f"--out or the same settings ({cfg.plan_key()})"
            )
    plan = build_plan(cfg, encode_chat)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_plan(path, cfg, plan)
    return plan


# ---------------------------------------------------------------------------------- records


def read_records(path: str | Path, repair: bool = False) -> list[dict[str, Any]]:
    """Complete JSON lines of a records file. ``repair`` rewrites the file without a torn tail."""
    p = Path(path)
    if not p.is_file():
        return []
    good: list[str] = []
    bad = False
    with p.open(encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                bad = True
                break
            try:
                json.loads(line)
            except json.JSONDecodeError:
                bad = True
                break
            good.append(line)
    if bad and repair:
        tmp = p.with_suffix(".tmp")
        tmp.write_text("".join(good), encoding="utf-8")
        tmp.replace(p)
    return [json.loads(line) for line in good]


def sequence_of(record: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, loss mask) of one record: prompt (mask 0) then the target's answer (mask 1)."""
    if "token_ids" in record:
        ids = np.asarray(record["token_ids"], dtype=np.int64)
        mask = np.asarray(record["loss_mask"], dtype=np.uint8)
        if mask.shape != ids.shape:
            raise ValueError("record token_ids and loss_mask differ in length")
        return ids, mask
    prompt, answer = record["prompt_ids"], record["answer_ids"]
    ids = np.asarray(list(prompt) + list(answer), dtype=np.int64)
    mask = np.concatenate([np.zeros(len(prompt), np.uint8), np.ones(len(answer), np.uint8)])
    return ids, mask


# ------------------------------------------------------------------------------- generation


def distill(cfg: DistillConfig) -> dict[str, Any]:
    """Generate the missing answers of the plan, then pack everything. Returns the manifest."""
    from tqdm import tqdm

    from dspark_server.config import EngineConfig
    from dspark_server.engine.engine import LLMEngine
    from dspark_server.engine.request import RequestOutput, SamplingParams

    t_start = time.perf_counter()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    max_len = cfg.max_prompt_tokens + cfg.max_tokens + 8
    engine = LLMEngine(
        EngineConfig(
            model_dir=cfg.target_dir,
            max_running=cfg.concurrency,
            max_queued=max(256, 2 * cfg.concurrency),
            max_model_len=max_len,
            num_threads=cfg.threads,
        )
    )
    plan = load_or_build_plan(cfg, engine.tokenizer.encode_chat)
    records_path = out / RECORDS_FILE
    done = {int(r["index"]): r for r in read_records(records_path, repair=True)}
    for i, r in done.items():
        if i >= len(plan) or tuple(r["prompt_ids"]) != plan[i].prompt_ids:
            raise ValueError(
                f"{records_path} holds an answer for prompt {i} that is not in this plan; use another --out"
            )
    todo = [p for p in plan if p.index not in done]
    bar = tqdm(
        total=len(plan),
        initial=len(plan) - len(todo),
        desc="distill",
        unit="seq",
        disable=not cfg.progress,
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=2.0,
    )
    parts: dict[int, list[int]] = {}
    finished: list[tuple[PromptPlan, RequestOutput]] = []
    by_id: dict[str, PromptPlan] = {}
    new_tokens = new_seqs = 0
    errors = 0
    t_gen = time.perf_counter()
    deadline = None if cfg.max_minutes is None else t_start + 60.0 * cfg.max_minutes
    stopped_early = False

    def sink(out_: RequestOutput) -> None:
        p = by_id[out_.request_id]
        parts.setdefault(p.index, []).extend(out_.new_token_ids)
        if out_.finished:
            finished.append((p, out_))

    with records_path.open("a", encoding="utf-8") as f:
        nxt, in_flight = 0, 0
        while nxt < len(todo) or in_flight:
            if deadline is not None and time.perf_counter() > deadline:
                stopped_early = True
                break
            while nxt < len(todo) and in_flight < cfg.concurrency:
                p = todo[nxt]
                rid = f"distill-{p.index}"
                by_id[rid] = p
                params = SamplingParams(temperature=p.temperature, seed=p.seed, max_tokens=cfg.max_tokens)
                engine.add_request(rid, list(p.prompt_ids), params, sink)
                nxt += 1
                in_flight += 1
            engine.step()
            for p, o in finished:
                in_flight -= 1
                answer = parts.pop(p.index)
                if o.error or o.finish_reason in ("error", "abort"):
                    errors += 1
                    log.warning("prompt %d failed: %s", p.index, o.error)
                    continue
                rec = {
                    "index": p.index,
                    "temperature": p.temperature,
                    "seed": p.seed,
                    "finish_reason": o.finish_reason,
                    "prompt_ids": list(p.prompt_ids),
                    "answer_ids": answer,
                }
                f.write(json.dumps(rec) + "\n")
                done[p.index] = rec
                new_tokens += len(answer)
                new_seqs += 1
                bar.update(1)
                bar.set_postfix(tok_s=f"{new_tokens / max(time.perf_counter() - t_gen, 1e-9):.0f}")
            if finished:
                f.flush()
                finished.clear()
    bar.close()
    gen_seconds = time.perf_counter() - t_gen
    if stopped_early:
        log.warning(
            "distill: time budget of %s min reached; %d of %d prompts answered (rerun to continue)",
            cfg.max_minutes,
            len(done),
            len(plan),
        )
    manifest = pack(out, plan_size=len(plan))
    manifest.update(
        {
            "config": asdict(cfg),
            "complete": len(done) == len(plan),
            "errors": errors,
            "this_run": {
                "new_sequences": new_seqs,
                "new_answer_tokens": new_tokens,
                "generate_seconds": round(gen_seconds, 2),
                "answer_tokens_per_s": round(new_tokens / max(gen_seconds, 1e-9), 1),
                "total_seconds": round(time.perf_counter() - t_start, 2),
            },
        }
    )
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def pack(out_dir: str | Path, plan_size: int | None = None) -> dict[str, Any]:
    """records.jsonl -> ids/mask/offsets/index/temperature .npy (sorted by prompt index)."""
    out = Path(out_dir)
    recs = sorted(read_records(out / RECORDS_FILE), key=lambda r: int(r["index"]))
    seqs = [sequence_of(r) for r in recs]
    lens = np.asarray([len(s[0]) for s in seqs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    ids = np.concatenate([s[0] for s in seqs]).astype(np.int32) if seqs else np.zeros(0, np.int32)
    mask = np.concatenate([s[1] for s in seqs]).astype(np.uint8) if seqs else np.zeros(0, np.uint8)
    for name, arr in (
        ("ids", ids),
        ("mask", mask),
        ("offsets", offsets),
        ("index", np.asarray([int(r["index"]) for r in recs], dtype=np.int64)),
        ("temperature", np.asarray([float(r["temperature"]) for r in recs], np.float32)),
    ):
        np.save(out / f"{name}.npy", arr)
    reasons: dict[str, int] = {}
    for r in recs:
        reasons[str(r.get("finish_reason"))] = reasons.get(str(r.get("finish_reason")), 0) + 1
    return {
        "sequences": len(recs),
        "plan_size": plan_size,
        "tokens": int(ids.size),
        "answer_tokens": int(mask.sum()),
        "greedy_sequences": int(sum(1 for r in recs if float(r["temperature"]) == 0.0)),
        "finish_reasons": reasons,
        "mean_answer_tokens": round(float(mask.sum()) / max(1, len(recs)), 1),
    }


# ---------------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class SequenceSet:
    """Variable-length training sequences: ``ids[offsets[i]:offsets[i+1]]`` and the same mask."""

    ids: np.ndarray  # int64 [T]
    mask: np.ndarray  # uint8 [T]
    offsets: np.ndarray  # int64 [N + 1]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def get(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.ids[a:b], self.mask[a:b]

    def subset(self, indices: np.ndarray | list[int]) -> SequenceSet:
        parts = [self.get(int(i)) for i in indices]
        lens = np.asarray([len(p[0]) for p in parts], dtype=np.int64)
        return SequenceSet(
            ids=np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64),
            mask=np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.uint8),
            offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
        )

    @property
    def num_answer_tokens(self) -> int:
        return int(self.mask.sum())


def load_sequences(path: str | Path) -> SequenceSet:
    """A packed directory (``offsets.npy``), a directory with ``records.jsonl``, or a JSONL file."""
    p = Path(path)
    if p.is_dir() and (p / "offsets.npy").is_file():
        packed = SequenceSet(
            ids=np.load(p / "ids.npy").astype(np.int64),
            mask=np.load(p / "mask.npy").astype(np.uint8),
            offsets=np.load(p / "offsets.npy").astype(np.int64),
        )
        n_records = len(read_records(p / RECORDS_FILE)) if (p / RECORDS_FILE).is_file() else len(packed)
        if n_records == len(packed):
            return packed
        log.warning(
            "%s: the packed arrays are stale (%d sequences, records.jsonl has %d); using the records",
            p,
            len(packed),
            n_records,
        )
    if p.is_dir():
        p = p / RECORDS_FILE
    if not p.is_file():
        raise FileNotFoundError(
            f"no distilled data at {path} (expected a directory made by "
            "`python -m dspark_server.training.distill` or a records JSONL file)"
        )
    recs = sorted(read_records(p), key=lambda r: int(r.get("index", 0)))
    seqs = [sequence_of(r) for r in recs]
    lens = np.asarray([len(s[0]) for s in seqs], dtype=np.int64)
    return SequenceSet(
        ids=np.concatenate([s[0] for s in seqs]) if seqs else np.zeros(0, np.int64),
        mask=np.concatenate([s[1] for s in seqs]) if seqs else np.zeros(0, np.uint8),
        offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
    )


# -------------------------------------------------------------------------------------- cli


def main(argv: list[str] | None = None) -> int:
    d = DistillConfig(target_dir="")
    p = argparse.ArgumentParser(
        description="Self-distillation: answer corpus prompts with the target "
        "(resumable) and cache the token ids for drafter training."
    )
    p.add_argument("--target", required=True, help="target model directory")
    p.add_argument("--corpus", default=d.corpus, help="corpus TRAINING split (documents JSONL)")
    p.add_argument("--out", default=d.out_dir)
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    p.add_argument("--greedy-fraction", type=float, default=d.greedy_fraction)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = DistillConfig(
        target_dir=a.target,
        corpus=a.corpus,
        out_dir=a.out,
        num_prompts=a.num_prompts,
        max_tokens=a.max_tokens,
        max_prompt_tokens=a.max_prompt_tokens,
        greedy_fraction=a.greedy_fraction,
        temperature=a.temperature,
        concurrency=a.concurrency,
        seed=a.seed,
        threads=a.threads,
        progress=not a.no_progress,
        max_minutes=a.max_minutes,
    )
    m = distill(cfg)
    print(json.dumps({k: v for k, v in m.items() if k != "config"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
