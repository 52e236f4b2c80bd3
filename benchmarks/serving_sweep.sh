#!/usr/bin/env bash
# TPS / latency / acceptance vs concurrency for off, fixed, threshold and dspark: demo pair,
# HumanEval + MT-Bench (all prompts unless LIMIT is set), interleaved (one server per mode, all
# up at once, modes rotated every round), 2 rounds. Run on a quiet machine.
source "$(dirname "$0")/common.sh"
limit=()
if [[ -n "${LIMIT:-}" ]]; then limit=(--limit "$LIMIT"); fi
exec "$DSPARK" bench --self-host --modes off,fixed,threshold,dspark --concurrency 1,16,64 \
  --prompts "$(prompts humaneval mt-bench)" "${limit[@]}" \
  --max-tokens "${MAX_TOKENS:-128}" --rounds "${ROUNDS:-2}" --out "$OUT/serving" "$@"
