#!/usr/bin/env bash
# docs/benchmarks.md from the result JSON files above (tables are generated, never typed).
source "$(dirname "$0")/common.sh"
files=()
for f in serving/results.json paper/concurrency/concurrency.json peers/peers.json oracle/oracle.json \
         paper/acceptance/acceptance.json \
         paper/gamma/acceptance.json paper/threshold_sweep/threshold_sweep.json paper/ece/ece.json; do
  if [[ -f "$OUT/$f" ]]; then files+=(--results "$OUT/$f"); fi
done
exec "$DSPARK" bench --suite report "${files[@]}" --title "Benchmarks" --out "${DOC:-$ROOT/docs/benchmarks.md}"
