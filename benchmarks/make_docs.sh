#!/usr/bin/env bash
# docs/benchmarks.md from the result JSON files above (tables are generated, never typed).
source "$(dirname "$0")/common.sh"
files=()
for f in decode/results.json generate_modes/results.json generate_modes_c64/results.json \
         "$ROOT/profiles/target__amd-epyc__2t.json" \
         paper/acceptance_t0/acceptance.json paper/acceptance_t1/acceptance.json \
         draft_timing/draft_timing.json paper/ece/ece.json \
         serving/results.json paper/concurrency/concurrency.json oracle/oracle.json peers/peers.json \
         paper/gamma/acceptance.json paper/threshold_sweep/threshold_sweep.json; do
  [[ "$f" = /* ]] || f="$OUT/$f"
  if [[ -f "$f" ]]; then files+=(--results "$f"); fi
done
extra=()
if [[ -n "$PROMPTS" ]]; then extra+=(--prompts-dir "$PROMPTS"); fi  # shown as $PROMPTS in the page
exec "$PY" -m tools.report "${files[@]}" "${extra[@]}" --title "Benchmarks" \
  --preface "$ROOT/benchmarks/preface.md" --out "${DOC:-$ROOT/docs/benchmarks.md}"
