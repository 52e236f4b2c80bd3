#!/usr/bin/env bash
# TPS and verification budget vs concurrency, from the serving sweep (run serving_sweep.sh first,
# or drop --results to run a sweep here).
source "$(dirname "$0")/common.sh"
exec "$PY" -m tools.paper --suite concurrency --results "$OUT/serving/results.json" \
  --out "$OUT/paper/concurrency" "$@"
