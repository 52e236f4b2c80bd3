#!/usr/bin/env bash
# Static threshold sweep: acceptance rate and tokens per step vs threshold, one line per domain.
source "$(dirname "$0")/common.sh"
exec "$PY" -m tools.paper --suite threshold-sweep \
  --prompts "$(prompts humaneval mbpp mt-bench gsm8k)" \
  --limit "${LIMIT:-40}" --max-tokens "${MAX_TOKENS:-128}" --out "$OUT/paper/threshold_sweep" "$@"
