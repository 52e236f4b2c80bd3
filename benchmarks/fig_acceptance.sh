#!/usr/bin/env bash
# τ and per-position acceptance: the DSpark drafter (Markov head) vs the parallel-only and RNN-head
# ablations, the paper's offline setting (every round verifies all γ drafts), temperature 0 and 1.
# The ablations are trained with the commands in docs/models.md (not shipped).
source "$(dirname "$0")/common.sh"
PARALLEL="${PARALLEL_DRAFT:-$ROOT/work_data/drafters/none}"
RNN="${RNN_DRAFT:-$ROOT/work_data/drafters/rnn}"
for t in 0 1; do
  "$PY" -m tools.paper --suite acceptance --drafts "$DEMO/draft,$PARALLEL,$RNN" --labels "markov,parallel-only,rnn" \
    --prompts "$(prompts humaneval mbpp gsm8k mt-bench)" \
    --limit "${LIMIT:-50}" --max-tokens "${MAX_TOKENS:-128}" --temperature "$t" --seed 0 \
    --record-concurrency 16 --out "$OUT/paper/acceptance_t$t" "$@"
done
