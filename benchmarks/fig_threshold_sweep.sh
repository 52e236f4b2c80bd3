#!/usr/bin/env bash
# Static threshold sweep: acceptance rate and tokens per step vs threshold, one line per domain.
source "$(dirname "$0")/common.sh"
exec "$DSPARK" bench --suite threshold-sweep \
  --prompts "$PROMPTS/humaneval.jsonl,$PROMPTS/mbpp.jsonl,$PROMPTS/mt-bench.jsonl,$PROMPTS/gsm8k.jsonl" \
  --limit "${LIMIT:-40}" --max-tokens "${MAX_TOKENS:-128}" --out "$OUT/paper/threshold_sweep" "$@"
