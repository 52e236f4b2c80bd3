"""DSpark drafter: heads, block attention masking, and serving path == training path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dspark_server.config import ModelConfig
from dspark_server.models import layer_ops
from dspark_server.models.attention import DenseCausalAttention
from dspark_server.models.drafter import DraftContext, DSparkDrafter
from dspark_server.models.drafter_config import DraftConfig, default_target_layer_ids
from dspark_server.models.kernel_library import load_library
from dspark_server.models.target import TargetModel
from dspark_server.training.losses import (
    LossConfig,
    block_labels,
    dspark_loss,
    gather_rows,
    label_positions,
    sample_anchors,
)

V, H, S = 97, 64, 24


def make_target(seed: int = 0, tied: bool = False) -> TargetModel:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        architecture="qwen3",
        vocab_size=V,
        hidden_size=H,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
    )
    target = TargetModel(cfg)
    with torch.no_grad():
        for p in target.parameters():
            p.normal_(0, 0.3)
    return target.eval().requires_grad_(False)


def make_drafter(
    target: TargetModel, head: str = "markov", seed: int = 1, gamma: int = 5, confidence: bool = True
) -> DSparkDrafter:
    torch.manual_seed(seed)
    cfg = DraftConfig.from_target(
        target.config,
        mask_token_id=V - 1,
        num_layers=2,
        target_layer_ids=(0, 2),
        gamma=gamma,
        head_type=head,
        markov_rank=8,
        confidence=confidence,
        intermediate_size=80,
    )
    d = DSparkDrafter(cfg, target)
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0, 0.3)
    return d.eval()


def data(seed: int = 2, b: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V - 1, (b, S), generator=g), torch.randn(b, S, 2 * H, generator=g)


HEADS = ["markov", "gated", "rnn", "none"]


@pytest.mark.parametrize("head", HEADS)
def test_parameter_names_follow_deepspec(head: str) -> None:
    names = set(make_drafter(make_target(), head).state_dict())
    assert {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "layers.1.self_attn.k_norm.weight",
        "layers.0.mlp.gate_proj.weight",
        "layers.0.post_attention_layernorm.weight",
    } <= names
    assert not any(n.startswith(("embed_tokens", "lm_head", "rotary_emb")) for n in names)
    extra = {
        "markov": {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"},
        "gated": {"markov_head.gate_proj.weight", "markov_head.gate_proj.bias"},
        "rnn": {"markov_head.joint_proj.weight", "markov_head.joint_proj.bias"},
        "none": set(),
    }[head]
    assert extra <= names
    conf_in = make_drafter(make_target(), head).confidence_head.proj.weight.shape[1]
    assert conf_in == (H if head == "none" else H + 8)  # [h] or [h; W1[x_{k-1}]]
    if head == "none":
        assert not any(n.startswith("markov_head") for n in names)
    assert "confidence_head.proj.bias" in names
    off = set(make_drafter(make_target(), head, confidence=False).state_dict())
    assert not any(n.startswith("confidence_head") for n in off)


@pytest.mark.parametrize("head", HEADS)
def test_head_step_and_confidence_shapes(head: str) -> None:
    d = make_drafter(make_target(), head)
    r = 3
    hidden = torch.randn(r, H)
    state = d.init_head_state(hidden)
    assert (state is None) == (head != "rnn")
    prev = torch.tensor([1, 2, 3])
    bias, state2 = d.head_step(prev, hidden, state)
    assert bias.shape == (r, V)
    if head == "rnn":
        assert state2 is not None and state2.shape == (r, 8) and not torch.equal(state2, state)
    if head == "none":
        assert torch.count_nonzero(bias) == 0
    conf = d.confidence_logits(torch.randn(r, 5, H), torch.randint(0, V, (r, 5)))
    assert conf is not None and conf.shape == (r, 5) and conf.dtype == torch.float32
    assert make_drafter(make_target(), head, confidence=False).confidence_logits(hidden, prev) is None


def test_markov_bias_depends_only_on_previous_token() -> None:
    d = make_drafter(make_target(), "markov")
    prev = torch.tensor([4, 4, 9])
    b, _ = d.head_step(prev, torch.randn(3, H), None)
    torch.testing.assert_close(b[0], b[1])  # same x_{k-1}, different h_k
    assert not torch.allclose(b[0], b[2])
    w1, w2 = d.markov_head.markov_w1.weight, d.markov_head.markov_w2.weight
    torch.testing.assert_close(b, w1[prev] @ w2.T)


def test_gated_and_rnn_heads_match_their_formulas() -> None:
    t = make_target()
    prev, h = torch.tensor([3, 7]), torch.randn(2, H)
    g = make_drafter(t, "gated").markov_head
    e = g.markov_w1.weight[prev]
    gate = torch.sigmoid(torch.cat([h, e], -1) @ g.gate_proj.weight.T + g.gate_proj.bias)
    torch.testing.assert_close(g.step(prev, h, None)[0], (gate * e) @ g.markov_w2.weight.T)
    rnn = make_drafter(t, "rnn").markov_head
    s0 = torch.randn(2, 8)
    e = rnn.markov_w1.weight[prev]
    gr, cr, orr = (torch.cat([s0, e, h], -1) @ rnn.joint_proj.weight.T + rnn.joint_proj.bias).chunk(3, -1)
    s1 = torch.sigmoid(gr) * s0 + (1 - torch.sigmoid(gr)) * torch.tanh(cr)
    bias, state = rnn.step(prev, h, s0)
    torch.testing.assert_close(state, s1)
    torch.testing.assert_close(bias, torch.tanh(orr) @ rnn.markov_w2.weight.T)


def test_confidence_logit_formula() -> None:
    d = make_drafter(make_target(), "markov")
    h, prev = torch.randn(4, H), torch.tensor([1, 5, 5, 8])
    feats = torch.cat([h, d.markov_head.markov_w1.weight[prev]], -1)
    ref = feats @ d.confidence_head.proj.weight[0] + d.confidence_head.proj.bias
    torch.testing.assert_close(d.confidence_logits(h, prev), ref)


@pytest.mark.parametrize("layers", ["fused", "kernels", "torch"])
@pytest.mark.parametrize("head", HEADS)
def test_serving_path_matches_training_path(head: str, layers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Context K/V written to a pool in two commits + batched backbone == forward_train, with
    the block pass as one fused call, the serving layers on the element-wise kernels, or on
    PyTorch ops."""
    target = make_target()
    d = make_drafter(target, head)
    lib = load_library()
    if layers != "torch":
        if lib is None:
            pytest.skip("the C++ kernel library could not be built")
        target.fuse_projections()  # the shared LM head in its serving layout, as when serving
        d.fuse_projections()
        d.use_kernels(lib, fused=layers == "fused")
        assert (d._fused is not None) == (layers == "fused")
        assert (d._fused_context is not None) == (layers == "fused")
    calls: list[int] = []
    real = layer_ops.qk_norm_rope_store
    monkeypatch.setattr(layer_ops, "qk_norm_rope_store", lambda *a: calls.append(1) or real(*a))
    ids, feats = data(b=1)
    anchors = torch.tensor([[0, 3, 11, 20]])  # 20 + gamma runs past S
    train = d.forward_train(feats, ids, anchors)
    pool = d.new_kv_pool(64)
    slots = torch.randperm(60)[:S] + 4  # scattered, like pages of a page table
    d.write_context(feats[0, :13], torch.arange(13), slots[:13], pool)
    d.write_context(feats[0, 13:], torch.arange(13, S), slots[13:], pool)
    a = anchors[0]
    ctx = DraftContext.from_slot_lists([slots[: int(x)] for x in a])
    block = d.backbone(ids[0, a], a, ctx, pool)
    torch.testing.assert_close(block.hidden, train.hidden[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(block.logits, d.base_logits(train.hidden[0]), atol=1e-4, rtol=1e-4)
    # U = target lm_head applied to the drafter's normed output, NOT the target's final norm.
    torch.testing.assert_close(block.logits, block.hidden @ d.shared.lm_head.weight.T)
    # Teacher forcing: x_{k-1} = anchor token, then the data tokens (clamped past the end).
    expect_prev = ids[0, (a[:, None] + torch.arange(d.gamma)).clamp(max=S - 1)]
    assert torch.equal(train.prev_tokens[0], expect_prev)
    # The per-step head with teacher-forced x_{k-1} reproduces the training logits U_k + B_k.
    state = d.init_head_state(block.hidden[:, 0])
    for k in range(d.gamma):
        step, state = d.step_logits(block.logits[:, k], train.prev_tokens[0, :, k], block.hidden[:, k], state)
        torch.testing.assert_close(step, train.logits[0, :, k], atol=1e-4, rtol=1e-4)
    if head != "none":
        torch.testing.assert_close(
            d.confidence_logits(block.hidden, train.prev_tokens[0]),
            train.confidence_logits[0],
            atol=1e-5,
            rtol=1e-5,
        )
    # kernels: 2 layers x (2 context writes + 1 backbone); fused: the context writes and the
    # backbone are one call each into the library; none on the PyTorch path
    assert len(calls) == {"fused": 0, "kernels": 6, "torch": 0}[layers]


def test_training_block_sees_only_its_context_prefix() -> None:
    d = make_drafter(make_target(), "rnn")
    ids, feats = data(b=2)
    anchors = torch.tensor([[4, 12], [6, 15]])
    base = d.forward_train(feats, ids, anchors).hidden
    # Features at positions >= 12 and tokens after the anchor 12 (sequence 0) may change only
    # nothing that the blocks see: block 0 (anchor 4) and block 1 (anchor 12) are unchanged.
    ids2, feats2 = ids.clone(), feats.clone()
    feats2[0, 12:] += 5.0
    ids2[0, 13:] = (ids2[0, 13:] + 1) % (V - 1)
    out = d.forward_train(feats2, ids2, anchors).hidden
    torch.testing.assert_close(out, base)
    # A feature between the anchors changes the later block only; other sequences never change.
    feats3 = feats.clone()
    feats3[0, 8] += 5.0
    out = d.forward_train(feats3, ids, anchors).hidden
    torch.testing.assert_close(out[0, 0], base[0, 0])
    assert not torch.allclose(out[0, 1], base[0, 1])
    torch.testing.assert_close(out[1], base[1])


def test_block_attention_is_bidirectional() -> None:
    """The anchor row attends to the mask tokens after it: changing the mask token changes it."""
    t = make_target()
    d = make_drafter(t, "markov")
    d2 = DSparkDrafter(dataclasses.replace(d.config, mask_token_id=5), t)
    d2.load_state_dict(d.state_dict())
    ids, feats = data(b=1)
    anchors = torch.tensor([[7]])
    h1 = d.forward_train(feats, ids, anchors).hidden[0, 0]
    h2 = d2.forward_train(feats, ids, anchors).hidden[0, 0]
    assert not torch.allclose(h1[0], h2[0], atol=1e-4)


def test_serving_requests_are_isolated() -> None:
    d = make_drafter(make_target(), "markov")
    ids, feats = data(b=2)
    pool = d.new_kv_pool(80)
    slots = [torch.arange(8, 8 + S), torch.arange(40, 40 + S)]
    for r in range(2):
        d.write_context(feats[r], torch.arange(S), slots[r], pool)
    a = torch.tensor([5, 17])
    ctx = DraftContext.from_slot_lists([slots[0][:5], slots[1][:17]])
    base = d.backbone(ids[[0, 1], a], a, ctx, pool)
    # Request 1's cache, request 0's positions >= its anchor, and padding slot 0 hold garbage.
    pool.k[:, 40:80] += 3.0
    pool.v[:, slots[0][5:]] -= 2.0
    pool.k[:, 0] = 100.0
    out = d.backbone(torch.tensor([ids[0, 5], 3]), a, ctx, pool)
    torch.testing.assert_close(out.hidden[0], base.hidden[0])
    torch.testing.assert_close(out.logits[0], base.logits[0])
    assert not torch.allclose(out.hidden[1], base.hidden[1])
    alone = d.backbone(ids[0, 5:6], a[:1], DraftContext.from_slot_lists([slots[0][:5]]), pool)
    torch.testing.assert_close(alone.hidden[0], base.hidden[0], atol=1e-5, rtol=1e-5)


def test_greedy_draft_follows_markov_corrected_argmax() -> None:
    d = make_drafter(make_target(), "markov")
    ids, feats = data(b=1)
    pool = d.new_kv_pool(32)
    d.write_context(feats[0], torch.arange(S), torch.arange(S), pool)
    a = torch.tensor([9, 0])
    block = d.backbone(ids[0, a], a, DraftContext.from_slot_lists([torch.arange(9), torch.arange(0)]), pool)
    tokens, conf = d.greedy_draft(block, ids[0, a])
    assert tokens.shape == (2, d.gamma) and conf is not None and conf.shape == (2, d.gamma)
    w1, w2 = d.markov_head.markov_w1.weight, d.markov_head.markov_w2.weight
    prev = ids[0, a]
    for k in range(d.gamma):
        expect = (block.logits[:, k] + w1[prev] @ w2.T).argmax(-1)
        assert torch.equal(tokens[:, k], expect)
        prev = expect


def _kernel_drafter(head: str) -> DSparkDrafter:
    """A γ = 7 drafter with the given head, serving through the C++ kernels (skips without them)."""
    lib = load_library()
    if lib is None:
        pytest.skip("the C++ kernel library could not be built")
    d = make_drafter(make_target(), head, gamma=7)
    d.use_kernels(lib)
    return d


@pytest.mark.parametrize("head", ["markov", "gated"])
def test_greedy_block_kernel_equals_the_position_by_position_loop(head: str) -> None:
    """The one-call greedy draft gives the tokens of step_logits + argmax at every position, for
    every request of the block (vanilla head); heads with another latent decline it (None)."""
    d = _kernel_drafter(head)
    g = torch.Generator().manual_seed(5)
    base = torch.randn(6, 7, V, generator=g) * 3
    anchors = torch.randint(0, V, (6,), generator=g)
    got = d.greedy_tokens(base, anchors)
    if head != "markov":
        assert got is None
        return
    assert got is not None and got.shape == (6, 7)
    prev, state = anchors, d.init_head_state(torch.zeros(6, H))
    for k in range(7):
        logits, state = d.step_logits(base[:, k], prev, torch.zeros(6, H), state)
        prev = logits.argmax(dim=-1)
        assert torch.equal(got[:, k], prev), k
    assert len(set(got.flatten().tolist())) > 5  # the test distinguishes rows and positions


@pytest.mark.parametrize("head", ["markov", "gated"])
def test_sampled_block_kernel_equals_the_position_by_position_loop(head: str) -> None:
    """The one-call sampled draft gives, with the same uniforms, the tokens and distributions of
    step_logits + shape_probs (temperature only) + inverse_cdf at every position, per-row
    temperatures included; heads with another latent decline it (None)."""
    from dspark_server.engine.request import SamplingParams
    from dspark_server.engine.sampling import SamplingTensors, inverse_cdf, shape_probs

    d = _kernel_drafter(head)
    g = torch.Generator().manual_seed(6)
    rows = 6
    base = torch.randn(rows, 7, V, generator=g) * 3
    anchors = torch.randint(0, V, (rows,), generator=g)
    temps = [0.3, 0.7, 1.0, 1.0, 1.6, 0.9]
    uniforms = torch.rand(rows, 7, generator=g)
    got = d.sampled_tokens(base, anchors, torch.tensor(temps), uniforms)
    if head != "markov":
        assert got is None
        return
    assert got is not None
    tokens, probs = got
    assert tokens.shape == (rows, 7) and probs.shape == (rows, 7, V)
    sampling = SamplingTensors.from_params([SamplingParams(temperature=t) for t in temps])
    prev, state = anchors, d.init_head_state(torch.zeros(rows, H))
    for k in range(7):
        logits, state = d.step_logits(base[:, k], prev, torch.zeros(rows, H), state)
        q = shape_probs(logits, sampling)
        torch.testing.assert_close(probs[:, k], q, atol=1e-6, rtol=1e-4)
        prev = inverse_cdf(q, uniforms[:, k])
        assert torch.equal(tokens[:, k], prev), k
    assert len(set(tokens.flatten().tolist())) > 10  # the test distinguishes rows and positions


def test_sampled_block_kernel_draws_seeded_rows_by_their_keyed_noise() -> None:
    """Seeded rows of a sampled block draw x_k by the keyed noise of output position key + k from
    the same q_k (the draw plain decoding of that seed makes there); unseeded rows beside them
    keep their inverse-CDF draws."""
    from dspark_server.engine.noise import NoiseKey, keyed_argmax, row_keys
    from dspark_server.engine.request import SamplingParams
    from dspark_server.engine.sampling import SamplingTensors, inverse_cdf, shape_probs

    d = _kernel_drafter("markov")
    g = torch.Generator().manual_seed(7)
    rows = 6
    base = torch.randn(rows, 7, V, generator=g) * 3
    anchors = torch.randint(0, V, (rows,), generator=g)
    temps = [1.0, 0.7, 1.0, 1.3, 0.8, 1.0]
    uniforms = torch.rand(rows, 7, generator=g)
    keys = [NoiseKey(11 * r, 5 + r) if r % 2 == 0 else None for r in range(rows)]
    got = d.sampled_tokens(base, anchors, torch.tensor(temps), uniforms, row_keys(keys, 7))
    assert got is not None
    tokens, probs = got
    sampling = SamplingTensors.from_params([SamplingParams(temperature=t) for t in temps])
    prev, state = anchors, d.init_head_state(torch.zeros(rows, H))
    for k in range(7):
        logits, state = d.step_logits(base[:, k], prev, torch.zeros(rows, H), state)
        q = shape_probs(logits, sampling)
        torch.testing.assert_close(probs[:, k], q, atol=1e-6, rtol=1e-4)
        prev = inverse_cdf(q, uniforms[:, k])
        for r, key in enumerate(keys):
            if key is not None:
                prev[r] = keyed_argmax(probs[r, k : k + 1], key.shifted(k))[0]
        assert torch.equal(tokens[:, k], prev), k
    unseeded = d.sampled_tokens(base, anchors, torch.tensor(temps), uniforms)
    assert unseeded is not None
    assert torch.equal(unseeded[0][1::2], tokens[1::2])
    assert not torch.equal(unseeded[0][0::2], tokens[0::2])


def test_training_gradients_reach_only_drafter() -> None:
    t = make_target()
    d = make_drafter(t, "rnn").train()
    ids, feats = data()
    out = d.forward_train(feats, ids, torch.tensor([[2, 9], [4, 14]]))
    (out.logits.logsumexp(-1).mean() + out.confidence_logits.mean()).backward()
    assert all(p.grad is not None for p in d.parameters())
    assert all(p.grad is None for p in t.parameters())
    assert not any(p is t.lm_head.weight or p is t.model.embed_tokens.weight for p in d.parameters())


def test_default_target_layer_ids_match_deepspec() -> None:
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # DeepSpec's Qwen3-8B config
    assert default_target_layer_ids(4, 5) == (1,)


def test_config_rejects_inconsistent_fields() -> None:
    t = make_target()
    base = make_drafter(t).config
    for bad in (
        {"target_layer_ids": (2, 1)},
        {"target_layer_ids": (0, 4)},
        {"mask_token_id": V},
        {"gamma": 0},
        {"markov_rank": 0, "confidence_head_with_markov": True},
        {"markov_head_type": "lstm"},
    ):
        with pytest.raises(ValueError):
            dataclasses.replace(base, **bad)
    with pytest.raises(ValueError, match="layer"):
        DSparkDrafter(dataclasses.replace(base, num_target_layers=6, target_layer_ids=(0, 5)), t)


def test_training_wiring_reduces_loss() -> None:
    """Target features/logits via DenseCausalAttention -> forward_train -> dspark_loss -> Adam."""
    t = make_target()
    d = make_drafter(t, "markov").train()
    b, g = 4, d.gamma
    ids = torch.randint(0, V - 1, (b, S), generator=torch.Generator().manual_seed(7))
    loss_mask = torch.ones(b, S)
    loss_mask[:, :3] = 0
    with torch.no_grad():
        out = t(
            ids.reshape(-1),
            torch.arange(S).repeat(b),
            DenseCausalAttention(b, S),
            capture_layers=d.capture_layers,
        )
    feats, tlogits = out.hidden.view(b, S, -1), out.logits.view(b, S, V)
    anchors, valid = sample_anchors(loss_mask, 6, generator=torch.Generator().manual_seed(0))
    labels, mask = block_labels(ids, loss_mask, anchors, valid, g)
    target_block = gather_rows(tlogits, label_positions(anchors, g) - 1)
    opt = torch.optim.Adam(d.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        o = d.forward_train(feats, ids, anchors)
        res = dspark_loss(o.logits, target_block, labels, mask, o.confidence_logits, LossConfig())
        opt.zero_grad()
        res.loss.backward()
        opt.step()
        losses.append(float(res.loss.detach()))
    assert losses[-1] < 0.8 * losses[0]
