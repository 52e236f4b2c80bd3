"""The mutations the suite must catch: known ways of breaking lossless speculative sampling.

Each edit names a file by a glob relative to the repository root (so a module that moves inside
its package is still found), the exact text it replaces and the text it puts there; the text must
occur exactly once among the matching files, or the gate stops and says so (code that moved or
changed must be re-pointed here, never skipped). ``tests`` are the pytest node ids that must turn
red under the mutation.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Edit:
    glob: str
    old: str
    new: str


@dataclass(frozen=True)
class Mutation:
    name: str
    description: str
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]


DIST = "tests/test_spec_distribution.py::test_joint_distribution_of_first_tokens_equals_plain_sampling"
CAUSAL = "tests/test_spec_causality.py"
SEEDED = (
    "tests/test_spec_distribution.py::test_seeded_requests_sample_plain_distribution_by_coupled_verification"
)
ENGINE = "dspark_server/engine/**/*.py"

MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "bonus-argmax",
        "after at least one accepted draft the bonus token is the target's argmax, not a sample",
        (
            Edit(
                ENGINE,
                "    tokens = inverse_cdf(final, uniforms[:, width])\n",
                "    tokens = inverse_cdf(final, uniforms[:, width])\n"
                "    tokens = torch.where(~rejected & (accepted > 0), final.argmax(dim=1), tokens)\n",
            ),
        ),
        (f"{DIST}[fixed]",),
    ),
    Mutation(
        "confidence-reads-x_k",
        "the confidence head is fed x_k (the token it judges) instead of x_{k-1}",
        (Edit(ENGINE, "torch.stack(prevs, dim=1)", "torch.stack(tokens, dim=1)"),),
        (CAUSAL, f"{DIST}[threshold]"),
    ),
    Mutation(
        "unshaped-draft-q",
        "acceptance uses the draft distribution before temperature / top-k / top-p shaping",
        (Edit(ENGINE, "probs.append(qk)", "probs.append(torch.softmax(step_logits.float(), dim=-1))"),),
        (f"{DIST}[fixed]",),
    ),
    Mutation(
        "residual-is-target",
        "a rejected draft is corrected from p instead of normalize(max(0, p - q))",
        (Edit(ENGINE, "residual = torch.clamp(final - q_at, min=0.0)", "residual = final.clone()"),),
        (f"{DIST}[fixed]", "tests/test_verify.py"),
    ),
    Mutation(
        "planner-no-early-stop",
        "the DSpark planner admits the best prefix of its walk instead of stopping at the first drop",
        (
            Edit(
                "dspark_server/planner/planner.py",
                "admitted = int(declines[0]) if declines.size else values.size",
                "admitted = int(np.argmax(theta))",
            ),
            Edit(  # one request's plain-float walk: the best of the walk, past a drop
                "dspark_server/planner/planner.py",
                "            if next_theta <= theta or admitted >= cap:\n                break\n"
                "            tau, theta, admitted = next_tau, next_theta, k + 1",
                "            if admitted >= cap:\n                break\n"
                "            if next_theta > theta:\n"
                "                tau, theta, admitted = next_tau, next_theta, k + 1",
            ),
        ),
        (CAUSAL, "tests/test_causality.py"),
    ),
    Mutation(
        "stop-inside-block-ignored",
        "a stop token inside a multi-token commit does not end the commit",
        (
            Edit(
                "dspark_server/engine/outputs.py",
                "            if req.finish_reason is not None:\n                break\n",
                "            if req.finish_reason is not None and len(tokens) == 1:\n                break\n",
            ),
            Edit(  # requests without stop strings take the ids-only path
                "dspark_server/engine/outputs.py",
                '                req.finish_reason = "stop"\n                break\n',
                '                req.finish_reason = "stop"\n'
                "                if len(tokens) == 1:\n                    break\n",
            ),
        ),
        (f"{DIST}[fixed]",),
    ),
    Mutation(
        "verify-past-max-tokens",
        "the verify length is not capped by the tokens a request may still emit",
        (
            Edit(
                ENGINE,
                "r.params.max_tokens - len(r.output_ids) - 1",
                "r.params.max_tokens - len(r.output_ids)",
            ),
        ),
        ("tests/test_spec_block_limits.py",),
    ),
    Mutation(
        "max-tokens-inside-block-ignored",
        "uncapped verify lengths and max_tokens checked once per commit: a block overshoots",
        (
            Edit(
                ENGINE,
                "r.params.max_tokens - len(r.output_ids) - 1",
                "r.params.max_tokens - len(r.output_ids)",
            ),
            Edit(
                "dspark_server/engine/outputs.py",
                "elif len(req.output_ids) >= p.max_tokens:",
                "elif len(req.output_ids) >= p.max_tokens and kept == len(tokens):",
            ),
            Edit(  # requests without stop strings take the ids-only path
                "dspark_server/engine/outputs.py",
                "            if kept >= room:\n",
                "            if kept >= room and kept == len(tokens):\n",
            ),
        ),
        (f"{DIST}[fixed]",),
    ),
    Mutation(
        "seeded-emits-draft",
        "coupled verification of a seeded request emits its draft at the first mismatch",
        (Edit(ENGINE, "    return n, draws[n]\n", "    return n, (drafts + draws)[n]\n"),),
        (
            f"{SEEDED}[fixed]",
            "tests/test_spec_scheduling.py::test_seeded_requests_emit_the_same_tokens_in_every_mode_and_load",
        ),
    ),
    Mutation(
        "seeded-noise-unkeyed",
        "a seeded request's noise ignores the output position (one Gumbel vector for all tokens)",
        (Edit("dspark_server/engine/noise.py", "_mix64(key.position + 1)", "_mix64(1)"),),
        (f"{SEEDED}[off]",),
    ),
)
