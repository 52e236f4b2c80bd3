"""`dspark train widen`: the K-times wider twin computes what its source computes (issue #16)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_drafter_checkpoint import _load_sglang_parser
from test_engine import Collector, run_all

from dspark_server.config import EngineConfig, ModelConfig, SpeculativeConfig
from dspark_server.engine.batch import SeqChunk, pack
from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.kv_cache import PageAllocator, PageTable
from dspark_server.engine.request import SamplingParams
from dspark_server.models.attention import KVPool
from dspark_server.models.drafter import DraftContext, DSparkDrafter
from dspark_server.models.drafter_checkpoint import load_drafter, read_draft_config
from dspark_server.models.loader import load_target
from dspark_server.models.target import TargetModel
from dspark_server.planner import StsCalibration, save_sts_calibration
from dspark_server.testing.tiny import build_tiny_drafter, build_tiny_model, write_flat_sps_profile
from dspark_server.training import widen
from dspark_server.training.widen import WidenConfig, WidenResult, widen_pair
from dspark_server.training.widen_check import compare_pairs, prefill, sample_ids

TOL = 1e-4
HEADS = ("markov", "gated", "rnn", "none")


def tiled(x: torch.Tensor, k: int, parts: int = 1) -> torch.Tensor:
    """x [..., parts * n] -> each of the ``parts`` segments repeated k times blockwise."""
    return torch.cat([p.repeat(*([1] * (x.dim() - 1)), k) for p in x.chunk(parts, dim=-1)], dim=-1)


class Pairs:
    """Source pairs (one per head type) and their twins, built once per module on demand."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sources: dict[str, tuple[Path, Path]] = {}
        self.twins: dict[tuple[str, int], WidenResult] = {}

    def source(self, head: str) -> tuple[Path, Path]:
        if head not in self.sources:
            d = self.root / head
            target = build_tiny_model(d / "target", layers=3, with_eos=False, seed=5)
            draft = build_tiny_drafter(target, d / "draft", head_type=head, seed=6)
            save_sts_calibration(
                StsCalibration((1.1, 0.9, 1.3, 0.7), "tiny", 10), draft / "sts_calibration.json"
            )
            self.sources[head] = target, draft
        return self.sources[head]

    def twin(self, head: str, k: int) -> WidenResult:
        if (head, k) not in self.twins:
            target, draft = self.source(head)
            cfg = WidenConfig(str(target), str(self.root / f"{head}_x{k}"), str(draft), k)
            self.twins[head, k] = widen_pair(cfg)
        return self.twins[head, k]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Pairs:
    return Pairs(tmp_path_factory.mktemp("widen"))


# --------------------------------------------------------------------------- files and configs


def test_twin_config_sizes_and_copied_files(pairs: Pairs) -> None:
    src_t, src_d = pairs.source("markov")
    twin = pairs.twin("markov", 3)
    a, b = ModelConfig.from_dir(src_t), ModelConfig.from_dir(twin.target_dir)
    assert (b.hidden_size, b.intermediate_size) == (3 * a.hidden_size, 3 * a.intermediate_size)
    assert (b.num_attention_heads, b.num_key_value_heads) == (
        3 * a.num_attention_heads,
        3 * a.num_key_value_heads,
    )
    assert b.head_dim == a.head_dim and not b.tie_word_embeddings and a.tie_word_embeddings
    raw = json.loads((twin.target_dir / "config.json").read_text())
    assert raw["head_dim"] == a.head_dim and raw["tie_word_embeddings"] is False
    tensors = load_file(str(twin.target_dir / "model.safetensors"))
    assert "lm_head.weight" in tensors and twin.target_parameters == sum(t.numel() for t in tensors.values())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (twin.target_dir / name).read_bytes() == (src_t / name).read_bytes()
    assert twin.draft_dir is not None and twin.draft_parameters is not None
    drafted = load_file(str(twin.draft_dir / "model.safetensors"))
    shared = ("embed_tokens.weight", "lm_head.weight")
    assert twin.draft_parameters == sum(t.numel() for n, t in drafted.items() if n not in shared)
    assert (twin.draft_dir / "sts_calibration.json").read_bytes() == (
        src_d / "sts_calibration.json"
    ).read_bytes()
    for d in (twin.target_dir, twin.draft_dir):
        info = json.loads((d / "training_info.json").read_text())
        assert info["widened_copy"] and info["factor"] == 3
        assert "widened copy" in (d / "README.md").read_text()
    dc, dt = read_draft_config(src_d), read_draft_config(twin.draft_dir)
    assert (dt.hidden_size, dt.num_attention_heads, dt.head_dim) == (
        3 * dc.hidden_size,
        3 * dc.num_attention_heads,
        dc.head_dim,
    )
    assert (dt.markov_rank, dt.gamma, dt.target_layer_ids) == (dc.markov_rank, dc.gamma, dc.target_layer_ids)


def test_sglang_and_deepspec_parsers_read_the_twin_drafter(pairs: Pairs) -> None:
    transformers = pytest.importorskip("transformers")
    twin = pairs.twin("rnn", 2)
    assert twin.draft_dir is not None
    raw = json.loads((twin.draft_dir / "config.json").read_text())
    parsed = _load_sglang_parser().parse_dspark_draft_config(draft_hf_config=raw)
    src = read_draft_config(pairs.source("rnn")[1])
    assert parsed.gamma == src.gamma and parsed.target_layer_ids == list(src.target_layer_ids)
    assert parsed.markov_rank == src.markov_rank and parsed.markov_head_type == "rnn"
    hf = transformers.Qwen3Config.from_dict(raw)  # DeepSpec's config class is a Qwen3Config
    assert (hf.hidden_size, hf.head_dim, hf.num_key_value_heads) == (
        2 * src.hidden_size,
        src.head_dim,
        2 * src.num_key_value_heads,
    )
    assert hf.block_size == src.gamma and hf.markov_rank == src.markov_rank
    # DeepSpec's layout: the shared embedding / LM-head copies are in the file, widened
    tensors = load_file(str(twin.draft_dir / "model.safetensors"))
    target = load_file(str(twin.target_dir / "model.safetensors"))
    assert torch.equal(tensors["embed_tokens.weight"], target["model.embed_tokens.weight"])
    assert torch.equal(tensors["lm_head.weight"], target["lm_head.weight"])


def test_unknown_tensors_are_refused() -> None:
    with pytest.raises(ValueError, match="no widening rule"):
        widen.widen_target_tensors(
            {"model.embed_tokens.weight": torch.ones(4, 2), "model.mystery": torch.ones(2)}, 2, True
        )


# --------------------------------------------------------------------------- target logits


def _run(
    model: TargetModel, pool: KVPool, alloc: PageAllocator, chunks: list[SeqChunk], capture: tuple[int, ...]
):  # noqa: ANN202
    for c in chunks:
        assert alloc.reserve(c.table, c.start + len(c.token_ids))
    batch = pack(chunks, alloc)
    with torch.no_grad():
        out = model(batch.input_ids, batch.positions, batch.attention(pool), capture_layers=capture)
    for c in chunks:
        c.table.length = c.start + len(c.token_ids)
    return out


@pytest.mark.parametrize("k", [2, 3])
def test_target_logits_equal_on_prefill_decode_and_ragged_verification(pairs: Pairs, k: int) -> None:
    src_t, _ = pairs.source("markov")
    twin = pairs.twin("markov", k)
    models = [load_target(src_t), load_target(twin.target_dir)]
    vocab, layers = models[0].config.vocab_size, models[0].config.num_hidden_layers
    g = torch.Generator().manual_seed(k)
    seqs = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (40, 31, 26, 19)]
    # step 1: prefill 3 sequences; 2: one-token decodes; 3: ragged verification-shaped blocks
    # (1, 4, 8 tokens, logits for every row) beside a full prefill of the fourth sequence
    hist = [0, 20, 15, 10]
    plan = [
        [(i, 0, hist[i]) for i in (1, 2, 3)],
        [(i, hist[i], 1) for i in (1, 2, 3)],
        [(0, 0, 40), (1, hist[1] + 1, 4), (2, hist[2] + 1, 8), (3, hist[3] + 1, 1)],
    ]
    runs = []
    for m in models:
        cfg = m.config
        alloc = PageAllocator(num_pages=32, page_size=4)
        pool = KVPool(
            cfg.num_hidden_layers, alloc.num_slots, cfg.num_key_value_heads, cfg.head_dim, torch.float32
        )
        tables = [PageTable() for _ in seqs]
        runs.append(
            [
                _run(
                    m,
                    pool,
                    alloc,
                    [SeqChunk(tables[i], s, seqs[i][s : s + n]) for i, s, n in step],
                    tuple(range(layers)),
                )
                for step in plan
            ]
        )
    for step, (a, b) in enumerate(zip(*runs, strict=True)):
        assert a.logits.shape == b.logits.shape, step
        diff = float((a.logits - b.logits).abs().max())
        assert diff < TOL, f"step {step}: max |logit difference| {diff}"
        assert a.hidden is not None and b.hidden is not None
        torch.testing.assert_close(
            b.hidden, tiled(a.hidden, k, layers), atol=TOL, rtol=TOL
        )  # residual stream = K copies


def test_transformers_runs_the_twin_like_the_source(pairs: Pairs) -> None:
    """An ordinary HF Qwen3 directory: transformers' own GQA mapping gives the source's logits."""
    transformers = pytest.importorskip("transformers")
    src_t, _ = pairs.source("markov")
    twin = pairs.twin("markov", 2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(twin.target_dir, dtype=torch.float32).eval()
    assert not hf.config.tie_word_embeddings
    ids = sample_ids(hf.config.vocab_size, 30)
    with torch.no_grad():
        got = hf(ids[None]).logits[0]
    ref = prefill(load_target(src_t), ids).logits
    torch.testing.assert_close(got, ref, atol=TOL, rtol=TOL)


def test_llama_with_attention_biases_widens_too(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        attention_bias=True,
        max_position_embeddings=128,
    )
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)  # transformers initialises biases to zero
    model.save_pretrained(tmp_path / "src", safe_serialization=True)
    twin = widen_pair(WidenConfig(str(tmp_path / "src"), str(tmp_path / "twin"), None, 3))
    assert twin.draft_dir is None and ModelConfig.from_dir(twin.target_dir).architecture == "llama"
    assert compare_pairs(tmp_path / "src", None, twin.target_dir, None).target_logits < TOL


def test_gqa_order_matters(pairs: Pairs, tmp_path: Path) -> None:
    """The check is sensitive: kv heads repeated interleaved while query heads are repeated
    blockwise pair query copies with the wrong kv heads, and the logits change."""
    src_t, _ = pairs.source("markov")
    twin = pairs.twin("markov", 2)
    cfg = ModelConfig.from_dir(src_t)
    tensors = load_file(str(twin.target_dir / "model.safetensors"))
    for name in list(tensors):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            w = tensors[name].view(2, cfg.num_key_value_heads, cfg.head_dim, -1)
            tensors[name] = (
                w.transpose(0, 1).reshape(2 * cfg.num_key_value_heads * cfg.head_dim, -1).contiguous()
            )
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_bytes((twin.target_dir / "config.json").read_bytes())
    save_file(tensors, str(bad / "model.safetensors"))
    assert compare_pairs(src_t, None, twin.target_dir, None).target_logits < TOL
    assert compare_pairs(src_t, None, bad, None).target_logits > 1e-2


# --------------------------------------------------------------------------- drafter


def _drafter_pass(
    target: TargetModel, drafter: DSparkDrafter, ids: torch.Tensor, anchors: list[int]
) -> dict[str, torch.Tensor]:
    n = len(ids)
    out = prefill(target, ids, drafter.capture_layers)
    pool = drafter.new_kv_pool(n)
    drafter.write_context(out.hidden[:20], torch.arange(20), torch.arange(20), pool)
    drafter.write_context(out.hidden[20:], torch.arange(20, n), torch.arange(20, n), pool)
    a = torch.tensor(anchors)
    ctx = DraftContext.from_slot_lists([torch.arange(x) for x in anchors])
    block = drafter.backbone(ids[a], a, ctx, pool)
    state = drafter.init_head_state(block.hidden[:, 0])
    prev = ids[a]
    res: dict[str, torch.Tensor] = {"hidden": block.hidden, "base": block.logits}
    biases, logits = [], []
    for k in range(drafter.gamma):  # teacher-forced previous tokens: the data
        bias, _ = drafter.head_step(prev, block.hidden[:, k], state)
        step, state = drafter.step_logits(block.logits[:, k], prev, block.hidden[:, k], state)
        biases.append(bias)
        logits.append(step)
        prev = ids[a + k + 1]
    res["bias"], res["logits"] = torch.stack(biases, 1), torch.stack(logits, 1)
    prevs = torch.stack([ids[a + k] for k in range(drafter.gamma)], 1)
    conf = drafter.confidence_logits(block.hidden, prevs)
    if conf is not None:
        res["confidence"] = conf
    res["greedy"], _ = drafter.greedy_draft(block, ids[a])
    return res


@pytest.mark.parametrize(("head", "k"), [(h, 2) for h in HEADS] + [("markov", 3)])
def test_drafter_block_logits_markov_bias_and_confidences_equal(pairs: Pairs, head: str, k: int) -> None:
    src_t, src_d = pairs.source(head)
    twin = pairs.twin(head, k)
    assert twin.draft_dir is not None
    ta, tb = load_target(src_t), load_target(twin.target_dir)
    da, db = load_drafter(src_d, ta), load_drafter(twin.draft_dir, tb)
    ids = sample_ids(ta.config.vocab_size, 40, seed=k)
    ra, rb = (_drafter_pass(t, d, ids, [3, 17, 29]) for t, d in ((ta, da), (tb, db)))
    assert ra.keys() == rb.keys() and ("confidence" in ra) == da.config.enable_confidence_head
    torch.testing.assert_close(rb.pop("hidden"), tiled(ra.pop("hidden"), k), atol=TOL, rtol=TOL)
    assert torch.equal(ra.pop("greedy"), rb.pop("greedy"))
    for name in ra:
        diff = float((ra[name] - rb[name]).abs().max())
        assert diff < TOL, f"{name}: max |difference| {diff}"
    diff = compare_pairs(src_t, src_d, twin.target_dir, twin.draft_dir)  # the training path too
    assert max(diff.target_logits, diff.draft_logits or 0.0, diff.confidence_logits or 0.0) < TOL


# --------------------------------------------------------------------------- generation


def _engine(target: Path, draft: Path | None, mode: str) -> LLMEngine:
    # a flat SPS profile (verifying more costs nothing): the planner's choices do not depend on
    # start-up timings, so dspark mode verifies drafts on every machine
    profile = write_flat_sps_profile(target.parent / "flat_sps.json")
    spec = SpeculativeConfig(
        mode=mode if draft else "off",  # type: ignore[arg-type]
        draft_gate=False,
        price_step_overhead=False,
        profile_path=str(profile),
    )
    cfg = EngineConfig(
        model_dir=str(target), draft_dir=str(draft) if draft else None, dtype="float32", spec=spec
    )
    return LLMEngine(cfg)


def _generate(engine: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    col = Collector()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=n), col.sink(str(i)))
    run_all(engine)
    return [col.tokens(str(i)) for i in range(len(prompts))]


def test_greedy_speculative_generation_is_identical_on_both_pairs(tmp_path: Path) -> None:
    # a small vocabulary so that random drafts are sometimes accepted (as in test_speculative)
    target = build_tiny_model(tmp_path / "target", layers=3, with_eos=False, seed=5, vocab_size=24)
    draft = build_tiny_drafter(target, tmp_path / "draft", gamma=4, seed=6)
    twin = widen_pair(WidenConfig(str(target), str(tmp_path / "twin"), str(draft), 2))
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 24) for _ in range(rng.randrange(2, 30))] for _ in range(6)]
    plain = _generate(_engine(target, None, "off"), prompts, 64)
    for mode in ("fixed", "dspark"):
        outs = []
        for t, d in ((target, draft), (twin.target_dir, twin.draft_dir)):
            engine = _engine(t, d, mode)
            outs.append(_generate(engine, prompts, 64))
            assert engine.stats.spec_rounds > 0 and engine.stats.spec_accepted_tokens > 0, mode
        assert outs[0] == outs[1] == plain, mode


# --------------------------------------------------------------------------- the demo pair


def test_cli_widens_the_bundled_pair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dspark_server.assets import DEMO_DRAFT, DEMO_TARGET

    assert widen.main(["--factor", "2", "--out", str(tmp_path), "--no-check"]) == 0
    assert "target:" in capsys.readouterr().out
    cfg = ModelConfig.from_dir(tmp_path / "target")
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        512,
        8,
        4,
        64,
    )
    for name in ("sts_calibration.json", "sts_calibration_greedy.json"):
        assert (tmp_path / "draft" / name).read_bytes() == (DEMO_DRAFT / name).read_bytes()
    diff = compare_pairs(DEMO_TARGET, DEMO_DRAFT, tmp_path / "target", tmp_path / "draft")
    assert (
        diff.target_logits < TOL
        and (diff.draft_logits or 1.0) < TOL
        and (diff.confidence_logits or 1.0) < TOL
    )
