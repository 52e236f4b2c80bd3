#!/usr/bin/env bash
# Record full-γ rounds, replay them through off / fixed / threshold / dspark and the oracle.
source "$(dirname "$0")/common.sh"
exec "$DSPARK" bench --suite oracle --concurrency 1,4,16,64 \
  --prompts "$(prompts humaneval mt-bench)" --limit "${LIMIT:-64}" \
  --max-tokens "${MAX_TOKENS:-128}" --out "$OUT/oracle" "$@"
