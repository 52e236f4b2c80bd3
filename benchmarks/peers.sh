#!/usr/bin/env bash
# Our engine (off, dspark) vs transformers generate() (plain, assisted with a 1-layer truncated
# assistant, prompt lookup) on the demo target, concurrency 1.
source "$(dirname "$0")/common.sh"
exec "$DSPARK" bench --suite peers --modes off,dspark \
  --prompts "$(prompts humaneval mt-bench)" --limit "${LIMIT:-10}" \
  --max-tokens "${MAX_TOKENS:-128}" --out "$OUT/peers" "$@"
