#!/usr/bin/env bash
# Per-position acceptance: the DSpark drafter vs a parallel-only drafter (no sequential head).
# The parallel-only drafter, with the demo drafter's data and steps (docs/models.md):
#   dspark train draft --target dspark_server/assets/demo/target --data work_data/draft_data \
#       --head none --out dspark_server/assets/demo/draft_none
source "$(dirname "$0")/common.sh"
PARALLEL="${PARALLEL_DRAFT:-$DEMO/draft_none}"
exec "$DSPARK" bench --suite acceptance --drafts "$DEMO/draft,$PARALLEL" --labels "dspark,parallel-only" \
  --prompts "$PROMPTS/humaneval.jsonl,$PROMPTS/mt-bench.jsonl,$PROMPTS/gsm8k.jsonl" --limit "${LIMIT:-40}" \
  --max-tokens "${MAX_TOKENS:-128}" --out "$OUT/paper/acceptance" "$@"
