# Sourced by the figure scripts: paths every benchmark shares (override any of them from the
# environment, e.g. `OUT=/tmp/b benchmarks/serving_sweep.sh`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROMPTS="${PROMPTS:-$ROOT/../shared/prompts}"
OUT="${OUT:-$ROOT/runs/bench}"
DEMO="$ROOT/dspark_server/assets/demo"
DSPARK="${DSPARK:-dspark}"
