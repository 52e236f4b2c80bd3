#!/usr/bin/env bash
# ECE per position before / after STS, from the calibration JSON `dspark calibrate` wrote
# (default: the demo drafter's shipped calibration).
source "$(dirname "$0")/common.sh"
exec "$PY" -m tools.paper --suite ece --out "$OUT/paper/ece" "$@"
