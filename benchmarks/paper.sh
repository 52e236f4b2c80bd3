#!/usr/bin/env bash
# Every paper figure the inputs allow, in one go (each also has its own script): per-position
# acceptance vs the parallel-only drafter, γ = 7 vs 15, threshold sweep, ECE before/after STS, TPS
# and verification budget vs concurrency (from serving_sweep.sh's results if present).
source "$(dirname "$0")/common.sh"
extra=()
if [[ -f "$DEMO/draft_none/config.json" ]]; then extra+=(--parallel-draft "$DEMO/draft_none"); fi
if [[ -f "$DEMO/draft_g15/config.json" ]]; then extra+=(--gamma-drafts "$DEMO/draft,$DEMO/draft_g15"); fi
if [[ -f "$OUT/serving/results.json" ]]; then extra+=(--results "$OUT/serving/results.json"); fi
exec "$PY" -m tools.paper --suite paper "${extra[@]}" \
  --prompts "$(prompts humaneval mt-bench)" --limit "${LIMIT:-40}" \
  --max-tokens "${MAX_TOKENS:-128}" --concurrency 1,16,64 --out "$OUT/paper" "$@"
