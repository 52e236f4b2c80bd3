#!/usr/bin/env bash
# γ = 7 vs γ = 15. The γ = 15 drafter must be trained as such (the block size is part of the
# drafter and of its training targets), with the demo drafter's data and other options:
#   dspark train draft --target dspark_server/assets/demo/target --data work_data/draft_data \
#       --gamma 15 --out dspark_server/assets/demo/draft_g15
# (Serving it at concurrency C needs --max-batch-tokens >= 16 C.)
source "$(dirname "$0")/common.sh"
G15="${G15_DRAFT:-$DEMO/draft_g15}"
exec "$PY" -m tools.paper --suite acceptance --drafts "$DEMO/draft,$G15" --labels "γ=7,γ=15" \
  --prompts "$(prompts humaneval mt-bench)" --limit "${LIMIT:-40}" \
  --max-tokens "${MAX_TOKENS:-128}" --out "$OUT/paper/gamma" "$@"
