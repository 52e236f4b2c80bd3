#!/usr/bin/env bash
# Engine-level figures (no HTTP): continuous-batching decode throughput, speculation modes side by
# side at concurrency 1 and 64 (64 prompts per file), and the draft step's sequential-head share at 1 and 64 requests.
source "$(dirname "$0")/common.sh"
"$PY" -m tools.decode_throughput --out "$OUT/decode" --rounds 3 --threads 1
"$PY" -m tools.generate_modes --prompts "$(prompts humaneval mt-bench)" \
  --limit "${LIMIT:-32}" --max-tokens "${MAX_TOKENS:-128}" --modes off,fixed,threshold,dspark --rounds 2 \
  --out "$OUT/generate_modes"
"$PY" -m tools.generate_modes --prompts "$(prompts humaneval mt-bench)" \
  --limit 64 --max-tokens "${MAX_TOKENS:-128}" --concurrency 64 --modes off,fixed,threshold,dspark --rounds 2 \
  --out "$OUT/generate_modes_c64"
"$PY" -m tools.draft_timing --model "$DEMO/target" \
  --drafts "$DEMO/draft,${RNN_DRAFT:-$ROOT/work_data/drafters/rnn}" --requests 1 64 --context 256 \
  --threads 1 --repeats 15 --json "$OUT/draft_timing/draft_timing.json"
